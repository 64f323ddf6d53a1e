// Proves: a step handler cannot be generic.
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
    async fn fetch<T>(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }
}

fn main() {}
