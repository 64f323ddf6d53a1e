// Proves: the flag `step_queues` takes no value; `step_queues = true` is an error on the key.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "f", input = Thread, step_queues = true)]
mod f {
    #[allow(unused_imports)]
    use super::*;
    #[step]
    async fn fetch(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }
}

fn main() {}
