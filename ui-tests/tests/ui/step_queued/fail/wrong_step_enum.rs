// Proves: `StepQueued::<F>::worker` takes only F's own step enum.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "one", input = Thread, step_queues)]
mod one {
    use super::*;
    #[step]
    async fn classify(thread: Thread) -> Result<String, StepError> { Ok(thread.text) }
}

#[flow(slug = "two", input = Thread, step_queues)]
mod two {
    use super::*;
    #[step]
    async fn classify(thread: Thread) -> Result<String, StepError> { Ok(thread.text) }
}

fn main() {
    let _ = pgflow_runtime::StepQueued::<One>::worker(two::Step::Classify);
    let _ = one::Step::Clasify;
}
