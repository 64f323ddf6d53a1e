// Proves: two steps with the same slug are an error on the second slug.
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

    #[step(slug = "fetch")]
    async fn again(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }
}

fn main() {}
