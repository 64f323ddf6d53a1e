// Proves: unknown options are errors with a did-you-mean suggestion.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "f", input = Thread, max_attempt = 3)]
mod f {
    #[allow(unused_imports)]
    use super::*;
    #[step(depend_on = [x], retries = 3)]
    async fn fetch(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }
}

fn main() {}
