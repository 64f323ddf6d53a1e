// Proves: a queue worker serves only deployments that route a step to its queue; `serve::<D>()` of another is a compile error that names both and says what to do.
use pgflow_runtime::{deployment, flow, queue, worker::OnQueue, worker::WorkerBuilder};

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

#[deployment(alias = "communityThreads", name = CommunityV1Deployment)]
pub fn community_v1(step: community_v1::Step) {
    match step {
        community_v1::Step::Classify => ClassifyThreads,
    }
}

fn deploy(
    classify: WorkerBuilder<OnQueue<ClassifyThreads>>,
    deliver: WorkerBuilder<OnQueue<DeliverSlackAlerts>>,
) {
    let _ = classify.serve::<CommunityV1Deployment>();
    let _ = deliver.serve::<CommunityV1Deployment>();
}

fn main() {
    let _ = deploy;
}
