//! Observability in SQL: the event log (each event naming its cause), the failure channel, retention of
//! events, the trace context stored with a run and returned by the claim, and queue depth.

use std::time::Duration;

use crate::step_support::*;
use crate::support::*;
use pgflow_sql::SqlState;
use pgflow_tests::test_db;
use serde_json::{json, Value};
use sqlx::postgres::PgListener;
use sqlx::PgPool;
use uuid::Uuid;

/// A plain flow "obs" with one step "work" (max_attempts 2) and a registered worker.
async fn setup(pool: &PgPool) -> Uuid {
    let mut shape = roots(&["work"]);
    shape["options"]["maxAttempts"] = json!(2);
    compile(pool, "obs", &shape, "flow").await;
    let worker = Uuid::new_v4();
    register(pool, worker, "obs-worker", "obs", "obs", None).await;
    worker
}

async fn claim_all(pool: &PgPool, worker: Uuid) -> Value {
    let msgs = read(pool, "obs", 10).await;
    claim_tasks(pool, "obs", "obs", None, &msgs, worker).await
}

/// The events of one kind: (cause, run_id, step_slug, detail), oldest first.
async fn events(pool: &PgPool, kind: &str) -> Vec<(String, Option<Uuid>, Option<String>, Value)> {
    sqlx::query_as(
        "select cause, run_id, step_slug, detail from pgflow.events where kind = $1 order by event_id",
    )
    .bind(kind)
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn fenced_fail(pool: &PgPool, run: Uuid, attempt: i32, worker: Uuid) -> String {
    sqlx::query_scalar(
        "select outcome from pgflow.fail_task(run_id => $1, step_slug => 'work', task_index => 0,
           error_message => 'boom', attempt => $2, worker_id => $3)",
    )
    .bind(run)
    .bind(attempt)
    .bind(worker)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_deferred_read_and_stale_results_are_logged_with_their_cause() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let run = start(pool, "obs", json!({})).await;
    let claimed = claim_all(pool, worker).await;
    let msg = ids(&claimed["tasks"])[0];

    // The same message claimed again while its task runs: deferred, and logged.
    let again = claim_tasks(pool, "obs", "obs", None, &[msg], worker).await;
    assert_eq!(ids(&again["deferred"]), [msg]);
    let deferred = events(pool, "deferred_read").await;
    assert_eq!(deferred.len(), 1, "{deferred:?}");
    assert_eq!(deferred[0].0, "duplicate_visibility");
    assert_eq!(deferred[0].1, Some(run));
    assert_eq!(deferred[0].3["msg_id"], json!(msg));

    // A completion of an attempt that is not current, and a failure of one: both stale, both logged.
    let outcome: String = sqlx::query_scalar(
        "select outcome from pgflow.complete_tasks(run_ids => array[$1]::uuid[], step_slugs => array['work'],
           task_indexes => array[0], outputs => array['1']::jsonb[], attempts => array[7], worker_id => $2)",
    )
    .bind(run)
    .bind(worker)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(outcome, "stale");
    assert_eq!(fenced_fail(pool, run, 5, worker).await, "stale");
    let stale = events(pool, "stale_result").await;
    assert_eq!(stale.len(), 2, "{stale:?}");
    for (cause, run_id, step, detail) in &stale {
        assert_eq!(cause, "attempt_superseded");
        assert_eq!((*run_id, step.as_deref()), (Some(run), Some("work")));
        assert_eq!(detail["current_attempt"], 1);
    }
    assert_eq!(stale[0].3["attempt"], 7);
    assert_eq!(stale[1].3["attempt"], 5);

    // The current attempt completes: nothing more is logged as stale.
    let outcome: String = sqlx::query_scalar(
        "select outcome from pgflow.complete_tasks(run_ids => array[$1]::uuid[], step_slugs => array['work'],
           task_indexes => array[0], outputs => array['1']::jsonb[], attempts => array[1], worker_id => $2)",
    )
    .bind(run)
    .bind(worker)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(outcome, "applied");
    assert_eq!(events(pool, "stale_result").await.len(), 2);
    // After the run completed, a late result names the finished run as the cause.
    assert_eq!(fenced_fail(pool, run, 1, worker).await, "stale");
    assert_eq!(events(pool, "stale_result").await[2].0, "run_completed");
}

