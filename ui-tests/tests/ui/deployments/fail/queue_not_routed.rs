// Proves: a deployment is accepted for a queue only when it routes a step there (`RoutesTo<Q>`); the error names both.
use pgflow_runtime::{deployment, flow, queue, Queue, RoutesTo};

#[flow(slug = "communityThreadsV1", input = String)]
pub mod community_v1 {
    use pgflow_runtime::StepError;

    #[step]
    async fn classify(thread: String) -> Result<String, StepError> {
        Ok(thread)
    }
}

#[queue("classify_threads")]
pub struct ClassifyThreads;

#[queue("deliver_slack_alerts")]
pub struct DeliverSlackAlerts;

#[deployment(alias = "communityThreads")]
fn community_v1(step: community_v1::Step) {
    match step {
        community_v1::Step::Classify => ClassifyThreads,
    }
}

/// The bound a queue worker for `Q` puts on the deployments it serves.
fn serve<Q: Queue, D: RoutesTo<Q>>() {}

fn main() {
    serve::<ClassifyThreads, CommunityV1>();
    serve::<DeliverSlackAlerts, CommunityV1>();
}
