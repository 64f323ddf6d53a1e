// Proves: StepQueued uses the readable name when it fits (47 exactly) and the index fallback otherwise.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "twenty_character_flw", input = Thread)]
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
    use pgflow_runtime::StepQueued;
    use fallback::Step;
    let routes = StepQueued::<Fallback>::routes();
    assert_eq!(routes[0], (Step::ExactlyTwentyFiveChars, "twenty_character_flw__exactly_twenty_five_chars"));
    assert_eq!(routes[0].1.len(), 47);
    assert_eq!(routes[1], (Step::ExactlyTwentySixCharsX, "twenty_character_flw__1"));
}
