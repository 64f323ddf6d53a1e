//! The attempt history (`pgflow.task_attempts`): every path that ends an attempt without it being the task's
//! last state records it, claims and completions record nothing, and retention deletes it with its run. And
//! the dry runs of prune_history and cancel_runs: the count the real calls then affect, changing nothing.

use crate::step_support::*;
use crate::support::*;
use pgflow_tests::test_db;
use serde_json::{json, Value};
use sqlx::PgPool;
use uuid::Uuid;

/// One history row: attempt, outcome, worker, error.
type Attempt = (i32, String, Option<Uuid>, Option<String>);

/// The history of `run` in the order recorded.
async fn history(pool: &PgPool, run: Uuid) -> Vec<Attempt> {
    sqlx::query_as(
        "select attempt, outcome, worker_id, error_message from pgflow.task_attempts
         where run_id = $1 order by attempt_id",
    )
    .bind(run)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Whether every history row of `run` has queued <= started <= ended, and each attempt was queued no earlier
/// than the previous one ended.
async fn times_in_order(pool: &PgPool, run: Uuid) -> bool {
    sqlx::query_scalar(
        "select coalesce(bool_and(queued_at <= started_at and started_at <= ended_at
                                  and (prev_end is null or queued_at >= prev_end)), true)
         from (select queued_at, started_at, ended_at,
                      lag(ended_at) over (partition by step_slug, task_index order by attempt_id) as prev_end
               from pgflow.task_attempts where run_id = $1) x",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A flow `flow` with one step "work" (`max_attempts`, no backoff, timeout 1 s) and a registered worker.
async fn one_step_flow(pool: &PgPool, flow: &str, max_attempts: i32) -> Uuid {
    let mut shape = roots(&["work"]);
    shape["options"] = json!({"timeout": 1, "maxAttempts": max_attempts, "baseDelay": 0});
    compile(pool, flow, &shape, "flow").await;
    new_worker(pool, flow).await
}

async fn new_worker(pool: &PgPool, flow: &str) -> Uuid {
    let worker = Uuid::new_v4();
    register(pool, worker, &format!("{flow}-worker"), flow, flow, None).await;
    worker
}

/// Claims the visible task of `flow` with `worker`; returns the attempt it started.
async fn claim_one(pool: &PgPool, flow: &str, worker: Uuid) -> i64 {
    let msgs = read(pool, flow, 1).await;
    let claimed = claim_tasks(pool, flow, flow, None, &msgs, worker).await;
    claimed["tasks"][0]["attempts_count"]
        .as_i64()
        .unwrap_or_else(|| panic!("a task of {flow} claimed: {claimed}"))
}

/// Makes the started tasks of `flow` look like they started an hour ago.
async fn age_started(pool: &PgPool, flow: &str) {
    exec(
        pool,
        &format!(
            "update pgflow.step_tasks set queued_at = least(queued_at, now() - interval '2 hours'),
                    started_at = now() - interval '1 hour'
              where flow_slug = '{flow}' and status = 'started'"
        ),
    )
    .await;
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

#[tokio::test]
async fn a_task_failing_twice_then_succeeding_keeps_both_failures_in_order_and_the_happy_path_writes_none(
) {
    let db = test_db().await;
    let pool = db.pool();
    let first = one_step_flow(pool, "hist", 3).await;
    let second = new_worker(pool, "hist").await;
    let third = new_worker(pool, "hist").await;

    // A run whose task succeeds at once: no history.
    let clean = start(pool, "hist", json!({})).await;
    claim_one(pool, "hist", first).await;
    complete(pool, clean, "work", 0, json!(0)).await;
    assert!(history(pool, clean).await.is_empty());

    let run = start(pool, "hist", json!({})).await;
    assert_eq!(claim_one(pool, "hist", first).await, 1);
    assert_eq!(fail(pool, run, "work", 0, "boom 1").await, "queued");
    assert_eq!(claim_one(pool, "hist", second).await, 2);
    assert_eq!(fail(pool, run, "work", 0, "boom 2").await, "queued");
    assert_eq!(claim_one(pool, "hist", third).await, 3);
    assert_eq!(complete(pool, run, "work", 0, json!(3)).await, "completed");

    assert_eq!(
        history(pool, run).await,
        [
            (1, "failed".into(), Some(first), Some("boom 1".into())),
            (2, "failed".into(), Some(second), Some("boom 2".into())),
        ]
    );
    assert!(times_in_order(pool, run).await);
    // The last attempt is the task row itself.
    let (status, attempts, worker): (String, i32, Option<Uuid>) = sqlx::query_as(
        "select status, attempts_count, last_worker_id from pgflow.step_tasks where run_id = $1",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        (status.as_str(), attempts, worker),
        ("completed", 3, Some(third))
    );
}

#[tokio::test]
async fn stalled_and_dead_worker_requeues_and_a_release_record_the_attempt_they_end() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = one_step_flow(pool, "stall", 5).await;
    let run = start(pool, "stall", json!({})).await;

    // A failure first, so that the task row carries an error while the next attempt runs.
    claim_one(pool, "stall", worker).await;
    fail(pool, run, "work", 0, "boom").await;

    // Attempt 2 stalls: requeued by recovery, recorded without the earlier error.
    claim_one(pool, "stall", worker).await;
    age_started(pool, "stall").await;
    let requeued: i32 = sqlx::query_scalar("select pgflow.requeue_stalled_tasks()")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(requeued, 1);

    // Attempt 3's worker goes silent: requeued by dead-worker recovery.
    let silent = new_worker(pool, "stall").await;
    claim_one(pool, "stall", silent).await;
    exec(
        pool,
        &format!(
            "update pgflow.workers set last_heartbeat_at = now() - interval '1 minute'
             where worker_id = '{silent}'"
        ),
    )
    .await;
    let recovered: i32 =
        sqlx::query_scalar("select pgflow.requeue_dead_worker_tasks(interval '10 seconds')")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(recovered, 1);

    // Attempt 4 is handed back at shutdown; the next claim numbers its attempt 4 again.
    claim_one(pool, "stall", worker).await;
    let released: i32 = sqlx::query_scalar("select pgflow.release_worker_tasks($1)")
        .bind(worker)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(released, 1);
    assert_eq!(claim_one(pool, "stall", worker).await, 4);

    assert_eq!(
        history(pool, run).await,
        [
            (1, "failed".into(), Some(worker), Some("boom".into())),
            (2, "stalled".into(), Some(worker), None),
            (3, "worker_lost".into(), Some(silent), None),
            (4, "released".into(), Some(worker), None),
        ]
    );
}

#[tokio::test]
async fn a_permanently_stalled_task_retried_by_the_operator_records_its_stalled_attempt() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = one_step_flow(pool, "perm", 10).await;
    let run = start(pool, "perm", json!({})).await;
    for _ in 0..4 {
        claim_one(pool, "perm", worker).await;
        age_started(pool, "perm").await;
        exec(pool, "select pgflow.requeue_stalled_tasks()").await;
    }
    // Three requeues recorded; the fourth stall marks the task permanently stalled, still started.
    assert_eq!(history(pool, run).await.len(), 3);
    exec(
        pool,
        &format!("select pgflow.resolve_stalled_task('{run}', 'work', 0, 'retry')"),
    )
    .await;
    let outcomes: Vec<String> = history(pool, run).await.into_iter().map(|a| a.1).collect();
    assert_eq!(outcomes, ["stalled"; 4]);
}

