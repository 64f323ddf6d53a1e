// Proves: `run` is a reserved slug, whether it comes from the function name or `slug = ..`.
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
    async fn run(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }

    #[step(slug = "run")]
    async fn other(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }
}

fn main() {}
