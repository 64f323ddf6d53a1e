// Proves: a root `map` needs a `Vec` flow input; the error is on `map`.
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
    #[step(map)]
    async fn each(item: Thread) -> Result<String, StepError> {
        Ok(item.text)
    }
}

fn main() {}
