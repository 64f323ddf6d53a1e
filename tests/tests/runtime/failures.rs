//! Failure handling: retries, exhaustion, terminal errors, panics, timeouts, malformed input, falsy outputs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pgflow_runtime::{client::WaitError, flow, Client, StepContext, StepError};
use serde_json::json;

use crate::support::{self, LIMIT};

#[flow(slug = "flakyFlow", input = i64, max_attempts = 3, base_delay = 5)]
mod flaky {
    use super::*;

    /// Fails on its first two attempts, asking for an immediate retry.
    #[step]
    async fn flaky(n: i64, ctx: &StepContext<Flaky>) -> Result<i64, StepError> {
        if ctx.attempt() < 3 {
            return Err(StepError::msg(format!("attempt {} failed", ctx.attempt()))
                .retry_after(Duration::ZERO));
        }
        Ok(n + ctx.attempt() as i64)
    }
}

#[tokio::test]
async fn retries_that_end_in_success_complete_the_run_using_the_handlers_retry_delay() {
    let db = pgflow_tests::test_db().await;
    let worker = support::spawn::<flaky::Flaky>(db.pool()).await;
    let client = Client::new(db.pool().clone());
    let run = client.start::<flaky::Flaky>(&10).await.unwrap();
    // base_delay 5 would wait 10 s and then 20 s; the handler's zero delay makes it immediate.
    let out = run.wait(Duration::from_secs(8)).await.unwrap();
    assert_eq!(out.flaky, 13);
    let (status, attempts, error) = support::task(db.pool(), run.run_id(), "flaky", 0).await;
    assert_eq!((status.as_str(), attempts), ("completed", 3));
    assert_eq!(error.as_deref(), Some("attempt 2 failed"));
    let report = worker.stop().await;
    assert_eq!((report.completed, report.failed), (1, 2));
}

#[flow(slug = "doomedFlow", input = String, max_attempts = 2, base_delay = 0)]
mod doomed {
    use super::*;

    #[step]
    async fn always_fails(s: String) -> Result<String, StepError> {
        Err(StepError::retryable(std::io::Error::other(format!(
            "cannot reach {s}"
        ))))
    }
}

#[tokio::test]
async fn exhausted_retries_fail_the_run_and_waiting_names_the_step_and_message() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn::<doomed::Doomed>(pool).await;
    let client = Client::new(pool.clone());
    let run = client
        .start::<doomed::Doomed>(&"x".to_owned())
        .await
        .unwrap();
    let err = run.wait(LIMIT).await.expect_err("the wait fails");
    let WaitError::Failed {
        failed_step,
        error_message,
        ..
    } = &err
    else {
        panic!("expected a failed run, got {err:?}");
    };
    assert_eq!(failed_step.as_deref(), Some("always_fails"));
    assert_eq!(error_message.as_deref(), Some("cannot reach x"));
    let (status, attempts, _) = support::task(pool, run.run_id(), "always_fails", 0).await;
    assert_eq!((status.as_str(), attempts), ("failed", 2));
    assert!(
        err.to_string()
            .contains("in step `always_fails`: cannot reach x"),
        "{err}"
    );
    assert_eq!(support::active_tasks(pool, run.run_id()).await, 0);
    worker.stop().await;
}

#[flow(slug = "terminalFlow", input = String, max_attempts = 5, base_delay = 0)]
mod terminal {
    use super::*;

    #[step]
    async fn rejects(s: String) -> Result<String, StepError> {
        Err(StepError::terminal(format!("invalid request {s}")))
    }
}

#[tokio::test]
async fn a_terminal_error_skips_the_remaining_attempts() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn::<terminal::Terminal>(pool).await;
    let client = Client::new(pool.clone());
    let run = client
        .start::<terminal::Terminal>(&"r".to_owned())
        .await
        .unwrap();
    let err = run.wait(LIMIT).await.expect_err("the wait fails");
    assert!(
        matches!(err, WaitError::Failed { ref failed_step, .. } if failed_step.as_deref() == Some("rejects"))
    );
    let (status, attempts, error) = support::task(pool, run.run_id(), "rejects", 0).await;
    assert_eq!((status.as_str(), attempts), ("failed", 1));
    assert_eq!(error.as_deref(), Some("invalid request r"));
    worker.stop().await;
}

#[flow(slug = "panicFlow", input = i64, max_attempts = 2, base_delay = 0)]
mod panicky {
    use super::*;

    #[step]
    async fn explode(n: i64) -> Result<i64, StepError> {
        if n > 0 {
            panic!("boom {n}");
        }
        Ok(n)
    }
}

