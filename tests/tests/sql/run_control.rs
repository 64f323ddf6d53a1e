//! Run control in SQL: cancel_run and cancel_runs, retry_run in place, replay_run, idempotent starts, and the
//! two-session interleavings (cancel against completion, cancel against claim, retry against a late result).
//!
//! The interleavings are deterministic: one session holds its transaction open, the other is started, and the
//! test waits until `pg_stat_activity` shows it waiting for a lock before the first commits.

use std::time::Duration;

use crate::step_support::*;
use crate::support::*;
use pgflow_sql::SqlState;
use pgflow_tests::{test_db, wait_until, TestDb};
use serde_json::{json, Value};
use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

async fn wait_for_lock_wait(pool: &PgPool, what: &str) {
    let like = format!("%{what}%");
    wait_until(
        Duration::from_secs(10),
        &format!("{what} waiting on a lock"),
        || {
            let like = like.clone();
            async move {
                sqlx::query_scalar::<_, bool>(
                    "select exists (select 1 from pg_stat_activity
                     where datname = current_database() and wait_event_type = 'Lock' and query like $1
                       and pid <> pg_backend_pid())",
                )
                .bind(like)
                .fetch_one(pool)
                .await
                .unwrap()
            }
        },
    )
    .await;
}

async fn connect(db: &TestDb) -> PgConnection {
    PgConnection::connect_with(&db.options()).await.unwrap()
}

/// A chain a -> b -> c.
fn chain() -> Value {
    shape(vec![step("a", &[]), step("b", &["a"]), step("c", &["b"])])
}

/// A root map step `m` over the run input.
fn root_map() -> Value {
    let mut m = step("m", &[]);
    m["stepType"] = json!("map");
    shape(vec![m])
}

/// The fenced completion; returns its outcome ('applied' or 'stale').
async fn complete_at(pool: &PgPool, run: Uuid, step: &str, index: i32, attempt: i32) -> String {
    sqlx::query_scalar(
        "select outcome from pgflow.complete_task(run_id => $1, step_slug => $2, task_index => $3,
                                                   output => $4, attempt => $5)",
    )
    .bind(run)
    .bind(step)
    .bind(index)
    .bind(json!({"done": step, "index": index}))
    .bind(attempt)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The fenced, terminal failure (no retry left).
async fn fail_final(pool: &PgPool, run: Uuid, step: &str, index: i32, attempt: i32, error: &str) {
    sqlx::query(
        "select pgflow.fail_task(run_id => $1, step_slug => $2, task_index => $3, error_message => $4,
                                 attempt => $5, terminal => true)",
    )
    .bind(run)
    .bind(step)
    .bind(index)
    .bind(error)
    .bind(attempt)
    .execute(pool)
    .await
    .unwrap();
}

