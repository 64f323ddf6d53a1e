// Proves: a dependency that may be skipped (condition with default `when_unmet = skip`) must be taken as `Option`.
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
    #[step(if = { text: "x" })]
    async fn fetch(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }

    #[step(depends_on = [fetch])]
    async fn summary(fetch: String) -> Result<String, StepError> {
        Ok(fetch)
    }
}

fn main() {}
