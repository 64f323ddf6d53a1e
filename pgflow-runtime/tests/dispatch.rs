//! `Flow::dispatch` without a database: typed inputs, skipped dependencies, exact outputs, errors.

use std::sync::Arc;

use pgflow_runtime::{flow, flows::task_input, Flow, FlowStep, StepContext, StepError};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sqlx::postgres::PgPoolOptions;
use uuid::Uuid;

/// The run input.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ticket {
    /// Ticket id.
    pub id: i64,
    /// Ticket text.
    pub text: String,
}

/// The classify step's output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Label {
    /// Where the ticket goes.
    pub route: String,
}

#[flow(slug = "dispatchFlow", input = Ticket)]
mod dispatch_flow {
    use super::*;

    #[step]
    async fn classify(ticket: Ticket) -> Result<Label, StepError> {
        Ok(Label {
            route: if ticket.text.contains('?') {
                "help".into()
            } else {
                "chat".into()
            },
        })
    }

    #[step(depends_on = [classify], if = { classify: { route: "help" } })]
    async fn zero(classify: Label) -> Result<i64, StepError> {
        let _ = classify;
        Ok(0)
    }

    #[step(depends_on = [zero])]
    async fn falsy(zero: Option<i64>) -> Result<bool, StepError> {
        Ok(zero.is_some_and(|z| z != 0))
    }

    #[step(depends_on = [falsy, zero])]
    async fn empty(
        falsy: bool,
        zero: Option<i64>,
        ctx: &StepContext<DispatchFlow>,
    ) -> Result<String, StepError> {
        let _ = (falsy, ctx.attempt());
        Ok(match zero {
            Some(_) => String::new(),
            None => "zero was skipped".into(),
        })
    }

    #[step(depends_on = [empty])]
    async fn unit(empty: String, ctx: StepContext<DispatchFlow>) -> Result<(), StepError> {
        let input = ctx.flow_input().await?;
        if empty == "fail" {
            return Err(StepError::terminal("asked to fail"));
        }
        let _ = input;
        Ok(())
    }

    #[step]
    async fn classify_all(ticket: Ticket) -> Result<Vec<Label>, StepError> {
        let _ = ticket;
        Ok(vec![])
    }

    #[step(map = classify_all)]
    async fn never(label: Label) -> Result<u8, StepError> {
        let _ = label;
        Ok(0)
    }
}

fn ctx(step: dispatch_flow::Step, input: Option<Ticket>) -> StepContext<DispatchFlow> {
    let pool = PgPoolOptions::new()
        .connect_lazy("postgres://invalid")
        .expect("a lazy pool never connects");
    let ctx = StepContext::new(Uuid::nil(), step, pool).with_msg_id(1);
    match input {
        Some(input) => ctx.with_flow_input(input),
        None => ctx,
    }
}

async fn run(step: dispatch_flow::Step, input: Value) -> Result<Value, StepError> {
    let ticket = Ticket {
        id: 1,
        text: "hi".into(),
    };
    DispatchFlow::dispatch(step, input, ctx(step, Some(ticket))).await
}

use dispatch_flow::Step;

#[tokio::test]
async fn root_step_gets_the_typed_flow_input() {
    let out = run(Step::Classify, json!({"id": 7, "text": "why?"}))
        .await
        .unwrap();
    assert_eq!(out, json!({"route": "help"}));
}

#[tokio::test]
async fn task_input_gives_root_single_steps_the_flow_input() {
    let flow_input = json!({"id": 7, "text": "hello"});
    assert_eq!(
        task_input(Step::Classify, json!({}), Some(flow_input.clone())),
        flow_input
    );
    assert_eq!(
        task_input(Step::Zero, json!({"classify": 1}), None),
        json!({"classify": 1})
    );
    assert_eq!(
        task_input(Step::Never, json!(3), Some(flow_input)),
        json!(3)
    );
    assert!(!Step::Never.takes_flow_input());
}