async fn cancel(pool: &PgPool, run: Uuid, reason: &str) -> (String, bool, Option<String>) {
    sqlx::query_as("select status, changed, cancel_reason from pgflow.cancel_run($1, $2)")
        .bind(run)
        .bind(reason)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn runs_count(pool: &PgPool) -> i64 {
    sqlx::query_scalar("select count(*) from pgflow.runs")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn cancel_run_cancels_tasks_archives_messages_and_fences_late_results() {
    let db = test_db().await;
    let pool = db.pool();
    compile(pool, "cx", &chain(), "flow").await;
    let run = start(pool, "cx", json!({})).await;
    let claimed = claim(pool, "cx", "cx", 10).await;
    assert_eq!(claimed.len(), 1);

    assert_eq!(
        cancel(pool, run, "operator asked").await,
        ("cancelled".into(), true, Some("operator asked".into()))
    );
    assert_eq!(run_status(pool, run).await, "cancelled");
    assert_eq!(task_statuses(pool, run, "a").await, vec!["cancelled"]);
    assert_eq!(
        live_messages(pool, "cx").await,
        0,
        "no message of the run is left"
    );
    // The running task's late result is stale and changes nothing; later steps never start.
    assert_eq!(complete_at(pool, run, "a", 0, 1).await, "stale");
    assert_eq!(step_status(pool, run, "b").await, "created");
    assert_eq!(run_status(pool, run).await, "cancelled");
    // Idempotent: a second cancel changes nothing and says so.
    assert_eq!(
        cancel(pool, run, "again").await,
        ("cancelled".into(), false, Some("operator asked".into()))
    );
    // The worker check reports the task with the reason.
    let reason: String = sqlx::query_scalar(
        "select reason from pgflow.cancelled_tasks(array[$1]::uuid[], array['a'], array[0], array[1])",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(reason, "operator asked");
}

#[tokio::test]
async fn cancelling_a_finished_or_unknown_run() {
    let db = test_db().await;
    let pool = db.pool();
    compile(pool, "cf", &roots(&["a"]), "flow").await;
    let run = start(pool, "cf", json!({})).await;
    claim(pool, "cf", "cf", 1).await;
    assert_eq!(complete(pool, run, "a", 0, json!(1)).await, "completed");
    assert_eq!(run_status(pool, run).await, "completed");
    assert_eq!(
        cancel(pool, run, "late").await,
        ("completed".into(), false, None)
    );

    let err = db_error(
        sqlx::query("select * from pgflow.cancel_run($1, 'x')")
            .bind(Uuid::new_v4())
            .execute(pool)
            .await
            .unwrap_err(),
    );
    assert_eq!(err.code, SqlState::RunNotFound, "{err:?}");
}

#[tokio::test]
async fn cancel_runs_by_input_path_in_bounded_batches() {
    let db = test_db().await;
    let pool = db.pool();
    compile(pool, "cb", &roots(&["a"]), "flow").await;
    for _ in 0..5 {
        start(pool, "cb", json!({"tenant": {"id": 1}})).await;
    }
    let other = start(pool, "cb", json!({"tenant": {"id": 2}})).await;
    let batch = |n: i32| {
        sqlx::query_scalar::<_, i32>(
            "select pgflow.cancel_runs(flow_slug => 'cb', input_path => '{tenant,id}', input_value => '1',
                                       reason => 'tenant deleted', max_runs => $1)",
        )
        .bind(n)
        .fetch_one(pool)
    };
    assert_eq!(batch(2).await.unwrap(), 2);
    assert_eq!(batch(2).await.unwrap(), 2);
    assert_eq!(batch(2).await.unwrap(), 1);
    assert_eq!(batch(2).await.unwrap(), 0);
    assert_eq!(run_status(pool, other).await, "started");
    assert_eq!(
        live_messages(pool, "cb").await,
        1,
        "only the other tenant's message is left"
    );
    let err = db_error(
        sqlx::query("select pgflow.cancel_runs(status => 'completed')")
            .execute(pool)
            .await
            .unwrap_err(),
    );
    assert_eq!(err.code, SqlState::InvalidParameterValue, "{err:?}");
}

#[tokio::test]
async fn cancel_against_completion_the_completion_waits_and_is_stale() {
    let db = test_db().await;
    let pool = db.pool();
    compile(pool, "cc", &chain(), "flow").await;
    let run = start(pool, "cc", json!({})).await;
    claim(pool, "cc", "cc", 1).await;

    let mut canceller = connect(&db).await;
    sqlx::query("begin").execute(&mut canceller).await.unwrap();
    sqlx::query("select * from pgflow.cancel_run($1, 'first')")
        .bind(run)
        .execute(&mut canceller)
        .await
        .unwrap();
    let completion = {
        let pool = pool.clone();
        tokio::spawn(async move {
            sqlx::query_scalar::<_, String>(
                "select outcome /* completion session */ from pgflow.complete_task(run_id => $1,
                   step_slug => 'a', task_index => 0, output => '1', attempt => 1)",
            )
            .bind(run)
            .fetch_one(&pool)
            .await
            .unwrap()
        })
    };
    wait_for_lock_wait(pool, "completion session").await;
    sqlx::query("commit").execute(&mut canceller).await.unwrap();
    let outcome = tokio::time::timeout(Duration::from_secs(20), completion)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(outcome, "stale");
    assert_eq!(run_status(pool, run).await, "cancelled");
    assert_eq!(step_status(pool, run, "b").await, "created");
    assert_eq!(live_messages(pool, "cc").await, 0);
}

#[tokio::test]
async fn completion_against_cancel_the_cancel_waits_and_cancels_the_next_step() {
    let db = test_db().await;
    let pool = db.pool();
    compile(pool, "cd", &chain(), "flow").await;
    let run = start(pool, "cd", json!({})).await;
    claim(pool, "cd", "cd", 1).await;

    let mut completer = connect(&db).await;
    sqlx::query("begin").execute(&mut completer).await.unwrap();
    sqlx::query(
        "select * from pgflow.complete_task(run_id => $1, step_slug => 'a', task_index => 0, output => '1',
                                            attempt => 1)",
    )
    .bind(run)
    .execute(&mut completer)
    .await
    .unwrap();
    let cancelling = {
        let pool = pool.clone();
        tokio::spawn(async move {
            sqlx::query_as::<_, (String, bool)>(
                "select status, changed /* cancel session */ from pgflow.cancel_run($1, 'second')",
            )
            .bind(run)
            .fetch_one(&pool)
            .await
            .unwrap()
        })
    };
    wait_for_lock_wait(pool, "cancel session").await;
    sqlx::query("commit").execute(&mut completer).await.unwrap();
    let done = tokio::time::timeout(Duration::from_secs(20), cancelling)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(done, ("cancelled".into(), true));
    assert_eq!(task_statuses(pool, run, "a").await, vec!["completed"]);
    assert_eq!(task_statuses(pool, run, "b").await, vec!["cancelled"]);
    assert_eq!(live_messages(pool, "cd").await, 0);
}

