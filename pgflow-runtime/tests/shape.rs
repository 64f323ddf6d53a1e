//! The generated `shape()` equals the document SQL `_get_flow_shape` returns, plus options.

use pgflow_runtime::{flow, Flow, StepError};
use serde::{Deserialize, Serialize};
use serde_json::json;

/// Run input shared by the flows below.
#[derive(Serialize, Deserialize)]
pub struct Input {
    /// Some text.
    pub text: String,
}

#[flow(slug = "linear", input = Input, max_attempts = 5, base_delay = 2, timeout = 120)]
mod linear {
    use super::*;

    #[step(timeout = 30)]
    async fn fetch(input: Input) -> Result<String, StepError> {
        Ok(input.text)
    }

    #[step(depends_on = [fetch])]
    async fn parse(fetch: String) -> Result<usize, StepError> {
        Ok(fetch.len())
    }

    #[step(depends_on = [parse], slug = "storeResult")]
    async fn store(parse: usize) -> Result<(), StepError> {
        let _ = parse;
        Ok(())
    }
}

#[flow(slug = "diamond", input = Input)]
mod diamond {
    use super::*;

    #[step]
    async fn root(input: Input) -> Result<String, StepError> {
        Ok(input.text)
    }

    #[step(depends_on = [root])]
    async fn zeta(root: String) -> Result<String, StepError> {
        Ok(root)
    }

    #[step(depends_on = [root])]
    async fn alpha(root: String) -> Result<String, StepError> {
        Ok(root)
    }

    #[step(depends_on = [zeta, alpha])]
    async fn join(zeta: String, alpha: String) -> Result<String, StepError> {
        Ok(zeta + &alpha)
    }
}

#[flow(slug = "mapFlow", input = Vec<Input>)]
mod map_flow {
    use super::*;

    #[step(map)]
    async fn each(item: Input) -> Result<String, StepError> {
        Ok(item.text)
    }

    #[step(map = each, max_attempts = 2, start_delay = 10, when_exhausted = skip)]
    async fn upper(item: String) -> Result<String, StepError> {
        Ok(item.to_uppercase())
    }

    #[step(depends_on = [upper])]
    async fn report(upper: Option<Vec<String>>) -> Result<usize, StepError> {
        Ok(upper.map_or(0, |u| u.len()))
    }
}

#[flow(slug = "conditional", input = Input)]
mod conditional {
    use super::*;

    #[step(if = { text: "help" })]
    async fn classify(input: Input) -> Result<String, StepError> {
        Ok(input.text)
    }

    #[step(depends_on = [classify], if = { classify: "help" }, if_not = { classify: "spam" }, when_unmet = skip_cascade)]
    async fn notify(classify: Option<String>) -> Result<bool, StepError> {
        Ok(classify.is_some())
    }

    #[step(depends_on = [notify, classify], if_not = { "notify": false }, when_unmet = fail, when_exhausted = skip_cascade)]
    async fn finish(notify: bool, classify: Option<String>) -> Result<(), StepError> {
        let _ = (notify, classify);
        Ok(())
    }
}

fn plain(slug: &str, deps: &[&str]) -> serde_json::Value {
    json!({
        "slug": slug,
        "stepType": "single",
        "dependencies": deps,
        "whenUnmet": "skip",
        "whenExhausted": "fail",
        "requiredInputPattern": {"defined": false},
        "forbiddenInputPattern": {"defined": false},
    })
}

#[test]
fn linear_flow_shape_has_flow_and_step_options() {
    let mut fetch = plain("fetch", &[]);
    fetch["options"] = json!({"timeout": 30});
    assert_eq!(
        linear::Linear::shape(),
        json!({
            "options": {"maxAttempts": 5, "baseDelay": 2, "timeout": 120},
            "steps": [fetch, plain("parse", &["fetch"]), plain("storeResult", &["parse"])],
        })
    );
}

#[test]
fn diamond_flow_shape_sorts_dependencies() {
    assert_eq!(
        diamond::Diamond::shape(),
        json!({
            "steps": [
                plain("root", &[]),
                plain("zeta", &["root"]),
                plain("alpha", &["root"]),
                plain("join", &["alpha", "zeta"]),
            ],
        })
    );
}

#[test]
fn map_flow_shape_marks_map_steps() {
    assert_eq!(
        map_flow::MapFlow::shape(),
        json!({
            "steps": [
                {
                    "slug": "each", "stepType": "map", "dependencies": [],
                    "whenUnmet": "skip", "whenExhausted": "fail",
                    "requiredInputPattern": {"defined": false},
                    "forbiddenInputPattern": {"defined": false},
                },
                {
                    "slug": "upper", "stepType": "map", "dependencies": ["each"],
                    "whenUnmet": "skip", "whenExhausted": "skip",
                    "requiredInputPattern": {"defined": false},
                    "forbiddenInputPattern": {"defined": false},
                    "options": {"maxAttempts": 2, "startDelay": 10},
                },
                plain("report", &["upper"]),
            ],
        })
    );
}

#[test]
fn conditional_flow_shape_wraps_patterns() {
    assert_eq!(
        conditional::Conditional::shape(),
        json!({
            "steps": [
                {
                    "slug": "classify", "stepType": "single", "dependencies": [],
                    "whenUnmet": "skip", "whenExhausted": "fail",
                    "requiredInputPattern": {"defined": true, "value": {"text": "help"}},
                    "forbiddenInputPattern": {"defined": false},
                },
                {
                    "slug": "notify", "stepType": "single", "dependencies": ["classify"],
                    "whenUnmet": "skip-cascade", "whenExhausted": "fail",
                    "requiredInputPattern": {"defined": true, "value": {"classify": "help"}},
                    "forbiddenInputPattern": {"defined": true, "value": {"classify": "spam"}},
                },
                {
                    "slug": "finish", "stepType": "single", "dependencies": ["classify", "notify"],
                    "whenUnmet": "fail", "whenExhausted": "skip-cascade",
                    "requiredInputPattern": {"defined": false},
                    "forbiddenInputPattern": {"defined": true, "value": {"notify": false}},
                },
            ],
        })
    );
}
