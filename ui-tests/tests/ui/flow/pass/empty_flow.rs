// Proves: a flow without steps compiles as a plain flow; other items in the module are left alone.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "emptyFlow", input = Thread)]
pub mod empty_flow {
    pub const UNTOUCHED: u8 = 7;
    pub fn helper() -> u8 {
        UNTOUCHED
    }
}

fn main() {
    use pgflow_runtime::Flow;
    assert_eq!(empty_flow::helper(), 7);
    assert_eq!(EmptyFlow::shape(), serde_json::json!({"steps": []}));
    assert!(empty_flow::Step::ALL.is_empty());
    let _ = StepError::msg("unused");
}
