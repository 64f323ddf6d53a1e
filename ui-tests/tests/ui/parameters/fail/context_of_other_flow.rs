// Proves: the context must be `StepContext` of this very flow.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "other", input = Thread)]
mod other {}


#[flow(slug = "f", input = Thread)]
mod f {
    #[allow(unused_imports)]
    use super::*;
    #[step]
    async fn fetch(thread: Thread, ctx: &pgflow_runtime::StepContext<crate::Other>) -> Result<String, StepError> {
        let _ = ctx;
        Ok(thread.text)
    }
}

fn main() {}
