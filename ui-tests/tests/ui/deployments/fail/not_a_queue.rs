// Proves: a route must name a declared queue type: a string is refused at expansion time, a type that is not a queue is an error on that arm.
use pgflow_runtime::{deployment, flow};

#[flow(slug = "communityThreadsV1", input = String)]
pub mod community_v1 {
    use pgflow_runtime::StepError;

    #[step]
    async fn classify(thread: String) -> Result<String, StepError> {
        Ok(thread)
    }
}

pub struct NotAQueue;

#[deployment(alias = "a")]
fn by_name(step: community_v1::Step) {
    match step {
        community_v1::Step::Classify => "classify_threads",
    }
}

#[deployment(alias = "b")]
fn not_declared(step: community_v1::Step) {
    match step {
        community_v1::Step::Classify => NotAQueue,
    }
}

fn main() {}
