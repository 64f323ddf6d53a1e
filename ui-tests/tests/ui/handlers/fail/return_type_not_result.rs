// Proves: a handler must return a written-out `Result<T, E>`.
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
    async fn fetch(thread: Thread) -> String {
        thread.text
    }

    #[step]
    async fn nothing(thread: Thread) {
        let _ = thread;
    }
}

fn main() {}
