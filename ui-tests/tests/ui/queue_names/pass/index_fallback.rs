// Proves: with `step_queues`, a readable name of exactly 47 characters is used and one of 48 falls back to the step index.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "twenty_character_flw", input = Thread, step_queues)]
mod fallback {
    use super::*;

    #[step]
    async fn exactly_twenty_five_chars(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }

    #[step]
    async fn exactly_twenty_six_chars_x(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }
}

fn main() {
    use fallback::Step;
    use pgflow_runtime::StepQueued;
    let readable = StepQueued::<Fallback>::queue_for(Step::ExactlyTwentyFiveChars);
    assert_eq!(readable, "twenty_character_flw__exactly_twenty_five_chars");
    assert_eq!(readable.len(), 47);
    assert_eq!(StepQueued::<Fallback>::queue_for(Step::ExactlyTwentySixCharsX), "twenty_character_flw__1");
    assert_eq!(StepQueued::<Fallback>::routes().len(), 2);
}
