//! Flows end to end: linear, diamond, map, conditions and skip modes.
#![allow(unreachable_pub)] // flow input types appear in the generated (public) flow items

use std::time::Duration;

use pgflow_runtime::{flow, Client, StepError};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::support::{self, LIMIT};
use pgflow_runtime::client::StepStatus;

#[flow(slug = "linearFlow", input = i64)]
mod linear {
    use super::*;

    #[step]
    async fn add_one(n: i64) -> Result<i64, StepError> {
        Ok(n + 1)
    }

    #[step(depends_on = [add_one])]
    async fn double(add_one: i64) -> Result<i64, StepError> {
        Ok(add_one * 2)
    }

    #[step(depends_on = [double])]
    async fn describe(double: i64) -> Result<String, StepError> {
        Ok(format!("result {double}"))
    }
}

#[tokio::test]
async fn linear_flow_runs_to_completion_with_a_typed_output() {
    let db = pgflow_tests::test_db().await;
    let worker = support::spawn::<linear::Linear>(db.pool()).await;
    let client = Client::new(db.pool().clone());
    let run = client.start::<linear::Linear>(&20).await.unwrap();
    let out = run.wait(LIMIT).await.unwrap();
    assert_eq!(out.describe, "result 42");
    let report = worker.stop().await;
    assert_eq!(report.completed, 3);
    assert_eq!(
        report.compile_status,
        pgflow_runtime::worker::CompileStatus::Compiled
    );
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Order {
    pub qty: i64,
    pub price: i64,
}

#[flow(slug = "diamondFlow", input = Order)]
mod diamond {
    use super::*;

    #[step]
    async fn root(order: Order) -> Result<Order, StepError> {
        Ok(order)
    }

    #[step(depends_on = [root])]
    async fn total(root: Order) -> Result<i64, StepError> {
        Ok(root.qty * root.price)
    }

    #[step(depends_on = [root])]
    async fn tax(root: Order) -> Result<i64, StepError> {
        Ok(root.qty * root.price / 10)
    }

    #[step(depends_on = [total, tax])]
    async fn invoice(total: i64, tax: i64) -> Result<i64, StepError> {
        Ok(total + tax)
    }
}

#[tokio::test]
async fn diamond_flow_joins_both_branches_for_many_runs() {
    let db = pgflow_tests::test_db().await;
    let worker = support::spawn_with(
        support::fast(pgflow_runtime::Worker::<diamond::Diamond>::builder(
            db.pool().clone(),
        ))
        .max_concurrent(8),
    )
    .await;
    let client = Client::new(db.pool().clone());
    let mut runs = Vec::new();
    for i in 1..=20 {
        runs.push((
            i,
            client
                .start::<diamond::Diamond>(&Order { qty: i, price: 10 })
                .await
                .unwrap(),
        ));
    }
    for (i, run) in runs {
        let out = run.wait(LIMIT).await.unwrap();
        assert_eq!(out.invoice, i * 10 + i);
    }
    let report = worker.stop().await;
    assert_eq!(report.completed, 80);
    assert_eq!(report.released, 0);
}

#[flow(slug = "mapFlow", input = Vec<i64>)]
mod mapped {
    use super::*;

    #[step(map)]
    async fn square(n: i64) -> Result<i64, StepError> {
        // Finish out of order: later elements first.
        tokio::time::sleep(Duration::from_millis(
            u64::try_from(10 - n.min(10)).unwrap_or(0) * 5,
        ))
        .await;
        Ok(n * n)
    }

    #[step(map = square)]
    async fn label(n: i64) -> Result<String, StepError> {
        Ok(format!("#{n}"))
    }

    #[step(depends_on = [square])]
    async fn sum(square: Vec<i64>) -> Result<i64, StepError> {
        Ok(square.iter().sum())
    }
}

#[tokio::test]
async fn map_steps_process_every_element_and_keep_the_order() {
    let db = pgflow_tests::test_db().await;
    let worker = support::spawn::<mapped::Mapped>(db.pool()).await;
    let client = Client::new(db.pool().clone());
    let run = client
        .start::<mapped::Mapped>(&vec![1, 2, 3, 4, 5])
        .await
        .unwrap();
    let out = run.wait(LIMIT).await.unwrap();
    assert_eq!(out.sum, 55);
    assert_eq!(out.label, ["#1", "#4", "#9", "#16", "#25"]);

    let empty = client.start::<mapped::Mapped>(&vec![]).await.unwrap();
    let out = empty.wait(LIMIT).await.unwrap();
    assert_eq!(out.sum, 0);
    assert!(out.label.is_empty());
    worker.stop().await;
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Label {
    pub route: String,
}

#[flow(slug = "conditionsFlow", input = Thread)]
mod conditions {
    use super::*;

    #[step]
    async fn classify(thread: Thread) -> Result<Label, StepError> {
        let route = if thread.text.contains('?') {
            "help"
        } else {
            "chat"
        };
        Ok(Label {
            route: route.into(),
        })
    }

    /// Skipped alone when unmet.
    #[step(depends_on = [classify], if = { classify: { route: "help" } })]
    async fn answer(classify: Label) -> Result<String, StepError> {
        Ok(format!("answering {}", classify.route))
    }

    /// Skipped with its dependents when unmet.
    #[step(depends_on = [classify], if = { classify: { route: "help" } }, when_unmet = skip_cascade)]
    async fn escalate(classify: Label) -> Result<bool, StepError> {
        let _ = classify;
        Ok(true)
    }

    #[step(depends_on = [escalate])]
    async fn page(escalate: bool) -> Result<bool, StepError> {
        Ok(escalate)
    }

    #[step(depends_on = [answer, classify])]
    async fn summary(answer: Option<String>, classify: Label) -> Result<String, StepError> {
        Ok(format!(
            "{}: {}",
            classify.route,
            answer.unwrap_or_else(|| "none".into())
        ))
    }
}

#[tokio::test]
async fn conditions_run_met_steps_and_skip_unmet_ones_with_their_modes() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn::<conditions::Conditions>(pool).await;
    let client = Client::new(pool.clone());

    let help = client
        .start::<conditions::Conditions>(&Thread {
            text: "how?".into(),
        })
        .await
        .unwrap();
    let out = help.wait(LIMIT).await.unwrap();
    assert_eq!(out.summary, "help: answering help");
    assert_eq!(out.page, Some(true));

    let chat = client
        .start::<conditions::Conditions>(&Thread { text: "hi".into() })
        .await
        .unwrap();
    let out = chat.wait(LIMIT).await.unwrap();
    assert_eq!(out.summary, "chat: none");
    assert_eq!(out.page, None);
    let run = chat.run_id();
    assert_eq!(support::step_status(pool, run, "answer").await, "skipped");
    assert_eq!(support::step_status(pool, run, "escalate").await, "skipped");
    assert_eq!(support::step_status(pool, run, "page").await, "skipped");
    assert_eq!(
        support::step_status(pool, run, "summary").await,
        "completed"
    );
    assert_eq!(support::active_tasks(pool, run).await, 0);
    let state = chat.state().await.unwrap().unwrap();
    assert_eq!(state.step("page").unwrap().status, StepStatus::Skipped);
    assert_eq!(state.run.output.unwrap()["summary"], json!("chat: none"));
    worker.stop().await;
}
