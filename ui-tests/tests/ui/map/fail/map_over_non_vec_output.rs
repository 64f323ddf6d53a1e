// Proves: `map = dep` over an output that is not a `Vec` is an error on the dependency name.
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

    #[step(map = fetch)]
    async fn each(item: char) -> Result<u8, StepError> {
        Ok(item as u8)
    }
}

fn main() {}
