//! Maintenance: stalled-task recovery, the operator's decision for permanently stalled tasks, pruning,
//! set_vt_batch, delete_flow_and_data and worker bookkeeping.

use crate::support::*;
use pgflow_tests::test_db;
use serde_json::json;
use uuid::Uuid;

/// Makes every started task of the flow look like it started an hour ago.
async fn age_started_tasks(pool: &sqlx::PgPool, flow: &str) {
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

async fn requeue(pool: &sqlx::PgPool) -> i32 {
    sqlx::query_scalar("select pgflow.requeue_stalled_tasks()")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Stalls the single task of a fresh run of `flow` four times, so that it ends permanently stalled.
async fn permanently_stalled(pool: &sqlx::PgPool, flow: &str) -> Uuid {
    exec(pool, &format!("select pgflow.create_flow('{flow}', timeout => 1); select pgflow.add_step('{flow}', 'a');")).await;
    let run = start(pool, flow, json!({})).await;
    for round in 0..3 {
        assert_eq!(claim(pool, flow, flow, 1).await.len(), 1, "round {round}");
        age_started_tasks(pool, flow).await;
        assert_eq!(requeue(pool).await, 1);
    }
    claim(pool, flow, flow, 1).await;
    age_started_tasks(pool, flow).await;
    assert_eq!(requeue(pool).await, 0, "the fourth stall is not requeued");
    run
}

#[tokio::test]
async fn stalled_task_is_requeued_with_its_message_visible_again() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('stall', timeout => 1); select pgflow.add_step('stall', 'a');",
    )
    .await;
    let run = start(pool, "stall", json!({})).await;
    let task = claim(pool, "stall", "stall", 1).await.remove(0);
    age_started_tasks(pool, "stall").await;
    assert_eq!(requeue(pool).await, 1);
    let (status, requeued, worker): (String, i32, Option<Uuid>) = sqlx::query_as(
        "select status, requeued_count, last_worker_id from pgflow.step_tasks where run_id = $1",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((status.as_str(), requeued, worker), ("queued", 1, None));
    assert!(seconds_until_visible(pool, "stall", task.msg_id).await <= 0.0);
    assert_eq!(claim(pool, "stall", "stall", 1).await.len(), 1);
}

#[tokio::test]
async fn task_stalled_three_times_is_marked_permanently_stalled_and_its_message_archived() {
    let db = test_db().await;
    let pool = db.pool();
    let run = permanently_stalled(pool, "stuck").await;
    let (status, stalled): (String, bool) = sqlx::query_as(
        "select status, permanently_stalled_at is not null from pgflow.step_tasks where run_id = $1",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((status.as_str(), stalled), ("started", true));
    assert_eq!(live_messages(pool, "stuck").await, 0);
}

#[tokio::test]
async fn operator_retries_a_permanently_stalled_task_with_a_fresh_message() {
    let db = test_db().await;
    let pool = db.pool();
    let run = permanently_stalled(pool, "revive").await;
    let status: String = sqlx::query_scalar(
        "select status from pgflow.resolve_stalled_task(run_id => $1, step_slug => 'a', task_index => 0, action => 'retry')",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(status, "queued");
    let tasks = claim(pool, "revive", "revive", 1).await;
    assert_eq!(tasks.len(), 1);
    complete(pool, run, "a", 0, json!("finally")).await;
    assert_eq!(run_status(pool, run).await, "completed");
}

#[tokio::test]
async fn operator_fails_a_permanently_stalled_task_which_applies_when_exhausted() {
    let db = test_db().await;
    let pool = db.pool();
    let run = permanently_stalled(pool, "bury").await;
    let status: String = sqlx::query_scalar(
        "select status from pgflow.resolve_stalled_task(run_id => $1, step_slug => 'a', task_index => 0, action => 'fail')",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(status, "failed");
    assert_eq!(run_status(pool, run).await, "failed");
    let err = exec_err(
        pool,
        &format!("select pgflow.resolve_stalled_task('{run}', 'a', 0, 'retry')"),
    )
    .await;
    assert!(err.contains("is not permanently stalled"), "{err}");
    let err = exec_err(
        pool,
        &format!("select pgflow.resolve_stalled_task('{run}', 'a', 0, 'ignore')"),
    )
    .await;
    assert!(err.contains("action must be 'fail' or 'retry'"), "{err}");
}

#[tokio::test]
async fn concurrent_requeue_calls_requeue_each_stalled_task_once() {
    let db = test_db().await;
    let pool = db.pool();
    exec(pool, "select pgflow.create_flow('many', timeout => 1); select pgflow.add_step('many', 'each', step_type => 'map');").await;
    start(pool, "many", json!((0..50).collect::<Vec<_>>())).await;
    assert_eq!(claim(pool, "many", "many", 50).await.len(), 50);
    age_started_tasks(pool, "many").await;
    let calls: Vec<_> = (0..4)
        .map(|_| {
            let pool = pool.clone();
            tokio::spawn(async move { requeue(&pool).await })
        })
        .collect();
    let mut total = 0;
    for call in calls {
        total += call.await.unwrap();
    }
    assert_eq!(total, 50);
    let requeued: i64 = sqlx::query_scalar("select sum(requeued_count) from pgflow.step_tasks")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(requeued, 50);
}

#[tokio::test]
async fn prune_removes_finished_runs_older_than_the_interval_with_their_tasks_and_messages() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('old'); select pgflow.add_step('old', 'a');",
    )
    .await;
    let done = start(pool, "old", json!({})).await;
    claim(pool, "old", "old", 1).await;
    complete(pool, done, "a", 0, json!(1)).await;
    let running = start(pool, "old", json!({})).await;
    let recent = start(pool, "old", json!({})).await;
    let recent_task = claim(pool, "old", "old", 10).await;
    assert_eq!(recent_task.len(), 2);
    complete(pool, recent, "a", 0, json!(2)).await;
    exec(
        pool,
        &format!(
            "update pgflow.runs set started_at = now() - interval '40 days', completed_at = now() - interval '39 days'
              where run_id = '{done}';
             update pgflow.runs set started_at = now() - interval '40 days' where run_id = '{running}';
             update pgmq.a_old set archived_at = now() - interval '39 days'
              where msg_id = (select message_id from pgflow.step_tasks where run_id = '{done}');"
        ),
    )
    .await;

    exec(
        pool,
        "select pgflow.prune_data_older_than(retention_interval => interval '30 days')",
    )
    .await;

    let runs: Vec<Uuid> =
        sqlx::query_scalar("select run_id from pgflow.runs order by started_at, run_id")
            .fetch_all(pool)
            .await
            .unwrap();
    assert!(!runs.contains(&done));
    assert!(runs.contains(&running) && runs.contains(&recent));
    let orphans: i64 = sqlx::query_scalar(
        "select (select count(*) from pgflow.step_tasks where run_id = $1) + (select count(*) from pgflow.step_states where run_id = $1)",
    )
    .bind(done)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(orphans, 0);
    let archived: i64 = sqlx::query_scalar("select count(*) from pgmq.a_old")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(
        archived, 1,
        "only the recent run's archived message remains"
    );
    let definitions: i64 = sqlx::query_scalar("select count(*) from pgflow.steps")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(definitions, 1);
}

#[tokio::test]
async fn set_vt_batch_sets_each_message_visibility_and_validates_its_arguments() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgmq.create('vtq'); select pgmq.send('vtq', '{}'); select pgmq.send('vtq', '{}');",
    )
    .await;
    let rows: Vec<(i64, f64)> = sqlx::query_as(
        "select msg_id, extract(epoch from vt - clock_timestamp())::float8
           from pgflow.set_vt_batch(queue_name => 'vtq', msg_ids => array[1, 2]::bigint[], vt_offsets => array[10, 100])
          order by msg_id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 2);
    assert!(
        (9.0..=10.0).contains(&rows[0].1) && (99.0..=100.0).contains(&rows[1].1),
        "{rows:?}"
    );
    let empty: i64 = sqlx::query_scalar(
        "select count(*) from pgflow.set_vt_batch('vtq', array[]::bigint[], array[]::int[])",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(empty, 0);
    let err = exec_err(
        pool,
        "select pgflow.set_vt_batch('vtq', array[1, 2]::bigint[], array[1])",
    )
    .await;
    assert_eq!(err, "msg_ids length (2) must equal vt_offsets length (1)");
    let err = exec_err(
        pool,
        "select pgflow.set_vt_batch('nope', array[1]::bigint[], array[1])",
    )
    .await;
    assert_eq!(err, "relation \"pgmq.q_nope\" does not exist");
}

#[tokio::test]
async fn delete_flow_and_data_removes_the_flow_its_runs_and_its_queue() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('Doomed'); select pgflow.add_step('Doomed', 'a');",
    )
    .await;
    exec(
        pool,
        "select pgflow.create_flow('kept'); select pgflow.add_step('kept', 'a');",
    )
    .await;
    start(pool, "Doomed", json!({})).await;
    start(pool, "kept", json!({})).await;
    exec(
        pool,
        "select pgflow.delete_flow_and_data(p_flow_slug => 'Doomed')",
    )
    .await;
    let left: (i64, i64, i64) = sqlx::query_as(
        "select (select count(*) from pgflow.flows), (select count(*) from pgflow.runs),
                (select count(*) from pgmq.meta where lower(queue_name) = 'doomed')",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(left, (1, 1, 0));
}