#[tokio::test]
async fn retry_run_records_the_failed_attempt_with_its_error_and_failure_time() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = one_step_flow(pool, "again", 1).await;
    let run = start(pool, "again", json!({})).await;
    claim_one(pool, "again", worker).await;
    assert_eq!(fail(pool, run, "work", 0, "final boom").await, "failed");
    assert_eq!(run_status(pool, run).await, "failed");
    let failed_at: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("select failed_at from pgflow.step_tasks where run_id = $1")
            .bind(run)
            .fetch_one(pool)
            .await
            .unwrap();

    exec(pool, &format!("select pgflow.retry_run('{run}')")).await;
    assert_eq!(
        history(pool, run).await,
        [(
            1,
            "run_retried".into(),
            Some(worker),
            Some("final boom".into())
        )]
    );
    let ended_at: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("select ended_at from pgflow.task_attempts where run_id = $1")
            .bind(run)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(ended_at, failed_at);

    // The retried attempt succeeds: nothing more is recorded.
    assert_eq!(claim_one(pool, "again", worker).await, 2);
    complete(pool, run, "work", 0, json!(1)).await;
    assert_eq!(history(pool, run).await.len(), 1);
}

#[tokio::test]
async fn prune_history_deletes_the_attempt_history_of_the_runs_it_prunes_and_only_theirs() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = one_step_flow(pool, "old", 3).await;
    let mut runs = Vec::new();
    for _ in 0..2 {
        let run = start(pool, "old", json!({})).await;
        claim_one(pool, "old", worker).await;
        fail(pool, run, "work", 0, "boom").await;
        claim_one(pool, "old", worker).await;
        complete(pool, run, "work", 0, json!(1)).await;
        runs.push(run);
    }
    let (old, recent) = (runs[0], runs[1]);
    exec(
        pool,
        &format!(
            "update pgflow.runs set started_at = now() - interval '40 days',
                    completed_at = now() - interval '39 days' where run_id = '{old}'"
        ),
    )
    .await;
    assert_eq!(
        count(pool, "select count(*) from pgflow.task_attempts").await,
        2
    );

    let pruned: Value = sqlx::query_scalar("select pgflow.prune_history(interval '30 days')")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(pruned["runs"], json!(1));
    assert!(history(pool, old).await.is_empty());
    assert_eq!(history(pool, recent).await.len(), 1);

    // Deleting a flow's data deletes its history too.
    exec(pool, "select pgflow.delete_flow_and_data('old')").await;
    assert_eq!(
        count(pool, "select count(*) from pgflow.task_attempts").await,
        0
    );
}

