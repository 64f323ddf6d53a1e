// Proves: options must satisfy the database CHECKs: max_attempts >= 0, base_delay >= 0, timeout > 0, start_delay >= 0, fit an int.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "f", input = Thread, timeout = 0)]
mod f {
    #[allow(unused_imports)]
    use super::*;
    #[step(max_attempts = -1, base_delay = -5, timeout = 0, start_delay = 2147483648)]
    async fn fetch(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }
}

fn main() {}
