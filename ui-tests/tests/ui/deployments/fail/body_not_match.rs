// Proves: the body must be one `match` on the step parameter; anything else is an error on the offending tokens.
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

#[deployment(alias = "a")]
fn if_else(step: community_v1::Step) {
    if step == community_v1::Step::Classify {
        ClassifyThreads
    } else {
        ClassifyThreads
    }
}

#[deployment(alias = "b")]
fn two_statements(step: community_v1::Step) {
    let s = step;
    match s {
        _ => ClassifyThreads,
    }
}

#[deployment(alias = "c")]
fn empty(_step: community_v1::Step) {}

#[deployment(alias = "d")]
fn other_scrutinee(step: community_v1::Step) {
    match community_v1::Step::Classify {
        _ => ClassifyThreads,
    }
}

fn main() {}
