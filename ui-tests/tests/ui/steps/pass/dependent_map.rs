// Proves: `map = dep` maps over a dependency's `Vec` output; map-over-map works too.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "dependentMap", input = Thread)]
mod dependent_map {
    use super::*;

    #[step]
    async fn split(thread: Thread) -> Result<Vec<String>, StepError> {
        Ok(thread.text.split(' ').map(str::to_owned).collect())
    }

    #[step(map = split)]
    async fn upper(word: String) -> Result<String, StepError> {
        Ok(word.to_uppercase())
    }

    #[step(map = upper)]
    async fn len(word: String) -> Result<usize, StepError> {
        Ok(word.len())
    }

    #[step(depends_on = [len, upper])]
    async fn join(upper: Vec<String>, len: Vec<usize>) -> Result<String, StepError> {
        Ok(format!("{}:{}", upper.join(" "), len.len()))
    }
}

fn main() {
    use pgflow_runtime::Flow;
    let shape = DependentMap::shape();
    assert_eq!(shape["steps"][1]["dependencies"], serde_json::json!(["split"]));
    assert_eq!(shape["steps"][3]["dependencies"], serde_json::json!(["len", "upper"]));
}
