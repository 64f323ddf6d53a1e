// Proves: a flow without steps cannot opt in to `step_queues`; the error is on the flow slug.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "empty", input = Thread, step_queues)]
mod empty {}

fn main() {
    let _ = pgflow_runtime::StepQueued::<Empty>::routes();
    let _ = StepError::msg("unused");
}
