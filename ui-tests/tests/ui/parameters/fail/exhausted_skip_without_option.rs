// Proves: `when_exhausted = skip` also makes the dependency optional for its dependents.
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
    #[step(when_exhausted = skip)]
    async fn fetch(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }

    #[step(depends_on = [fetch])]
    async fn summary(fetch: String) -> Result<String, StepError> {
        Ok(fetch)
    }
}

fn main() {}