#[tokio::test]
async fn cancel_against_claim_the_cancel_waits_for_the_claim_then_cancels_the_claimed_task() {
    let db = test_db().await;
    let pool = db.pool();
    compile(pool, "cl", &roots(&["a"]), "flow").await;
    register_worker(pool).await;
    let run = start(pool, "cl", json!({})).await;
    let ids = read(pool, "cl", 1).await;

    let mut claimer = connect(&db).await;
    sqlx::query("begin").execute(&mut claimer).await.unwrap();
    sqlx::query(
        "select * from pgflow.start_tasks(flow_slug => 'cl', msg_ids => $1, worker_id => $2)",
    )
    .bind(&ids)
    .bind(WORKER)
    .execute(&mut claimer)
    .await
    .unwrap();
    let cancelling = {
        let pool = pool.clone();
        tokio::spawn(async move {
            sqlx::query_as::<_, (String, bool)>(
                "select status, changed /* cancel vs claim */ from pgflow.cancel_run($1, 'during claim')",
            )
            .bind(run)
            .fetch_one(&pool)
            .await
            .unwrap()
        })
    };
    wait_for_lock_wait(pool, "cancel vs claim").await;
    sqlx::query("commit").execute(&mut claimer).await.unwrap();
    let done = tokio::time::timeout(Duration::from_secs(20), cancelling)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(done, ("cancelled".into(), true));
    assert_eq!(task_state(pool, run, "a", 0).await, ("cancelled".into(), 1));
    assert_eq!(complete_at(pool, run, "a", 0, 1).await, "stale");
    assert_eq!(live_messages(pool, "cl").await, 0);
}

#[tokio::test]
async fn retry_runs_failed_steps_again_and_keeps_completed_ones() {
    let db = test_db().await;
    let pool = db.pool();
    compile(pool, "rt", &chain(), "flow").await;
    let run = start(pool, "rt", json!({})).await;
    claim(pool, "rt", "rt", 1).await;
    assert_eq!(complete_at(pool, run, "a", 0, 1).await, "applied");
    claim(pool, "rt", "rt", 1).await;
    fail_final(pool, run, "b", 0, 1, "boom in b").await;
    assert_eq!(run_status(pool, run).await, "failed");

    let status: String =
        sqlx::query_scalar("select status from pgflow.retry_run($1, 'ops@example')")
            .bind(run)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(status, "started");
    assert_eq!(step_status(pool, run, "a").await, "completed");
    assert_eq!(step_status(pool, run, "b").await, "started");
    // Only b is claimable: a never runs again. b's attempt continues from the earlier ones (the fence), with
    // a fresh budget.
    let again = claim(pool, "rt", "rt", 10).await;
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].step_slug, "b");
    assert_eq!(
        again[0].input,
        Some(json!({"a": {"done": "a", "index": 0}}))
    );
    assert_eq!(task_state(pool, run, "b", 0).await, ("started".into(), 2));
    assert_eq!(
        complete_at(pool, run, "b", 0, 1).await,
        "stale",
        "a result of the first try"
    );
    assert_eq!(complete_at(pool, run, "b", 0, 2).await, "applied");
    claim(pool, "rt", "rt", 1).await;
    assert_eq!(complete_at(pool, run, "c", 0, 1).await, "applied");
    assert_eq!(run_status(pool, run).await, "completed");

    let (who, previous, errors, count): (String, String, Value, i32) = sqlx::query_as(
        "select rr.retried_by, rr.previous_status, rr.errors, r.retry_count
         from pgflow.run_retries rr join pgflow.runs r using (run_id) where rr.run_id = $1",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(who, "ops@example");
    assert_eq!(previous, "failed");
    assert_eq!(count, 1);
    assert_eq!(
        errors,
        json!([{"step_slug": "b", "task_index": 0, "attempts": 1, "error_message": "boom in b"}])
    );
}

