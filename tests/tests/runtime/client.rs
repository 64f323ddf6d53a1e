//! The client: typed starts (also inside a transaction), run state, waiting.

use std::time::Duration;

use pgflow_runtime::client::{start, start_many};
use pgflow_runtime::{client::RunStatus, client::WaitError, flow, Client, StepError};

use crate::support::{self, LIMIT};
use pgflow_runtime::client::StepStatus;

#[flow(slug = "greetFlow", input = String)]
mod greet {
    use super::*;

    #[step]
    async fn hello(name: String) -> Result<String, StepError> {
        Ok(format!("hello {name}"))
    }
}

async fn compile(pool: &sqlx::PgPool) {
    let token = tokio_util::sync::CancellationToken::new();
    token.cancel();
    support::fast(pgflow_runtime::Worker::<greet::Greet>::builder(
        pool.clone(),
    ))
    .run(token)
    .await
    .unwrap();
}

#[tokio::test]
async fn a_run_started_in_a_rolled_back_transaction_never_exists() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    compile(pool).await;
    let mut tx = pool.begin().await.unwrap();
    let run_id = start::<greet::Greet, _>(&mut *tx, &"Ada".to_owned())
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    let client = Client::new(pool.clone());
    assert!(client.run(run_id).await.unwrap().is_none());

    let mut tx = pool.begin().await.unwrap();
    let run_id = start::<greet::Greet, _>(&mut *tx, &"Ada".to_owned())
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let state = client.run(run_id).await.unwrap().unwrap();
    assert_eq!(state.run.status, RunStatus::Started);
    assert_eq!(state.run.flow_slug, "greetFlow");
    assert_eq!(state.step("hello").unwrap().status, StepStatus::Started);
}

#[tokio::test]
async fn waiting_wakes_on_the_completion_notification() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn::<greet::Greet>(pool).await;
    // A very slow fallback: only the notification can end the wait quickly.
    let client = Client::new(pool.clone()).with_poll_fallback(Duration::from_secs(60));
    let run = client
        .start::<greet::Greet>(&"Bob".to_owned())
        .await
        .unwrap();
    let started = std::time::Instant::now();
    assert_eq!(run.wait(LIMIT).await.unwrap().hello, "hello Bob");
    assert!(started.elapsed() < Duration::from_secs(20));
    worker.stop().await;
}

#[tokio::test]
async fn waiting_times_out_and_reports_unknown_runs() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    compile(pool).await;
    let client = Client::new(pool.clone()).with_poll_fallback(Duration::from_millis(20));
    let run = client
        .start::<greet::Greet>(&"nobody".to_owned())
        .await
        .unwrap();
    let err = run
        .wait(Duration::from_millis(200))
        .await
        .expect_err("the wait fails");
    assert!(matches!(err, WaitError::TimedOut { .. }), "{err}");
    let err = client
        .wait_json(uuid::Uuid::new_v4(), Duration::from_millis(200))
        .await
        .unwrap_err();
    assert!(matches!(err, WaitError::NotFound { .. }), "{err}");
    let err = client
        .start_by_slug("noSuchFlow", &serde_json::json!({}))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("database error"), "{err}");
}

#[tokio::test]
async fn runs_started_together_come_back_in_input_order_and_each_completes() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn::<greet::Greet>(pool).await;
    let client = Client::new(pool.clone());
    let names: Vec<String> = (0..25).map(|i| format!("guest {i}")).collect();
    let runs = client.start_many::<greet::Greet>(&names).await.unwrap();
    assert_eq!(runs.len(), names.len());
    for (run, name) in runs.iter().zip(&names) {
        assert_eq!(run.flow_slug(), "greetFlow");
        assert_eq!(
            run.wait(LIMIT).await.unwrap().hello,
            format!("hello {name}")
        );
    }
    assert!(client
        .start_many::<greet::Greet>(&[])
        .await
        .unwrap()
        .is_empty());

    // Inside a transaction that rolls back, none of them exists.
    let mut tx = pool.begin().await.unwrap();
    let ids = start_many::<greet::Greet, _>(&mut *tx, &names[..3])
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    for id in ids {
        assert!(client.run(id).await.unwrap().is_none());
    }
    worker.stop().await;
}

#[tokio::test]
async fn a_start_carries_its_priority_with_or_without_a_key() {
    use pgflow_runtime::client::Start;
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    compile(pool).await;
    let client = Client::new(pool.clone());
    let names = ["Ada".to_owned(), "Grace".to_owned(), "Edsger".to_owned()];
    let one = client
        .start::<greet::Greet>(Start::new(&names[0]).priority(7))
        .await
        .unwrap();
    let many = client
        .start_many::<greet::Greet>([
            Start::new(&names[1]).priority(-2),
            Start::new(&names[2]).idempotency_key("edsger").priority(3),
        ])
        .await
        .unwrap();
    let plain = client.start::<greet::Greet>(&names[0]).await.unwrap();
    let mut priorities = Vec::new();
    for run in [
        one.run_id(),
        many[0].run_id(),
        many[1].run_id(),
        plain.run_id(),
    ] {
        let p: i32 = sqlx::query_scalar("select priority from pgflow.runs where run_id = $1")
            .bind(run)
            .fetch_one(pool)
            .await
            .unwrap();
        priorities.push(p);
    }
    assert_eq!(priorities, [7, -2, 3, 0]);
}
