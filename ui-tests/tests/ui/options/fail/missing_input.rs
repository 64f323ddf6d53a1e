// Proves: `input = Type` is required.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "f")]
mod f {
    #[allow(unused_imports)]
    use super::*;
    #[step]
    async fn fetch(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }
}

fn main() {}
