// Proves: a step without a route is rustc's non-exhaustive-match error on the user's `match`, naming the step.
use pgflow_runtime::{deployment, flow, queue};

#[flow(slug = "communityThreadsV1", input = String)]
pub mod community_v1 {
    use pgflow_runtime::StepError;

    #[step]
    async fn classify(thread: String) -> Result<String, StepError> {
        Ok(thread)
    }

    #[step(depends_on = [classify], slug = "deliverSlack")]
    async fn deliver_slack(classify: String) -> Result<(), StepError> {
        let _ = classify;
        Ok(())
    }
}

#[queue("classify_threads")]
pub struct ClassifyThreads;

#[deployment(alias = "communityThreads", name = CommunityV1Deployment)]
fn community_v1(step: community_v1::Step) {
    match step {
        community_v1::Step::Classify => ClassifyThreads,
    }
}

fn main() {}
