// Proves: the flow slug follows SQL `is_valid_slug`.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "my-flow", input = Thread)]
mod f {
    #[allow(unused_imports)]
    use super::*;
    #[step]
    async fn fetch(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }
}

fn main() {}
