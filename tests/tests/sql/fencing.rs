//! Results are fenced to their attempt: a completion or failure from an attempt that is no longer current
//! changes nothing and comes back 'stale'; the upstream four-argument forms keep their behaviour.

use crate::step_support::*;
use crate::support::*;
use pgflow_sql::SqlState;
use pgflow_tests::test_db;
use serde_json::{json, Value};
use sqlx::PgPool;
use uuid::Uuid;

/// A plain flow "fence" with one step "work" (max_attempts 2) and a registered worker.
async fn setup(pool: &PgPool) -> Uuid {
    let mut shape = roots(&["work"]);
    shape["options"]["maxAttempts"] = json!(2);
    compile(pool, "fence", &shape, "flow").await;
    let worker = Uuid::new_v4();
    register(pool, worker, "fence-worker", "fence", "fence", None).await;
    worker
}

/// Reads and claims everything visible in the queue for `worker`; returns the claimed tasks.
async fn claim_all(pool: &PgPool, worker: Uuid) -> Vec<Value> {
    let msgs = read(pool, "fence", 10).await;
    let result = claim_tasks(pool, "fence", "fence", None, &msgs, worker).await;
    assert_eq!(result["outcome"], "claimed", "{result}");
    result["tasks"].as_array().unwrap().clone()
}

/// Makes the started task look stalled and lets recovery requeue it.
async fn stall_and_requeue(pool: &PgPool, run: Uuid) {
    exec(
        pool,
        &format!(
            "update pgflow.step_tasks set queued_at = now() - interval '2 hours', started_at = now() - interval '1 hour'
             where run_id = '{run}'"
        ),
    )
    .await;
    let requeued: i32 = sqlx::query_scalar("select pgflow.requeue_stalled_tasks()")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(requeued, 1);
}

async fn fenced_fail(pool: &PgPool, run: Uuid, attempt: i32, worker: Uuid) -> Value {
    let row: (String, String, i32) = sqlx::query_as(
        "select outcome, status, attempts_count from pgflow.fail_task(run_id => $1, step_slug => 'work',
           task_index => 0, error_message => 'late failure', attempt => $2, worker_id => $3)",
    )
    .bind(run)
    .bind(attempt)
    .bind(worker)
    .fetch_one(pool)
    .await
    .unwrap();
    json!({"outcome": row.0, "status": row.1, "attempt": row.2})
}

async fn fenced_complete(pool: &PgPool, run: Uuid, attempt: i32, worker: Uuid) -> Value {
    let row: (String, String, i32) = sqlx::query_as(
        "select outcome, status, attempts_count from pgflow.complete_task(run_id => $1, step_slug => 'work',
           task_index => 0, output => '\"done\"'::jsonb, attempt => $2, worker_id => $3)",
    )
    .bind(run)
    .bind(attempt)
    .bind(worker)
    .fetch_one(pool)
    .await
    .unwrap();
    json!({"outcome": row.0, "status": row.1, "attempt": row.2})
}

#[tokio::test]
async fn a_late_failure_from_attempt_one_changes_nothing_while_attempt_two_runs() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let run = start(pool, "fence", json!({})).await;
    let first = claim_all(pool, worker).await;
    assert_eq!(first[0]["attempts_count"], 1);
    stall_and_requeue(pool, run).await;
    let second = claim_all(pool, worker).await;
    assert_eq!(second[0]["attempts_count"], 2);

    // Attempt 1's failure arrives late (it overran its timeout, or its first reply was lost).
    let late = fenced_fail(pool, run, 1, worker).await;
    assert_eq!(
        late,
        json!({"outcome": "stale", "status": "started", "attempt": 2})
    );
    assert_eq!(
        task_state(pool, run, "work", 0).await,
        ("started".into(), 2)
    );
    assert_eq!(run_status(pool, run).await, "started");
    assert_eq!(step_status(pool, run, "work").await, "started");

    // Attempt 2's own result is applied.
    let own = fenced_complete(pool, run, 2, worker).await;
    assert_eq!(own["outcome"], "applied");
    assert_eq!(run_status(pool, run).await, "completed");
}