#[tokio::test]
async fn retry_of_a_map_reruns_only_the_unfinished_tasks() {
    let db = test_db().await;
    let pool = db.pool();
    compile(pool, "rm", &root_map(), "flow").await;
    let run = start(pool, "rm", json!([0, 1, 2, 3, 4])).await;
    assert_eq!(claim(pool, "rm", "rm", 10).await.len(), 5);
    for i in [0, 2, 4] {
        assert_eq!(complete_at(pool, run, "m", i, 1).await, "applied");
    }
    fail_final(pool, run, "m", 1, 1, "bad item").await;
    assert_eq!(run_status(pool, run).await, "failed");
    assert_eq!(
        task_statuses(pool, run, "m").await,
        vec!["completed", "failed", "completed", "cancelled", "completed"]
    );

    sqlx::query("select pgflow.retry_run($1)")
        .bind(run)
        .execute(pool)
        .await
        .unwrap();
    let again = claim(pool, "rm", "rm", 10).await;
    let mut indexes: Vec<i32> = again.iter().map(|t| t.task_index).collect();
    indexes.sort_unstable();
    assert_eq!(
        indexes,
        vec![1, 3],
        "exactly the failed and the cancelled task run again"
    );
    for i in [1, 3] {
        assert_eq!(complete_at(pool, run, "m", i, 2).await, "applied");
    }
    assert_eq!(run_status(pool, run).await, "completed");
    assert_eq!(
        run_output(pool, run).await,
        Some(json!({"m": (0..5).map(|i| json!({"done": "m", "index": i})).collect::<Vec<_>>()}))
    );
}

#[tokio::test]
async fn retry_against_a_late_result_the_result_waits_and_is_stale() {
    let db = test_db().await;
    let pool = db.pool();
    compile(pool, "rl", &roots(&["x", "y"]), "flow").await;
    let run = start(pool, "rl", json!({})).await;
    assert_eq!(claim(pool, "rl", "rl", 10).await.len(), 2);
    fail_final(pool, run, "x", 0, 1, "x broke").await;
    assert_eq!(task_state(pool, run, "y", 0).await, ("cancelled".into(), 1));

    let mut retrier = connect(&db).await;
    sqlx::query("begin").execute(&mut retrier).await.unwrap();
    sqlx::query("select pgflow.retry_run($1)")
        .bind(run)
        .execute(&mut retrier)
        .await
        .unwrap();
    let late = {
        let pool = pool.clone();
        tokio::spawn(async move {
            sqlx::query_scalar::<_, String>(
                "select outcome /* late result */ from pgflow.complete_task(run_id => $1, step_slug => 'y',
                   task_index => 0, output => '1', attempt => 1)",
            )
            .bind(run)
            .fetch_one(&pool)
            .await
            .unwrap()
        })
    };
    wait_for_lock_wait(pool, "late result").await;
    sqlx::query("commit").execute(&mut retrier).await.unwrap();
    let outcome = tokio::time::timeout(Duration::from_secs(20), late)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(outcome, "stale");
    assert_eq!(task_state(pool, run, "y", 0).await, ("queued".into(), 1));
    assert_eq!(claim(pool, "rl", "rl", 10).await.len(), 2);
}

