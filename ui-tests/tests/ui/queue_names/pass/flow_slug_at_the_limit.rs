// Proves: with `step_queues`, a 44-character flow slug works: `<flow>__0` is exactly 47 characters and is used.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "a_flow_slug_of_exactly_forty_four_characters", input = Thread, step_queues)]
mod at_limit {
    use super::*;

    #[step]
    async fn classify(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }

    #[step]
    async fn a(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }
}

fn main() {
    use at_limit::Step;
    use pgflow_runtime::StepQueued;
    let first = StepQueued::<AtLimit>::queue_for(Step::Classify);
    assert_eq!(first, "a_flow_slug_of_exactly_forty_four_characters__0");
    assert_eq!(first.len(), 47);
    // A one-character step slug still fits its readable name.
    assert_eq!(StepQueued::<AtLimit>::queue_for(Step::A), "a_flow_slug_of_exactly_forty_four_characters__a");
}