#[tokio::test]
async fn worker_functions_are_tracked_and_workers_marked_stopped() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.track_worker_function('fn_a'); select pgflow.track_worker_function('fn_a');",
    )
    .await;
    let (count, enabled): (i64, bool) =
        sqlx::query_as("select count(*), bool_and(enabled) from pgflow.worker_functions")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!((count, enabled), (1, true));
    register_worker(pool).await;
    sqlx::query("select pgflow.mark_worker_stopped(worker_id => $1)")
        .bind(WORKER)
        .execute(pool)
        .await
        .unwrap();
    let stopped: bool = sqlx::query_scalar(
        "select stopped_at is not null from pgflow.workers where worker_id = $1",
    )
    .bind(WORKER)
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(stopped);
}

#[tokio::test]
async fn deprecated_poll_for_tasks_returns_nothing() {
    let db = test_db().await;
    let n: i64 = sqlx::query_scalar("select count(*) from pgflow.poll_for_tasks('any', 1, 1)")
        .fetch_one(db.pool())
        .await
        .unwrap();
    assert_eq!(n, 0);
}

#[tokio::test]
async fn scheduling_stalled_recovery_with_cron_explains_that_pg_cron_is_missing() {
    let db = test_db().await;
    let err = exec_err(
        db.pool(),
        "select pgflow.setup_requeue_stalled_tasks_cron('15 seconds')",
    )
    .await;
    assert_eq!(
        err,
        "setup_requeue_stalled_tasks_cron(): pg_cron is not installed"
    );
}