#[tokio::test]
async fn retry_is_refused_for_started_completed_unknown_runs_and_gone_versions() {
    let db = test_db().await;
    let pool = db.pool();
    compile(pool, "rr", &roots(&["a"]), "flow").await;
    let run = start(pool, "rr", json!({})).await;
    let retry = |id: Uuid| async move {
        db_error(
            sqlx::query("select pgflow.retry_run($1)")
                .bind(id)
                .execute(pool)
                .await
                .unwrap_err(),
        )
    };
    let err = retry(run).await;
    assert_eq!(err.code, SqlState::RunNotRetryable, "{err:?}");
    assert!(err.message.contains("still started"), "{err:?}");
    assert_eq!(run_status(pool, run).await, "started");
    assert_eq!(retry(Uuid::new_v4()).await.code, SqlState::RunNotFound);

    cancel(pool, run, "stop").await;
    sqlx::query("select pgmq.drop_queue('rr')")
        .execute(pool)
        .await
        .unwrap();
    let err = retry(run).await;
    assert_eq!(err.code, SqlState::FlowVersionGone, "{err:?}");
    assert_eq!(run_status(pool, run).await, "cancelled", "nothing changed");
}

#[tokio::test]
async fn replay_from_a_middle_step_copies_the_steps_before_it() {
    let db = test_db().await;
    let pool = db.pool();
    compile(pool, "rp", &chain(), "flow").await;
    let run = start(pool, "rp", json!({"n": 1})).await;
    for (step, _) in [("a", 0), ("b", 1), ("c", 2)] {
        claim(pool, "rp", "rp", 1).await;
        assert_eq!(complete_at(pool, run, step, 0, 1).await, "applied");
    }
    assert_eq!(run_status(pool, run).await, "completed");

    let replay: Uuid = sqlx::query_scalar("select pgflow.replay_run($1, 'b')")
        .bind(run)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_ne!(replay, run);
    let replay_of: Option<Uuid> =
        sqlx::query_scalar("select replay_of from pgflow.runs where run_id = $1")
            .bind(replay)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(replay_of, Some(run));
    assert_eq!(step_status(pool, replay, "a").await, "completed");
    let tasks = claim(pool, "rp", "rp", 10).await;
    assert_eq!(tasks.len(), 1);
    assert_eq!(tasks[0].step_slug, "b");
    assert_eq!(
        tasks[0].input,
        Some(json!({"a": {"done": "a", "index": 0}}))
    );
    assert_eq!(complete_at(pool, replay, "b", 0, 1).await, "applied");
    claim(pool, "rp", "rp", 1).await;
    assert_eq!(complete_at(pool, replay, "c", 0, 1).await, "applied");
    assert_eq!(run_status(pool, replay).await, "completed");
}

#[tokio::test]
async fn replay_refusals_change_nothing() {
    let db = test_db().await;
    let pool = db.pool();
    compile(pool, "rq", &chain(), "flow").await;
    compile(pool, "ro", &roots(&["elsewhere"]), "flow").await;
    let run = start(pool, "rq", json!({})).await;
    let before = runs_count(pool).await;
    let replay = |step: &'static str| async move {
        db_error(
            sqlx::query("select pgflow.replay_run($1, $2)")
                .bind(run)
                .bind(step)
                .execute(pool)
                .await
                .unwrap_err(),
        )
    };
    let err = replay("nope").await;
    assert_eq!(err.code, SqlState::UnknownReplayStep, "{err:?}");
    assert!(err.message.contains("\"nope\""), "{err:?}");
    assert!(
        err.hint.as_deref().unwrap_or("").contains("a, b, c"),
        "{err:?}"
    );
    let err = replay("elsewhere").await;
    assert_eq!(err.code, SqlState::UnknownReplayStep, "{err:?}");
    assert!(err.message.contains("it is a step of ro"), "{err:?}");
    // b's dependency a has not completed.
    let err = replay("b").await;
    assert_eq!(err.code, SqlState::ReplayNotPossible, "{err:?}");
    let err = db_error(
        sqlx::query("select pgflow.replay_run($1, 'a')")
            .bind(Uuid::new_v4())
            .execute(pool)
            .await
            .unwrap_err(),
    );
    assert_eq!(err.code, SqlState::RunNotFound, "{err:?}");
    assert_eq!(runs_count(pool).await, before);
}

async fn start_keyed(
    pool: &PgPool,
    flow: &str,
    input: Value,
    key: &str,
) -> Result<Uuid, sqlx::Error> {
    sqlx::query_scalar(
        "select run_id from pgflow.start_flows_with_keys($1, array[$2::jsonb], array[$3::text])",
    )
    .bind(flow)
    .bind(input)
    .bind(key)
    .fetch_one(pool)
    .await
}

