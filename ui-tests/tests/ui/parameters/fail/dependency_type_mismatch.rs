// Proves: a parameter type that differs from the dependency's output type is an error on the parameter type.
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
    async fn summary(fetch: u64) -> Result<u64, StepError> {
        Ok(fetch)
    }
}

fn main() {}
