//! Run control with real workers: cancelling a run whose handler sleeps, retrying a failed run in place (and a
//! partly failed map), replaying from a middle step, keyed starts, and the client's refusals.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use pgflow_runtime::client::{CancelFilter, Start, WaitError};
use pgflow_runtime::{flow, Client, StepContext, StepError};
use pgflow_sql::SqlState;
use pgflow_tests::wait_until;

use crate::support::{self, LIMIT};

static SLEEPER_STARTED: AtomicBool = AtomicBool::new(false);
static SLEEPER_CANCELLED_AT: Mutex<Option<Instant>> = Mutex::new(None);

#[flow(slug = "sleeperFlow", input = i64, timeout = 120)]
mod sleeper {
    use super::*;

    /// Sleeps 30 s unless cancelled; returns a (late) result either way.
    #[step]
    async fn nap(n: i64, ctx: &StepContext<Sleeper>) -> Result<i64, StepError> {
        SLEEPER_STARTED.store(true, Ordering::SeqCst);
        tokio::select! {
            () = ctx.cancellation().cancelled() => {
                *SLEEPER_CANCELLED_AT.lock().unwrap() = Some(Instant::now());
            }
            () = tokio::time::sleep(Duration::from_secs(30)) => {}
        }
        Ok(n)
    }
}

fn code(e: &pgflow_runtime::client::ClientError) -> SqlState {
    match e {
        pgflow_runtime::client::ClientError::Database(db) => SqlState::from_code(
            &db.as_database_error()
                .and_then(|d| d.code())
                .map(|c| c.into_owned())
                .unwrap_or_default(),
        ),
        other => panic!("not a database error: {other}"),
    }
}

#[tokio::test]
async fn cancelling_a_run_fires_the_running_handlers_cancellation_and_drops_its_result() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn::<sleeper::Sleeper>(pool).await;
    let client = Client::new(pool.clone());
    let run = client.start::<sleeper::Sleeper>(&5).await.unwrap();
    wait_until(LIMIT, "the handler to start", || async {
        SLEEPER_STARTED.load(Ordering::SeqCst)
    })
    .await;

    let asked = Instant::now();
    let outcome = run.cancel(Some("customer left")).await.unwrap();
    assert!(outcome.changed);
    wait_until(LIMIT, "the handler's cancellation to fire", || async {
        SLEEPER_CANCELLED_AT.lock().unwrap().is_some()
    })
    .await;
    let took = SLEEPER_CANCELLED_AT.lock().unwrap().unwrap() - asked;
    // Measured, not asserted: reported by the test output (about half a second: the worker checks twice a second).
    println!("cancel_run to ctx.cancellation(): {took:?}");

    let err = run
        .wait(LIMIT)
        .await
        .expect_err("a cancelled run has no output");
    let WaitError::Cancelled { reason, .. } = &err else {
        panic!("expected a cancelled run, got {err:?}");
    };
    assert_eq!(reason.as_deref(), Some("customer left"));
    let report = worker.stop().await;
    assert_eq!(report.completed, 0, "the late result was dropped");
    let (status, _, _) = support::task(pool, run.run_id(), "nap", 0).await;
    assert_eq!(status, "cancelled");
    let left: i64 = sqlx::query_scalar("select count(*) from pgmq.q_sleeperflow")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(left, 0, "no message of the run is left");
}

static FOUR_CALLS: [AtomicUsize; 4] = [
    AtomicUsize::new(0),
    AtomicUsize::new(0),
    AtomicUsize::new(0),
    AtomicUsize::new(0),
];
static FOUR_BROKEN: AtomicBool = AtomicBool::new(true);

#[flow(slug = "fourFlow", input = i64, max_attempts = 1)]
mod four {
    use super::*;

    #[step]
    async fn one(n: i64) -> Result<i64, StepError> {
        FOUR_CALLS[0].fetch_add(1, Ordering::SeqCst);
        Ok(n + 1)
    }

    #[step(depends_on = [one])]
    async fn two(one: i64) -> Result<i64, StepError> {
        FOUR_CALLS[1].fetch_add(1, Ordering::SeqCst);
        Ok(one + 1)
    }

    #[step(depends_on = [two])]
    async fn three(two: i64) -> Result<i64, StepError> {
        FOUR_CALLS[2].fetch_add(1, Ordering::SeqCst);
        if FOUR_BROKEN.load(Ordering::SeqCst) {
            return Err(StepError::msg("three is broken"));
        }
        Ok(two + 1)
    }

    #[step(depends_on = [three])]
    async fn four(three: i64) -> Result<i64, StepError> {
        FOUR_CALLS[3].fetch_add(1, Ordering::SeqCst);
        Ok(three + 1)
    }
}

fn four_calls() -> [usize; 4] {
    [0, 1, 2, 3].map(|i| FOUR_CALLS[i].load(Ordering::SeqCst))
}

#[tokio::test]
async fn retrying_a_run_that_failed_at_the_third_step_runs_no_earlier_handler_again_then_replay() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn::<four::Four>(pool).await;
    let client = Client::new(pool.clone());
    let run = client.start::<four::Four>(&0).await.unwrap();
    let err = run.wait(LIMIT).await.expect_err("three fails");
    assert!(matches!(err, WaitError::Failed { .. }), "{err:?}");
    assert_eq!(four_calls(), [1, 1, 1, 0]);

    FOUR_BROKEN.store(false, Ordering::SeqCst);
    run.retry().await.unwrap();
    let out = run.wait(LIMIT).await.unwrap();
    assert_eq!(out.four, 4);
    assert_eq!(
        four_calls(),
        [1, 1, 2, 1],
        "steps one and two ran no handler again"
    );

    // Replay from a middle step: a new run runs `three` and `four` only.
    let replay = run.replay("three").await.unwrap();
    assert_ne!(replay.run_id(), run.run_id());
    assert_eq!(replay.wait(LIMIT).await.unwrap().four, 4);
    assert_eq!(four_calls(), [1, 1, 3, 2]);
    let state = replay.state().await.unwrap().unwrap();
    assert_eq!(state.run.replay_of, Some(run.run_id()));
    worker.stop().await;
}

