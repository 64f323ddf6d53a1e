// Proves: a map step names its single source with `map = dep`, not `depends_on`.
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

    #[step(map, depends_on = [split])]
    async fn each(item: String) -> Result<String, StepError> {
        Ok(item)
    }
}

fn main() {}
