// Proves: a root step takes only the flow input (plus an optional context).
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
    async fn fetch(thread: Thread, extra: u8) -> Result<String, StepError> {
        let _ = extra;
        Ok(thread.text)
    }
}

fn main() {}
