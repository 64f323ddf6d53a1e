// Proves: every flow option and every step option is accepted and lands in the shape's `options`.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "allOptions", input = Thread, max_attempts = 0, base_delay = 0, timeout = 1)]
mod all_options {
    use super::*;

    #[step(max_attempts = 5, base_delay = 2, timeout = 2147483647, start_delay = 0)]
    async fn first(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }

    #[step(depends_on = [first], start_delay = 3600)]
    async fn second(first: String) -> Result<String, StepError> {
        Ok(first)
    }
}

fn main() {
    use pgflow_runtime::Flow;
    let s = AllOptions::shape();
    assert_eq!(s["options"], serde_json::json!({"maxAttempts": 0, "baseDelay": 0, "timeout": 1}));
    assert_eq!(s["steps"][0]["options"], serde_json::json!({"maxAttempts": 5, "baseDelay": 2, "timeout": 2147483647, "startDelay": 0}));
    assert_eq!(s["steps"][1]["options"], serde_json::json!({"startDelay": 3600}));
}
