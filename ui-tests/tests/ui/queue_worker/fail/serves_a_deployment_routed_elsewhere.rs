// Proves: a queue worker accepts only deployments that route a step to its queue; serving another is a compile error that names both and says what to do.
#[allow(unused_imports)]
use pgflow_runtime::{flow, Deployment, OnQueue, Queue, RoutesTo, Routing, StepError, WorkerBuilder};

#[flow(slug = "communityV1", input = String)]
mod community_v1 {
    #[allow(unused_imports)]
    use super::*;
    #[step]
    async fn classify(text: String) -> Result<String, StepError> { Ok(text) }
}

pub struct ClassifyThreads;
impl Queue for ClassifyThreads {
    const NAME: &'static str = "classify_threads";
}

pub struct DeliverAlerts;
impl Queue for DeliverAlerts {
    const NAME: &'static str = "deliver_alerts";
}

pub struct CommunityV1;
impl Deployment for CommunityV1 {
    type Flow = community_v1::CommunityV1;
    const ALIAS: Option<&'static str> = Some("community");
    fn routing() -> Routing<community_v1::Step> {
        Routing::Named(|_| ClassifyThreads::NAME)
    }
}
impl RoutesTo<ClassifyThreads> for CommunityV1 {}

fn deploy(worker: WorkerBuilder<OnQueue<DeliverAlerts>>) -> WorkerBuilder<OnQueue<DeliverAlerts>> {
    worker.serve::<CommunityV1>()
}

fn main() {
    let _ = deploy;
}
