// Proves: an option or flag given twice is an error on the second one.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "f", input = Thread, step_queues, step_queues)]
mod f {
    #[allow(unused_imports)]
    use super::*;
    #[step(timeout = 5, timeout = 6)]
    async fn fetch(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }
}

fn main() {}
