// Proves: a guard in a route is refused: routes are static, one queue per step.
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

#[queue("fallback")]
pub struct Fallback;

const BUSY: bool = false;

#[deployment(alias = "communityThreads")]
fn community_v1(step: community_v1::Step) {
    match step {
        community_v1::Step::Classify if BUSY => Fallback,
        _ => ClassifyThreads,
    }
}

fn main() {}