/// What a dry run must leave as it was: runs by status, tasks, history, live and archived messages.
async fn footprint(pool: &PgPool, queue: &str) -> Value {
    sqlx::query_scalar(&format!(
        "select jsonb_build_object(
           'runs', (select jsonb_object_agg(status, n) from
                     (select status, count(*) as n from pgflow.runs group by status) s),
           'tasks', (select count(*) from pgflow.step_tasks),
           'attempts', (select count(*) from pgflow.task_attempts),
           'messages', (select count(*) from pgmq.q_{queue}),
           'archived', (select count(*) from pgmq.a_{queue}))"
    ))
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn prune_history_dry_run_counts_what_the_real_calls_then_delete_and_changes_nothing() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = one_step_flow(pool, "ret", 3).await;
    for _ in 0..5 {
        let run = start(pool, "ret", json!({})).await;
        claim_one(pool, "ret", worker).await;
        complete(pool, run, "work", 0, json!(1)).await;
    }
    let _running = start(pool, "ret", json!({})).await;
    exec(
        pool,
        "update pgflow.runs set started_at = now() - interval '10 days',
                completed_at = now() - interval '9 days'
          where status = 'completed' and run_id in (select run_id from pgflow.runs
                                                    where status = 'completed' order by run_id limit 4);
         update pgflow.runs set started_at = now() - interval '10 days' where status = 'started';",
    )
    .await;

    let before = footprint(pool, "ret").await;
    let dry: Value =
        sqlx::query_scalar("select pgflow.prune_history(interval '7 days', 2, dry_run => true)")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(
        dry,
        json!({"runs": 4, "dry_run": true}),
        "max_runs bounds a real call only"
    );
    assert_eq!(
        footprint(pool, "ret").await,
        before,
        "the dry run changed something"
    );

    let mut deleted = 0;
    loop {
        let pruned: Value = sqlx::query_scalar("select pgflow.prune_history(interval '7 days', 2)")
            .fetch_one(pool)
            .await
            .unwrap();
        let n = pruned["runs"].as_i64().unwrap();
        deleted += n;
        if n < 2 {
            break;
        }
    }
    assert_eq!(deleted, 4);
    let after: Value =
        sqlx::query_scalar("select pgflow.prune_history(interval '7 days', dry_run => true)")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(after["runs"], json!(0));

    let error = exec_err(
        pool,
        "select pgflow.prune_history(interval '7 days', 10, dry_run => null)",
    )
    .await;
    assert!(error.contains("dry_run true or false"), "{error}");
}

#[tokio::test]
async fn cancel_runs_dry_run_counts_what_the_real_calls_then_cancel_and_changes_nothing() {
    let db = test_db().await;
    let pool = db.pool();
    one_step_flow(pool, "many", 1).await;
    one_step_flow(pool, "other", 1).await;
    for i in 0..5 {
        start(pool, "many", json!({"tenant": i % 2})).await;
    }
    start(pool, "other", json!({"tenant": 0})).await;
    let dry = |filter: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i32>(&format!(
                "select pgflow.cancel_runs({filter}, max_runs => 1, dry_run => true)"
            ))
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };

    let before = footprint(pool, "many").await;
    assert_eq!(dry("flow_slug => 'many'").await, 5);
    assert_eq!(
        dry("flow_slug => 'many', input_path => '{tenant}', input_value => '0'").await,
        3
    );
    assert_eq!(dry("input_path => '{tenant}', input_value => '0'").await, 4);
    assert_eq!(
        footprint(pool, "many").await,
        before,
        "the dry run changed something"
    );

    let mut cancelled = 0;
    loop {
        let n: i32 = sqlx::query_scalar(
            "select pgflow.cancel_runs(flow_slug => 'many', input_path => '{tenant}', input_value => '0',
                                       max_runs => 2)",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        cancelled += n;
        if n < 2 {
            break;
        }
    }
    assert_eq!(cancelled, 3);
    assert_eq!(dry("flow_slug => 'many'").await, 2);

    let error = exec_err(pool, "select pgflow.cancel_runs(dry_run => null)").await;
    assert!(error.contains("dry_run must be true or false"), "{error}");
}
