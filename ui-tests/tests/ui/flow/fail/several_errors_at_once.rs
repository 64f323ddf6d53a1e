// Proves: errors are collected: one build reports every mistake, without follow-on errors.
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
    #[step(slug = "run")]
    async fn fetch(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }

    #[step(depends_on = [fetchh], when_unmet = skip)]
    fn summary(fetch: String) -> Result<String, StepError> {
        Ok(fetch)
    }

    #[step(depends_on = [summary], timeout = 0)]
    async fn publish(summary: String, extra: u8) -> Result<(), StepError> {
        let _ = (summary, extra);
        Ok(())
    }
}

fn main() {}
