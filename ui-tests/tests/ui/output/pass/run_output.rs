// Proves: the run output struct has one field per leaf (by slug), with `Option` for leaves that may be skipped, including by an upstream cascade.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "outputs", input = Thread)]
mod outputs {
    use super::*;

    #[step]
    async fn root(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }

    #[step(depends_on = [root], slug = "plainLeaf")]
    async fn plain_leaf(root: String) -> Result<u32, StepError> {
        Ok(root.len() as u32)
    }

    #[step(depends_on = [root], if = { root: "x" })]
    async fn skippable_leaf(root: String) -> Result<bool, StepError> {
        Ok(root.is_empty())
    }

    #[step(depends_on = [root], when_exhausted = skip_cascade)]
    async fn cascading(root: String) -> Result<String, StepError> {
        Ok(root)
    }

    #[step(depends_on = [cascading])]
    async fn below_cascade(cascading: String) -> Result<String, StepError> {
        Ok(cascading)
    }
}

fn main() {
    use pgflow_runtime::Flow;
    let out: <Outputs as Flow>::Output =
        serde_json::from_value(serde_json::json!({"plainLeaf": 0})).unwrap();
    let outputs::OutputsOutput { plain_leaf, skippable_leaf, below_cascade } = out;
    assert_eq!(plain_leaf, 0);
    assert_eq!(skippable_leaf, None::<bool>);
    assert_eq!(below_cascade, None::<String>);
}
