// Proves: dependent steps take one parameter per dependency, in any order, `_name` allowed, context last by reference.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "dependentSingle", input = Thread)]
mod dependent_single {
    use super::*;
    use pgflow_runtime::StepContext;

    #[step]
    async fn fetch(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }

    #[step]
    async fn count(thread: Thread) -> Result<u32, StepError> {
        Ok(thread.text.len() as u32)
    }

    #[step(depends_on = [fetch, count])]
    async fn summary(count: u32, _fetch: String, ctx: &StepContext<DependentSingle>) -> Result<(), StepError> {
        let _ = (count, ctx.task_index());
        Ok(())
    }
}

fn main() {
    use pgflow_runtime::FlowStep;
    use dependent_single::Step;
    assert_eq!(Step::Summary.dependencies(), &[Step::Fetch, Step::Count]);
    assert_eq!(Step::Summary.index(), 2);
}
