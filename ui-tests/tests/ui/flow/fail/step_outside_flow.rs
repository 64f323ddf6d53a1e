// Proves: `#[step]` outside a `#[flow]` module is an error.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
use pgflow_runtime::step;

#[step]
async fn lonely(thread: Thread) -> Result<String, StepError> {
    Ok(thread.text)
}

fn main() {}
