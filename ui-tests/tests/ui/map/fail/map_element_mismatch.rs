// Proves: a map step's parameter must be the element type of its source array.
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
    async fn split(thread: Thread) -> Result<Vec<String>, StepError> {
        Ok(vec![thread.text])
    }

    #[step(map = split)]
    async fn each(item: u32) -> Result<u32, StepError> {
        Ok(item)
    }
}

fn main() {}
