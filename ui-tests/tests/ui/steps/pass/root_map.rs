// Proves: `map` makes a root map step over a `Vec` flow input; the handler takes one element and the step output is `Vec<T>`.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "rootMap", input = Vec<Thread>)]
mod root_map {
    use super::*;

    #[step(map)]
    async fn score(thread: Thread) -> Result<f64, StepError> {
        Ok(thread.text.len() as f64)
    }

    #[step(depends_on = [score])]
    async fn total(score: Vec<f64>) -> Result<f64, StepError> {
        Ok(score.iter().sum())
    }
}

fn main() {
    use pgflow_runtime::{Flow, FlowStep, flows::StepKind};
    assert_eq!(root_map::Step::Score.kind(), StepKind::Map);
    assert_eq!(RootMap::shape()["steps"][0]["stepType"], "map");
}