#[tokio::test]
async fn outputs_zero_false_and_empty_string_are_kept_exactly() {
    assert_eq!(
        run(Step::Zero, json!({"classify": {"route": "help"}}))
            .await
            .unwrap(),
        json!(0)
    );
    assert_eq!(
        run(Step::Falsy, json!({"zero": 0})).await.unwrap(),
        json!(false)
    );
    assert_eq!(
        run(Step::Empty, json!({"falsy": false, "zero": 0}))
            .await
            .unwrap(),
        json!("")
    );
    assert_eq!(
        run(Step::Unit, json!({"empty": ""})).await.unwrap(),
        Value::Null
    );
}

#[tokio::test]
async fn an_absent_skipped_dependency_is_none() {
    assert_eq!(run(Step::Falsy, json!({})).await.unwrap(), json!(false));
    assert_eq!(
        run(Step::Empty, json!({"falsy": true})).await.unwrap(),
        json!("zero was skipped")
    );
}

#[tokio::test]
async fn malformed_input_is_a_terminal_error_naming_flow_step_and_type() {
    let err = run(Step::Classify, json!({"id": "not a number"}))
        .await
        .unwrap_err();
    assert!(err.is_terminal());
    let msg = err.to_string();
    assert!(msg.contains("dispatchFlow"), "{msg}");
    assert!(msg.contains("classify"), "{msg}");
    assert!(msg.contains("dispatch::Ticket"), "{msg}");

    let err = run(Step::Zero, json!({"classify": {"route": 5}}))
        .await
        .unwrap_err();
    assert!(err.is_terminal());
    assert!(err.to_string().contains("dispatch::Label"), "{err}");
}

#[tokio::test]
async fn a_missing_required_dependency_is_a_terminal_error() {
    let err = run(Step::Zero, json!({})).await.unwrap_err();
    assert!(err.is_terminal());
    assert!(err.to_string().contains("`classify` is missing"), "{err}");
    let err = run(Step::Empty, json!([1])).await.unwrap_err();
    assert!(err.to_string().contains("expected an object"), "{err}");
}

#[tokio::test]
async fn handler_errors_pass_through_with_their_kind() {
    let err = run(Step::Unit, json!({"empty": "fail"})).await.unwrap_err();
    assert!(err.is_terminal());
    assert_eq!(err.to_string(), "asked to fail");
}

#[tokio::test]
async fn map_steps_get_the_raw_element() {
    assert_eq!(
        run(Step::Never, json!({"route": "x"})).await.unwrap(),
        json!(0)
    );
}

#[tokio::test]
async fn the_prefilled_flow_input_is_cached_in_the_context() {
    let c = ctx(
        Step::Unit,
        Some(Ticket {
            id: 3,
            text: "t".into(),
        }),
    );
    let a = c.flow_input().await.unwrap();
    let b = c.clone().flow_input().await.unwrap();
    assert!(Arc::ptr_eq(&a, &b));
    assert_eq!(a.id, 3);
}

#[test]
fn the_step_enum_parses_displays_and_serializes_by_slug() {
    assert_eq!("classify_all".parse::<Step>().unwrap(), Step::ClassifyAll);
    let err = "nope".parse::<Step>().unwrap_err();
    assert_eq!(
        err.to_string(),
        "flow \"dispatchFlow\" has no step \"nope\""
    );
    assert_eq!(serde_json::to_value(Step::Zero).unwrap(), json!("zero"));
    assert_eq!(
        serde_json::from_value::<Step>(json!("unit")).unwrap(),
        Step::Unit
    );
    assert_eq!(Step::Empty.dependencies(), &[Step::Falsy, Step::Zero]);
    assert_eq!(<Step as FlowStep>::ALL.len(), 7);
}

#[test]
fn step_errors_convert_and_carry_retry_delays() {
    fn io() -> Result<(), StepError> {
        Err(std::io::Error::other("disk"))?;
        Ok(())
    }
    let e = io().unwrap_err();
    assert!(!e.is_terminal());
    let e = StepError::from("boom").retry_after(std::time::Duration::from_secs(2));
    assert_eq!(e.retry_delay(), Some(std::time::Duration::from_secs(2)));
    assert!(StepError::from(String::from("x"))
        .into_terminal()
        .is_terminal());
}
