// Proves: an empty flow cannot be step-queued.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "empty", input = Thread)]
mod empty {}

fn main() {
    let _ = pgflow_runtime::StepQueued::<Empty>::routes();
    let _ = StepError::msg("unused");
}
