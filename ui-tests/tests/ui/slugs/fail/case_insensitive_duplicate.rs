// Proves: slugs equal when lowercased are an error (queue names are lowercase).
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
    #[step(slug = "fetchThread")]
    async fn one(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }

    #[step(slug = "fetchthread")]
    async fn two(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }
}

fn main() {}
