// Proves: a parameter that names no dependency is an error on the parameter, with a suggestion.
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
    #[step]
    async fn fetch(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }

    #[step(depends_on = [fetch])]
    async fn summary(fetch: String, fetched: String) -> Result<String, StepError> {
        Ok(fetch + &fetched)
    }
}

fn main() {}
