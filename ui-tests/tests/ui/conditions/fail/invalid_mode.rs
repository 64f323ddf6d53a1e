// Proves: modes are `skip`, `skip_cascade` or `fail`.
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
    #[step(if = { text: "x" }, when_unmet = skip_casade, when_exhausted = retry)]
    async fn fetch(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }
}

fn main() {}
