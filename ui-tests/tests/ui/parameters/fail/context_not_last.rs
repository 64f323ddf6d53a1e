// Proves: the `StepContext` parameter must come last.
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
    async fn fetch(ctx: &pgflow_runtime::StepContext<F>, thread: Thread) -> Result<String, StepError> {
        let _ = ctx;
        Ok(thread.text)
    }
}

fn main() {}
