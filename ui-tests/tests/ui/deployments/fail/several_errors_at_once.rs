// Proves: errors are collected: one build reports every mistake of a deployment (arguments, signature, arms), without follow-on errors where it is used.
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

#[deployment(alias = "community threads", alais = "x")]
async fn community_v1(step: community_v1::Step) -> &'static str {
    match step {
        community_v1::Step::Classify if true => ClassifyThreads,
        _ => "classify_threads",
    }
}

fn serve<Q: Queue, D: RoutesTo<Q>>() {}

fn main() {
    serve::<ClassifyThreads, CommunityV1>();
}
