// Proves: the output type must be `Serialize + DeserializeOwned`; the error is on the type.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
pub struct Opaque;

#[flow(slug = "f", input = Thread)]
mod f {
    #[allow(unused_imports)]
    use super::*;
    #[step]
    async fn fetch(thread: Thread) -> Result<Opaque, StepError> {
        let _ = thread;
        Ok(Opaque)
    }
}

fn main() {}
