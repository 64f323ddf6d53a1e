// Proves: `StepQueued` on a flow whose slug cannot fit `<flow>__0` is a build error naming the facts (FlowQueueNameError).
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "the_flow_slug_here_is_exactly_forty_five_char", input = Thread)]
mod f {
    #[allow(unused_imports)]
    use super::*;
    #[step]
    async fn classify(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }
}

fn main() {
    let _ = pgflow_runtime::StepQueued::<F>::worker(f::Step::Classify);
}
