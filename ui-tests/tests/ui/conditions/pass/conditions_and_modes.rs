// Proves: `if`/`if_not` patterns with every JSON form, every `when_unmet`/`when_exhausted` mode, and `Option` exactly where a dependency may be skipped.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[derive(Serialize, Deserialize)]
pub struct Label {
    pub route: String,
}

#[flow(slug = "conditions", input = Thread)]
mod conditions {
    use super::*;

    #[step(if = { text: "hello", "quoted key": [1, -2, 3.5, true, false, null], nested: { a: {} } })]
    async fn classify(thread: Thread) -> Result<Label, StepError> {
        Ok(Label { route: thread.text })
    }

    #[step(depends_on = [classify], if = { classify: { route: "help" } }, when_unmet = skip_cascade)]
    async fn cascade(classify: Option<Label>) -> Result<u8, StepError> {
        Ok(classify.map_or(0, |_| 1))
    }

    #[step(depends_on = [cascade], if_not = "{\"cascade\": 0}", when_unmet = fail)]
    async fn strict(cascade: u8) -> Result<bool, StepError> {
        Ok(cascade == 1)
    }

    #[step(depends_on = [strict], when_exhausted = skip)]
    async fn flaky(strict: bool) -> Result<String, StepError> {
        Ok(strict.to_string())
    }

    #[step(depends_on = [flaky], when_exhausted = skip_cascade)]
    async fn after(flaky: Option<String>) -> Result<(), StepError> {
        let _ = flaky;
        Ok(())
    }

    #[step(depends_on = [after, strict], when_exhausted = fail)]
    async fn last(after: (), strict: bool) -> Result<bool, StepError> {
        let () = after;
        Ok(strict)
    }
}

fn main() {
    use pgflow_runtime::Flow;
    let s = Conditions::shape();
    assert_eq!(s["steps"][0]["requiredInputPattern"]["value"]["quoted key"], serde_json::json!([1, -2, 3.5, true, false, null]));
    assert_eq!(s["steps"][1]["whenUnmet"], "skip-cascade");
    assert_eq!(s["steps"][2]["forbiddenInputPattern"], serde_json::json!({"defined": true, "value": {"cascade": 0}}));
    assert_eq!(s["steps"][3]["whenExhausted"], "skip");
    assert_eq!(s["steps"][4]["whenExhausted"], "skip-cascade");
}
