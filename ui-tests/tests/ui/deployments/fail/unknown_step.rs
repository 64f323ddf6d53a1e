// Proves: a route for a step the flow does not have is rustc's error on the user's own pattern.
use pgflow_runtime::{deployment, flow, queue};

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

#[deployment(alias = "communityThreads", name = CommunityV1Deployment)]
fn community_v1(step: community_v1::Step) {
    match step {
        community_v1::Step::Classify => ClassifyThreads,
        community_v1::Step::Archive => ClassifyThreads,
    }
}

fn main() {}
