// Proves: the handler error must convert into `StepError`; the error is on the error type.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[derive(Debug)]
pub struct MyError;

#[flow(slug = "f", input = Thread)]
mod f {
    #[allow(unused_imports)]
    use super::*;
    #[step]
    async fn fetch(thread: Thread) -> Result<String, MyError> {
        Ok(thread.text)
    }
}

fn main() {}
