// Proves: a condition must be a JSON object (a database CHECK).
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

    #[step(depends_on = [fetch], if = ["fetch"], if_not = "3")]
    async fn summary(fetch: Option<String>) -> Result<(), StepError> {
        let _ = fetch;
        Ok(())
    }
}

fn main() {}