#[tokio::test]
async fn a_panicking_handler_is_recorded_as_a_failure_and_the_worker_keeps_going() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn::<panicky::Panicky>(pool).await;
    let client = Client::new(pool.clone());
    let bad = client.start::<panicky::Panicky>(&7).await.unwrap();
    let err = bad.wait(LIMIT).await.expect_err("the wait fails");
    let WaitError::Failed { error_message, .. } = err else {
        panic!("expected failure")
    };
    assert_eq!(
        error_message.as_deref(),
        Some("step `explode` handler panicked: boom 7")
    );
    assert_eq!(support::task(pool, bad.run_id(), "explode", 0).await.1, 2);
    let good = client.start::<panicky::Panicky>(&0).await.unwrap();
    assert_eq!(good.wait(LIMIT).await.unwrap().explode, 0);
    worker.stop().await;
}

static OBSERVED_CANCEL: AtomicBool = AtomicBool::new(false);

#[flow(slug = "slowFlow", input = i64, max_attempts = 2, base_delay = 0, timeout = 1)]
mod slow {
    use super::*;

    /// Never finishes on its own; records that it saw its token fire.
    #[step]
    async fn hang(n: i64, ctx: &StepContext<Slow>) -> Result<i64, StepError> {
        let token = ctx.cancellation().clone();
        let guard = scopeguard(move || {
            if token.is_cancelled() {
                OBSERVED_CANCEL.store(true, Ordering::SeqCst);
            }
        });
        std::future::pending::<()>().await;
        drop(guard);
        Ok(n)
    }

    struct Guard<F: FnMut()>(F);
    impl<F: FnMut()> Drop for Guard<F> {
        fn drop(&mut self) {
            (self.0)();
        }
    }
    fn scopeguard<F: FnMut()>(f: F) -> Guard<F> {
        Guard(f)
    }
}

#[tokio::test]
async fn the_effective_timeout_cancels_the_handler_and_fails_the_task_with_retries() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn::<slow::Slow>(pool).await;
    let client = Client::new(pool.clone());
    let run = client.start::<slow::Slow>(&1).await.unwrap();
    let err = run.wait(LIMIT).await.expect_err("the wait fails");
    let WaitError::Failed { error_message, .. } = err else {
        panic!("expected failure")
    };
    assert_eq!(
        error_message.as_deref(),
        Some("step `hang` timed out after 1s (its effective timeout)")
    );
    assert_eq!(support::task(pool, run.run_id(), "hang", 0).await.1, 2);
    assert!(
        OBSERVED_CANCEL.load(Ordering::SeqCst),
        "the handler's token fired before it was dropped"
    );
    worker.stop().await;
}

#[flow(slug = "typedFlow", input = i64, max_attempts = 3)]
mod typed {
    use super::*;

    #[step]
    async fn zero(n: i64) -> Result<i64, StepError> {
        Ok(n.min(0))
    }

    #[step]
    async fn no(n: i64) -> Result<bool, StepError> {
        Ok(n < 0)
    }

    #[step]
    async fn empty(n: i64) -> Result<String, StepError> {
        let _ = n;
        Ok(String::new())
    }

    #[step(depends_on = [zero, no, empty])]
    async fn echo(zero: i64, no: bool, empty: String) -> Result<(i64, bool, String), StepError> {
        Ok((zero, no, empty))
    }
}

#[tokio::test]
async fn outputs_zero_false_and_empty_string_arrive_intact() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn::<typed::Typed>(pool).await;
    let client = Client::new(pool.clone());
    let run = client.start::<typed::Typed>(&5).await.unwrap();
    let out = run.wait(LIMIT).await.unwrap();
    assert_eq!(out.echo, (0, false, String::new()));
    let state = run.state().await.unwrap().unwrap();
    assert_eq!(state.step("zero").unwrap().output, Some(json!(0)));
    assert_eq!(state.step("no").unwrap().output, Some(json!(false)));
    assert_eq!(state.step("empty").unwrap().output, Some(json!("")));
    worker.stop().await;
}

#[tokio::test]
async fn malformed_input_is_a_terminal_failure_naming_the_step_and_the_type() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn::<typed::Typed>(pool).await;
    let client = Client::new(pool.clone());
    pgflow_tests::wait_until(LIMIT, "the flow to be compiled", || async {
        sqlx::query_scalar::<_, bool>(
            "select exists (select 1 from pgflow.flows where flow_slug = 'typedFlow')",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    })
    .await;
    let run_id = client
        .start_by_slug("typedFlow", &json!({"not": "a number"}))
        .await
        .unwrap();
    let err = client.wait_json(run_id, LIMIT).await.unwrap_err();
    let WaitError::Failed { error_message, .. } = err else {
        panic!("expected failure")
    };
    let message = error_message.unwrap();
    assert!(message.contains("step `"), "{message}");
    assert!(message.contains("`i64`"), "{message}");
    // Terminal: one attempt although max_attempts is 3.
    let attempts: i32 = sqlx::query_scalar(
        "select max(attempts_count) from pgflow.step_tasks where run_id = $1 and status = 'failed'",
    )
    .bind(run_id)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(attempts, 1);
    worker.stop().await;
}