static MAP_CALLS: AtomicUsize = AtomicUsize::new(0);
static MAP_BROKEN: AtomicBool = AtomicBool::new(true);

#[flow(slug = "fiftyFlow", input = Vec<i64>, max_attempts = 1)]
mod fifty {
    use super::*;

    /// Items 7, 23 and 41 fail while broken, once the other 47 are recorded as completed.
    #[step(map)]
    async fn item(n: i64, ctx: &StepContext<Fifty>) -> Result<i64, StepError> {
        MAP_CALLS.fetch_add(1, Ordering::SeqCst);
        if MAP_BROKEN.load(Ordering::SeqCst) && [7, 23, 41].contains(&n) {
            let waited = Instant::now();
            while waited.elapsed() < Duration::from_secs(20) {
                let done: i64 = sqlx::query_scalar(
                    "select count(*) from pgflow.step_tasks where run_id = $1 and status = 'completed'",
                )
                .bind(ctx.run_id())
                .fetch_one(ctx.pool())
                .await
                .map_err(StepError::retryable)?;
                if done >= 47 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            return Err(StepError::msg(format!("item {n} failed")));
        }
        Ok(n * 2)
    }
}

#[tokio::test]
async fn retrying_a_map_of_fifty_with_three_failures_calls_exactly_three_handlers_again() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn::<fifty::Fifty>(pool).await;
    let client = Client::new(pool.clone());
    let run = client
        .start::<fifty::Fifty>(&(0..50).collect())
        .await
        .unwrap();
    let err = run.wait(LIMIT).await.expect_err("three items fail");
    assert!(matches!(err, WaitError::Failed { .. }), "{err:?}");
    assert_eq!(MAP_CALLS.load(Ordering::SeqCst), 50);
    let completed: i64 = sqlx::query_scalar(
        "select count(*) from pgflow.step_tasks where run_id = $1 and status = 'completed'",
    )
    .bind(run.run_id())
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(completed, 47);

    MAP_BROKEN.store(false, Ordering::SeqCst);
    run.retry().await.unwrap();
    let out = run.wait(LIMIT).await.unwrap();
    assert_eq!(
        MAP_CALLS.load(Ordering::SeqCst),
        53,
        "exactly the three failed items ran again"
    );
    assert_eq!(out.item, (0..50).map(|n| n * 2).collect::<Vec<i64>>());
    worker.stop().await;
}

#[flow(slug = "keyedFlow", input = i64)]
mod keyed {
    use super::*;

    #[step]
    async fn echo(n: i64) -> Result<i64, StepError> {
        Ok(n)
    }
}

#[tokio::test]
async fn twenty_concurrent_starts_with_one_key_give_one_run_and_start_many_takes_keys() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    support::compile::<keyed::Keyed>(pool).await;
    let client = Client::new(pool.clone());
    let starts = (0..20).map(|_| {
        let client = client.clone();
        tokio::spawn(async move {
            client
                .start::<keyed::Keyed>(Start::new(&1).idempotency_key("payment-1"))
                .await
                .unwrap()
                .run_id()
        })
    });
    let ids: Vec<_> = futures::future::join_all(starts)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert!(ids.iter().all(|id| *id == ids[0]), "{ids:?}");

    let inputs = [1, 2];
    let many = client
        .start_many::<keyed::Keyed>([
            Start::new(&inputs[0]).idempotency_key("payment-1"),
            Start::new(&inputs[1]).idempotency_key("payment-2"),
        ])
        .await
        .unwrap();
    assert_eq!(many[0].run_id(), ids[0]);
    let runs: i64 = sqlx::query_scalar("select count(*) from pgflow.runs")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(runs, 2);
    let err = client
        .start::<keyed::Keyed>(Start::new(&3).idempotency_key("payment-1"))
        .await
        .unwrap_err();
    assert_eq!(code(&err), SqlState::IdempotencyKeyConflict);
    assert!(err.to_string().contains("payment-1"), "{err}");

    // Bulk cancel by flow.
    assert_eq!(
        client
            .cancel_runs(&CancelFilter::new().flow("keyedFlow").batch_size(1))
            .await
            .unwrap(),
        2
    );
}

#[tokio::test]
async fn bad_run_control_requests_get_clear_errors_and_change_nothing() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    support::compile::<keyed::Keyed>(pool).await;
    let client = Client::new(pool.clone());
    let unknown = uuid::Uuid::new_v4();
    assert_eq!(
        code(&client.cancel(unknown, None).await.unwrap_err()),
        SqlState::RunNotFound
    );
    assert_eq!(
        code(&client.retry(unknown).await.unwrap_err()),
        SqlState::RunNotFound
    );

    // No worker: the run stays started.
    let run = client.start::<keyed::Keyed>(&1).await.unwrap();
    let err = run.retry().await.unwrap_err();
    assert_eq!(code(&err), SqlState::RunNotRetryable);
    assert!(err.to_string().contains("still started"), "{err}");
    let err = run.replay("nope").await.unwrap_err();
    assert_eq!(code(&err), SqlState::UnknownReplayStep);
    assert!(err.to_string().contains("\"nope\""), "{err}");
    let runs: i64 = sqlx::query_scalar("select count(*) from pgflow.runs")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(runs, 1);
    let state = run.state().await.unwrap().unwrap();
    assert_eq!(state.run.status, pgflow_runtime::client::RunStatus::Started);
}
