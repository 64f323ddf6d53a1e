// Proves: a dependency declared after its dependent is an error (source order is step order, which rules out cycles).
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
    #[step(depends_on = [fetch])]
    async fn summary(fetch: String) -> Result<String, StepError> {
        Ok(fetch)
    }

    #[step]
    async fn fetch(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }
}

fn main() {}
