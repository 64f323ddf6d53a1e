// Proves: an unknown dependency is an error on the dependency name, with a did-you-mean suggestion.
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

    #[step(depends_on = [fecth])]
    async fn summary(fecth: String) -> Result<String, StepError> {
        Ok(fecth)
    }
}

fn main() {}
