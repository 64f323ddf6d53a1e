// Proves: the alias is a valid slug (SQL `is_valid_slug`): an error on the literal with a fix; a missing alias is an error too.
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

#[deployment(alias = "community-threads")]
fn hyphenated(step: community_v1::Step) {
    match step {
        community_v1::Step::Classify => ClassifyThreads,
    }
}

#[deployment(alias = "run")]
fn reserved(step: community_v1::Step) {
    match step {
        community_v1::Step::Classify => ClassifyThreads,
    }
}

#[deployment(name = NoAlias)]
fn no_alias(step: community_v1::Step) {
    match step {
        community_v1::Step::Classify => ClassifyThreads,
    }
}

fn main() {}
