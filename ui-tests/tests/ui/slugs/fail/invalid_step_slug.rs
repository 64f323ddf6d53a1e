// Proves: step slugs follow SQL `is_valid_slug`: no leading digit, no `-`, at most 128 characters.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "f", input = Thread)]
mod f {
    #[allow(unused_imports)]
    use super::*;
    #[step(slug = "1fetch")]
    async fn one(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }

    #[step(slug = "fetch-thread")]
    async fn two(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }

    #[step(slug = "")]
    async fn three(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }

    #[step(slug = "a123456789b123456789c123456789d123456789e123456789f123456789g123456789h123456789i123456789j123456789k123456789l123456789m1234567890")]
    async fn four(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }
}

fn main() {}