#[tokio::test]
async fn a_late_completion_from_an_earlier_attempt_is_stale_and_the_current_one_still_records() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let run = start(pool, "fence", json!({})).await;
    claim_all(pool, worker).await;
    stall_and_requeue(pool, run).await;
    claim_all(pool, worker).await;

    let late = fenced_complete(pool, run, 1, worker).await;
    assert_eq!(late["outcome"], "stale");
    assert_eq!(run_status(pool, run).await, "started");
    assert!(run_output(pool, run).await.is_none());

    let own = fenced_fail(pool, run, 2, worker).await;
    assert_eq!(
        own,
        json!({"outcome": "applied", "status": "failed", "attempt": 2})
    );
    assert_eq!(run_status(pool, run).await, "failed");
}

#[tokio::test]
async fn a_retried_failure_whose_first_reply_was_lost_is_recorded_once() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let run = start(pool, "fence", json!({})).await;
    claim_all(pool, worker).await;

    let first = fenced_fail(pool, run, 1, worker).await;
    assert_eq!(
        first,
        json!({"outcome": "applied", "status": "queued", "attempt": 1})
    );
    // The same call again (the worker never saw the first reply): the task is queued, not started.
    let again = fenced_fail(pool, run, 1, worker).await;
    assert_eq!(
        again,
        json!({"outcome": "stale", "status": "queued", "attempt": 1})
    );
    assert_eq!(run_status(pool, run).await, "started");
}

#[tokio::test]
async fn the_same_attempt_number_of_another_worker_is_stale() {
    let db = test_db().await;
    let pool = db.pool();
    let first_worker = setup(pool).await;
    let run = start(pool, "fence", json!({})).await;
    claim_all(pool, first_worker).await;
    // A stopping worker hands the task back: its attempt is given back, so the next claim reuses the number.
    let released: i32 = sqlx::query_scalar("select pgflow.release_worker_tasks($1)")
        .bind(first_worker)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(released, 1);
    let second_worker = Uuid::new_v4();
    register(pool, second_worker, "fence-worker", "fence", "fence", None).await;
    let tasks = claim_all(pool, second_worker).await;
    assert_eq!(tasks[0]["attempts_count"], 1);

    let late = fenced_complete(pool, run, 1, first_worker).await;
    assert_eq!(late["outcome"], "stale");
    assert_eq!(run_status(pool, run).await, "started");
    let own = fenced_complete(pool, run, 1, second_worker).await;
    assert_eq!(own["outcome"], "applied");
}

#[tokio::test]
async fn a_batch_of_completions_applies_current_results_and_reports_stale_ones() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let runs = [
        start(pool, "fence", json!({})).await,
        start(pool, "fence", json!({})).await,
    ];
    claim_all(pool, worker).await;
    let outcomes: Vec<(Uuid, String, String, i32)> = sqlx::query_as(
        "select run_id, outcome, status, attempts_count from pgflow.complete_tasks(
           run_ids => $1, step_slugs => array['work', 'work'], task_indexes => array[0, 0],
           outputs => array['1', '2']::jsonb[], attempts => array[1, 7], worker_id => $2)",
    )
    .bind(&runs[..])
    .bind(worker)
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        outcomes,
        vec![
            (runs[0], "applied".into(), "completed".into(), 1),
            (runs[1], "stale".into(), "started".into(), 1),
        ]
    );
    assert_eq!(run_status(pool, runs[0]).await, "completed");
    assert_eq!(run_status(pool, runs[1]).await, "started");
}

#[tokio::test]
async fn the_upstream_four_argument_forms_stay_unfenced() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let run = start(pool, "fence", json!({})).await;
    claim_all(pool, worker).await;
    stall_and_requeue(pool, run).await;
    claim_all(pool, worker).await;
    // Upstream's fail_task has no attempt to compare: it records the failure on the current attempt.
    assert_eq!(fail(pool, run, "work", 0, "boom").await, "failed");
    assert_eq!(run_status(pool, run).await, "failed");
}

#[tokio::test]
async fn the_fenced_forms_require_an_attempt() {
    let db = test_db().await;
    let pool = db.pool();
    setup(pool).await;
    let run = start(pool, "fence", json!({})).await;
    let err = sqlx::query(
        "select * from pgflow.complete_task(run_id => $1, step_slug => 'work', task_index => 0,
           output => '1'::jsonb, attempt => null)",
    )
    .bind(run)
    .execute(pool)
    .await
    .unwrap_err();
    let e = db_error(err);
    assert_eq!(e.code, SqlState::InvalidParameterValue);
    assert!(e.message.contains("attempt is required"), "{e:?}");
}