#[tokio::test]
async fn an_unsupported_batch_is_logged_as_an_unsupported_stop() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    start(pool, "obs", json!({})).await;
    let msgs = read(pool, "obs", 10).await;
    // A worker that claims for a step the flow does not have there: the batch is unsupported.
    let rows = sqlx::query(
        "select * from pgflow.claim_tasks(queue_name => 'obs', msg_ids => $1, worker_id => $2,
           flow_slugs => array['obs'], step_slugs => array['other'])",
    )
    .bind(&msgs)
    .bind(worker)
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(claim_json(rows)["outcome"], "unsupported");
    let stops: Vec<(String, Option<Uuid>, String, Value)> = sqlx::query_as(
        "select cause, worker_id, queue_name, detail from pgflow.events where kind = 'unsupported_stop'",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(stops.len(), 1);
    assert_eq!(
        (stops[0].0.as_str(), stops[0].1, stops[0].2.as_str()),
        ("claim", Some(worker), "obs")
    );
    assert_eq!(stops[0].3["unsupported_msg_ids"], json!(msgs));
}

#[tokio::test]
async fn fences_and_alias_activations_name_who_caused_them() {
    let db = test_db().await;
    let pool = db.pool();
    setup(pool).await;
    compile(pool, "obs_v2", &roots(&["work"]), "flow").await;

    exec(
        pool,
        "select pgflow.disable_worker_function('obs-worker', 'deploying')",
    )
    .await;
    exec(pool, "select pgflow.enable_worker_function('obs-worker')").await;
    // A worker's own disable names it (pgflow-rs workers set pgflow.cause in the same statement).
    exec(
        pool,
        "select pgflow.disable_worker_function(
           'obs-worker' || left(set_config('pgflow.cause', 'worker', true), 0), 'unsupported batch')",
    )
    .await;
    let fences: Vec<(String, String, Value)> = sqlx::query_as(
        "select kind, cause, detail from pgflow.events where kind like 'fence%' order by event_id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        fences
            .iter()
            .map(|(k, c, d)| (k.as_str(), c.as_str(), d["reason"].clone()))
            .collect::<Vec<_>>(),
        [
            ("fence_set", "operator", json!("deploying")),
            ("fence_lifted", "operator", Value::Null),
            ("fence_set", "worker", json!("unsupported batch")),
        ]
    );

    // An operator points the alias at v1, a starting worker moves it to v2, then back to v1.
    exec(pool, "select pgflow.activate_alias('obs_live', 'obs')").await;
    exec(
        pool,
        "select pgflow.activate_alias('obs_live' || left(set_config('pgflow.cause', 'worker_startup', true), 0),
           'obs_v2')",
    )
    .await;
    exec(pool, "select pgflow.activate_alias('obs_live', 'obs_v2')").await; // no move: no event
    exec(pool, "select pgflow.activate_alias('obs_live', 'obs')").await;
    let moves: Vec<(String, Option<String>, Value)> = sqlx::query_as(
        "select cause, flow_slug, detail from pgflow.events where kind = 'alias_activated' order by event_id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        moves
            .iter()
            .map(|(c, f, d)| (c.as_str(), f.clone().unwrap(), d["moved_back"].clone()))
            .collect::<Vec<_>>(),
        [
            ("operator", "obs".to_owned(), json!(false)),
            ("worker_startup", "obs_v2".to_owned(), json!(false)),
            ("operator", "obs".to_owned(), json!(true)),
        ]
    );
}

#[tokio::test]
async fn each_failure_is_notified_once_on_pgflow_failures_and_logged() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let mut listener = PgListener::connect_with(pool).await.unwrap();
    listener.listen("pgflow_failures").await.unwrap();
    let run = start(pool, "obs", json!({})).await;

    claim_all(pool, worker).await;
    assert_eq!(fenced_fail(pool, run, 1, worker).await, "applied"); // retried: no failure yet
    make_visible(pool, "obs").await;
    claim_all(pool, worker).await;
    assert_eq!(fenced_fail(pool, run, 2, worker).await, "applied"); // exhausted: task and run fail
    assert_eq!(fenced_fail(pool, run, 2, worker).await, "stale"); // the same reply again: nothing new

    let mut got = Vec::new();
    while let Ok(n) = tokio::time::timeout(Duration::from_millis(500), listener.recv()).await {
        got.push(serde_json::from_str::<Value>(n.unwrap().payload()).unwrap());
    }
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(
        got[0],
        json!({"kind": "task_failed", "run_id": run, "flow_slug": "obs", "step_slug": "work",
               "task_index": 0, "attempt": 2, "error": "boom"})
    );
    assert_eq!(
        got[1],
        json!({"kind": "run_failed", "run_id": run, "flow_slug": "obs", "step_slug": "work", "error": "boom"})
    );
    let logged: Vec<(String, String)> = sqlx::query_as(
        "select kind, cause from pgflow.events where kind in ('task_failed', 'run_failed') order by event_id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        logged,
        [
            ("task_failed".to_owned(), "attempts_exhausted".to_owned()),
            ("run_failed".to_owned(), "step_failed".to_owned())
        ]
    );
}

