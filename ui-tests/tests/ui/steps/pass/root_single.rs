// Proves: a root single step takes the flow input by value or by reference, with an optional context by value.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "rootSingle", input = Thread)]
mod root_single {
    use super::*;
    use pgflow_runtime::StepContext;

    #[step]
    async fn by_value(thread: Thread) -> Result<usize, StepError> {
        Ok(thread.text.len())
    }

    #[step]
    async fn by_ref(thread: &Thread, ctx: StepContext<RootSingle>) -> Result<String, StepError> {
        let _ = ctx.run_id();
        Ok(thread.text.clone())
    }
}

fn main() {
    use pgflow_runtime::{Flow, FlowStep};
    assert_eq!(RootSingle::SLUG, "rootSingle");
    assert!(root_single::Step::ByRef.takes_flow_input());
    assert_eq!(root_single::Step::ALL.len(), 2);
}
