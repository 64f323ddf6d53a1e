// Proves: `StepQueued` on a flow without `step_queues` does not compile, and the error says how to opt in.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "plainFlow", input = Thread)]
mod plain {
    use super::*;
    #[step]
    async fn classify(thread: Thread) -> Result<String, StepError> { Ok(thread.text) }
}

fn main() {
    let _ = pgflow_runtime::StepQueued::<Plain>::worker(plain::Step::Classify);
}
