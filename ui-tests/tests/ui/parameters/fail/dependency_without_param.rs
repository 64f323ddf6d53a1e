// Proves: a dependency with no parameter is an error on the dependency.
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

    #[step]
    async fn count(thread: Thread) -> Result<u32, StepError> {
        Ok(thread.text.len() as u32)
    }

    #[step(depends_on = [fetch, count])]
    async fn summary(fetch: String) -> Result<String, StepError> {
        Ok(fetch)
    }
}

fn main() {}