#[tokio::test]
async fn idempotency_keys_return_the_existing_run_and_refuse_another_input() {
    let db = test_db().await;
    let pool = db.pool();
    compile(pool, "ik", &roots(&["a"]), "flow").await;
    let first = start_keyed(pool, "ik", json!({"order": 7}), "order-7")
        .await
        .unwrap();
    let again = start_keyed(pool, "ik", json!({"order": 7}), "order-7")
        .await
        .unwrap();
    assert_eq!(first, again);
    assert_eq!(runs_count(pool).await, 1);

    let err = db_error(
        start_keyed(pool, "ik", json!({"order": 8}), "order-7")
            .await
            .unwrap_err(),
    );
    assert_eq!(err.code, SqlState::IdempotencyKeyConflict, "{err:?}");
    assert!(err.message.contains("\"order-7\""), "{err:?}");
    assert_eq!(runs_count(pool).await, 1);

    // A key past its window starts a new run; retention removes expired keys.
    sqlx::query("update pgflow.idempotency_keys set created_at = now() - interval '2 days', expires_at = now() - interval '1 day'")
        .execute(pool)
        .await
        .unwrap();
    let later = start_keyed(pool, "ik", json!({"order": 7}), "order-7")
        .await
        .unwrap();
    assert_ne!(later, first);
    sqlx::query("update pgflow.idempotency_keys set created_at = now() - interval '2 days', expires_at = now() - interval '1 day'")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("select pgflow.prune_history(interval '30 days')")
        .execute(pool)
        .await
        .unwrap();
    let keys: i64 = sqlx::query_scalar("select count(*) from pgflow.idempotency_keys")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(keys, 0);
}

#[tokio::test]
async fn twenty_concurrent_keyed_starts_give_one_run() {
    let db = test_db().await;
    let pool = db.pool();
    compile(pool, "kc", &roots(&["a"]), "flow").await;
    let starts = (0..20).map(|_| {
        let pool = pool.clone();
        tokio::spawn(async move {
            start_keyed(&pool, "kc", json!({"x": 1}), "same")
                .await
                .unwrap()
        })
    });
    let ids: Vec<Uuid> = futures::future::join_all(starts)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert!(ids.iter().all(|id| *id == ids[0]), "{ids:?}");
    assert_eq!(runs_count(pool).await, 1);
    assert_eq!(live_messages(pool, "kc").await, 1);
}

/// The event log names each cancellation (with its reason), each retry in place (its number and who asked) and
/// each replay (the run it replays), one event each.
#[tokio::test]
async fn cancellations_retries_and_replays_are_in_the_event_log() {
    let db = test_db().await;
    let pool = db.pool();
    compile(pool, "ev", &chain(), "flow").await;
    let run = start(pool, "ev", json!({"n": 1})).await;
    claim(pool, "ev", "ev", 1).await;
    assert_eq!(complete_at(pool, run, "a", 0, 1).await, "applied");
    cancel(pool, run, "customer left").await;
    cancel(pool, run, "again").await; // no change, no second event
    sqlx::query("select pgflow.retry_run($1, 'ops@example')")
        .bind(run)
        .execute(pool)
        .await
        .unwrap();
    let replay: Uuid = sqlx::query_scalar("select pgflow.replay_run($1, 'b')")
        .bind(run)
        .fetch_one(pool)
        .await
        .unwrap();

    let events: Vec<(String, Option<Uuid>, Option<String>, Value)> = sqlx::query_as(
        "select kind, run_id, flow_slug, detail from pgflow.events
         where kind in ('run_cancelled', 'run_retried', 'run_replayed') order by event_id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        events,
        vec![
            (
                "run_cancelled".to_owned(),
                Some(run),
                Some("ev".to_owned()),
                json!({"reason": "customer left"})
            ),
            (
                "run_retried".to_owned(),
                Some(run),
                Some("ev".to_owned()),
                json!({"retry_number": 1, "retried_by": "ops@example", "previous_status": "cancelled"})
            ),
            (
                "run_replayed".to_owned(),
                Some(replay),
                Some("ev".to_owned()),
                json!({"replay_of": run})
            ),
        ]
    );
}
