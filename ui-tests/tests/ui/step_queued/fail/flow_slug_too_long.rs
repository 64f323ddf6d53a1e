// Proves: with `step_queues`, a flow slug too long for `<flow>__0` is an error on the slug that `cargo check` shows, naming both names, the limit and how much to shorten.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "the_flow_slug_here_is_exactly_forty_five_char", input = Thread, step_queues)]
mod f {
    #[allow(unused_imports)]
    use super::*;
    #[step]
    async fn classify(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }
}

fn main() {
    // No follow-on error here: the flow still implements `StepQueueRoutes`.
    let _ = pgflow_runtime::StepQueued::<F>::worker(f::Step::Classify);
}