#[tokio::test]
async fn a_permanently_stalled_task_is_logged_and_retention_prunes_old_events() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let run = start(pool, "obs", json!({})).await;
    claim_all(pool, worker).await;
    // Requeued three times already and stalled again: recovery marks it permanently stalled.
    exec(
        pool,
        &format!(
            "update pgflow.step_tasks set queued_at = now() - interval '2 hours',
               started_at = now() - interval '1 hour', requeued_count = 3 where run_id = '{run}'"
        ),
    )
    .await;
    exec(pool, "select pgflow.requeue_stalled_tasks()").await;
    let stalled = events(pool, "task_stalled_permanently").await;
    assert_eq!(stalled.len(), 1, "{stalled:?}");
    assert_eq!(
        (stalled[0].0.as_str(), stalled[0].1),
        ("maintenance", Some(run))
    );

    // Retention: events older than the interval go, newer ones stay.
    exec(pool, "select pgflow._log_event('custom_kind', 'test')").await;
    exec(pool, "update pgflow.events set occurred_at = now() - interval '2 days' where kind <> 'custom_kind'").await;
    let pruned: Value = sqlx::query_scalar("select pgflow.prune_history(interval '1 day', 1000)")
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(pruned["events"].as_i64().unwrap() >= 1, "{pruned}");
    let left: Vec<String> = sqlx::query_scalar("select kind from pgflow.events")
        .fetch_all(pool)
        .await
        .unwrap();
    assert_eq!(left, ["custom_kind"]);
}

#[tokio::test]
async fn the_trace_context_setting_is_stored_with_the_run_and_returned_by_the_claim() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let ctx = json!({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"});
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("select set_config('pgflow.trace_context', $1, true)")
        .bind(ctx.to_string())
        .execute(&mut *tx)
        .await
        .unwrap();
    let run: Uuid = sqlx::query_scalar("select run_id from pgflow.start_flow('obs', '{}'::jsonb)")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let stored: Option<Value> =
        sqlx::query_scalar("select trace_context from pgflow.runs where run_id = $1")
            .bind(run)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(stored, Some(ctx.clone()));
    // Without the setting: no context.
    let plain = start(pool, "obs", json!({})).await;
    let stored: Option<Value> =
        sqlx::query_scalar("select trace_context from pgflow.runs where run_id = $1")
            .bind(plain)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(stored, None);

    let msgs = read(pool, "obs", 10).await;
    let (flows, steps) = pairs(pool, "obs", None).await;
    let reports: Vec<(Uuid, Option<Value>)> = sqlx::query_as(
        "select run_id, report from pgflow.claim_tasks(queue_name => 'obs', msg_ids => $1, worker_id => $2,
           flow_slugs => $3, step_slugs => $4) where outcome = 'claimed' order by run_id = $5 desc",
    )
    .bind(&msgs)
    .bind(worker)
    .bind(&flows)
    .bind(&steps)
    .bind(run)
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(reports, [(run, Some(ctx)), (plain, None)]);

    // A setting that is not a trace context is refused, and no run starts.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("select set_config('pgflow.trace_context', 'not json', true)")
        .execute(&mut *tx)
        .await
        .unwrap();
    let err = sqlx::query("select pgflow.start_flow('obs', '{}'::jsonb)")
        .execute(&mut *tx)
        .await
        .unwrap_err();
    let db_err = err.as_database_error().unwrap();
    assert_eq!(
        db_err.code().as_deref(),
        Some(SqlState::InvalidParameterValue.code())
    );
    assert!(db_err.message().contains("pgflow.trace_context"), "{err}");
    drop(tx);
    let runs: i64 = sqlx::query_scalar("select count(*) from pgflow.runs")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(runs, 2);
}

#[tokio::test]
async fn queue_stats_reports_depth_visibility_and_the_oldest_message_age() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let empty: Vec<(String, i64, i64, Option<f64>)> =
        sqlx::query_as("select * from pgflow.queue_stats()")
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(empty, [("obs".to_owned(), 0, 0, None)]);
    for _ in 0..3 {
        start(pool, "obs", json!({})).await;
    }
    // One of the three claimed: invisible for its timeout.
    let msgs = read(pool, "obs", 1).await;
    claim_tasks(pool, "obs", "obs", None, &msgs, worker).await;
    exec(pool, "update pgmq.q_obs set enqueued_at = now() - interval '90 seconds' where msg_id = (select min(msg_id) from pgmq.q_obs)").await;
    let (queue, depth, visible, age): (String, i64, i64, Option<f64>) =
        sqlx::query_as("select * from pgflow.queue_stats()")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!((queue.as_str(), depth, visible), ("obs", 3, 2));
    assert!(age.unwrap() >= 90.0, "{age:?}");
}
