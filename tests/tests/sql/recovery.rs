//! Fast recovery from dead workers, bounded retention, and the one-at-a-time maintenance sweep.

use crate::step_support::*;
use crate::support::*;
use pgflow_tests::test_db;
use serde_json::{json, Value};
use sqlx::PgPool;
use uuid::Uuid;

/// A plain flow "rec" with one step "work" whose max_attempts is `attempts`, and a registered worker that
/// has claimed the task of one run.
async fn claimed_run(pool: &PgPool, attempts: i32) -> (Uuid, Uuid, i64) {
    let mut shape = roots(&["work"]);
    shape["options"]["maxAttempts"] = json!(attempts);
    compile(pool, "rec", &shape, "flow").await;
    let worker = Uuid::new_v4();
    register(pool, worker, "rec-worker", "rec", "rec", None).await;
    let run = start(pool, "rec", json!({})).await;
    let msgs = read(pool, "rec", 1).await;
    let claimed = claim_tasks(pool, "rec", "rec", None, &msgs, worker).await;
    assert_eq!(claimed["tasks"][0]["attempts_count"], 1);
    (worker, run, msgs[0])
}

async fn silence(pool: &PgPool, worker: Uuid, seconds: i32) {
    exec(
        pool,
        &format!(
            "update pgflow.workers set last_heartbeat_at = now() - interval '{seconds} seconds'
             where worker_id = '{worker}'"
        ),
    )
    .await;
}

async fn recover(pool: &PgPool, dead_after: &str) -> i32 {
    sqlx::query_scalar("select pgflow.requeue_dead_worker_tasks($1::interval)")
        .bind(dead_after)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_task_of_a_silent_worker_is_requeued_at_once_without_using_an_extra_attempt() {
    let db = test_db().await;
    let pool = db.pool();
    let (worker, run, msg) = claimed_run(pool, 3).await;

    // A worker that beat recently is alive.
    assert_eq!(recover(pool, "10 seconds").await, 0);
    assert_eq!(
        task_state(pool, run, "work", 0).await,
        ("started".into(), 1)
    );

    silence(pool, worker, 11).await;
    assert_eq!(recover(pool, "10 seconds").await, 1);
    assert_eq!(task_state(pool, run, "work", 0).await, ("queued".into(), 1));
    assert!(seconds_until_visible(pool, "rec", msg).await <= 0.0);
    let stopped: bool = sqlx::query_scalar(
        "select stopped_at is not null from pgflow.workers where worker_id = $1",
    )
    .bind(worker)
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(stopped, "the silent worker is marked stopped");

    // The next claim counts the second attempt; the dead worker's late result is fenced.
    let other = Uuid::new_v4();
    register(pool, other, "rec-worker", "rec", "rec", None).await;
    let msgs = read(pool, "rec", 1).await;
    let claimed = claim_tasks(pool, "rec", "rec", None, &msgs, other).await;
    assert_eq!(claimed["tasks"][0]["attempts_count"], 2);
    let late: String = sqlx::query_scalar(
        "select outcome from pgflow.complete_task($1, 'work', 0, '1'::jsonb, attempt => 1, worker_id => $2)",
    )
    .bind(run)
    .bind(worker)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(late, "stale");

    // The slow worker comes back: its heartbeat registers it again.
    let beat: Value = sqlx::query_scalar("select pgflow.worker_heartbeat($1)")
        .bind(worker)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(beat["revived"], true);
    assert_eq!(beat["deprecated"], false);
}

#[tokio::test]
async fn the_last_attempt_of_a_dead_worker_fails_the_task_instead_of_running_it_again() {
    let db = test_db().await;
    let pool = db.pool();
    let (worker, run, _) = claimed_run(pool, 1).await;
    silence(pool, worker, 60).await;
    assert_eq!(recover(pool, "10 seconds").await, 1);
    assert_eq!(task_state(pool, run, "work", 0).await, ("failed".into(), 1));
    assert_eq!(run_status(pool, run).await, "failed");
    let message: String = sqlx::query_scalar(
        "select error_message from pgflow.step_states where run_id = $1 and step_slug = 'work'",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        message,
        format!("worker {worker} stopped responding during the last attempt (1 of 1)")
    );
}

#[tokio::test]
async fn retention_prunes_finished_history_in_bounded_batches() {
    let db = test_db().await;
    let pool = db.pool();
    compile(pool, "ret", &roots(&["a"]), "flow").await;
    let mut finished = Vec::new();
    for _ in 0..5 {
        let run = start(pool, "ret", json!({})).await;
        let tasks = claim(pool, "ret", "ret", 1).await;
        complete(pool, run, &tasks[0].step_slug, 0, json!(1)).await;
        finished.push(run);
    }
    let running = start(pool, "ret", json!({})).await;
    exec(
        pool,
        "update pgflow.runs set started_at = now() - interval '10 days',
                completed_at = now() - interval '9 days' where status = 'completed';
         update pgflow.runs set started_at = now() - interval '10 days' where status = 'started';
         update pgmq.a_ret set archived_at = now() - interval '9 days';
         insert into pgflow.workers (worker_id, queue_name, function_name, started_at, last_heartbeat_at, stopped_at)
         select gen_random_uuid(), 'ret', 'old', now() - interval '9 days', now() - interval '9 days',
                now() - interval '9 days' from generate_series(1, 3);",
    )
    .await;

    let prune = |batch: i32| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, Value>("select pgflow.prune_history(interval '7 days', $1)")
                .bind(batch)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    assert_eq!(
        prune(2).await,
        json!({"runs": 2, "archived_messages": 3, "workers": 2, "events": 0})
    );
    assert_eq!(
        prune(2).await,
        json!({"runs": 2, "archived_messages": 0, "workers": 1, "events": 0})
    );
    assert_eq!(
        prune(2).await,
        json!({"runs": 1, "archived_messages": 0, "workers": 0, "events": 0})
    );
    assert_eq!(
        prune(2).await,
        json!({"runs": 0, "archived_messages": 0, "workers": 0, "events": 0})
    );
    let left: Vec<Uuid> = sqlx::query_scalar("select run_id from pgflow.runs")
        .fetch_all(pool)
        .await
        .unwrap();
    assert_eq!(left, [running], "started runs are never pruned");
    let tasks: i64 =
        sqlx::query_scalar("select count(*) from pgflow.step_tasks where run_id <> $1")
            .bind(running)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(tasks, 0);
    assert_eq!(archived_messages(pool, "ret").await, 0);
}

#[tokio::test]
async fn one_maintenance_sweep_runs_at_a_time() {
    let db = test_db().await;
    let pool = db.pool();
    let mut holder = pool.begin().await.unwrap();
    let first: Value = sqlx::query_scalar(
        "select pgflow.run_maintenance(interval '10 seconds', interval '7 days')",
    )
    .fetch_one(&mut *holder)
    .await
    .unwrap();
    assert_eq!(first["skipped"], false);
    let second: Value = sqlx::query_scalar(
        "select pgflow.run_maintenance(interval '10 seconds', interval '7 days')",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(second["skipped"], true);
    holder.commit().await.unwrap();
    let third: Value = sqlx::query_scalar("select pgflow.run_maintenance()")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(
        third,
        json!({"skipped": false, "stalled": 0, "dead": 0, "pruned": null})
    );
}

#[tokio::test]
async fn a_map_task_receives_its_own_element_from_a_large_array() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('big'); select pgflow.add_step('big', 'each', step_type => 'map');",
    )
    .await;
    let input: Vec<Value> = (0..20_000)
        .map(|i| json!({"i": i, "pad": "x".repeat(16)}))
        .collect();
    let run = start(pool, "big", Value::Array(input)).await;
    let elements: i64 = sqlx::query_scalar(
        "select count(*) from pgflow.step_tasks where run_id = $1 and element is not null",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(elements, 20_000);
    exec(
        pool,
        "update pgmq.q_big set vt = now() + interval '1 hour' where msg_id not in (1, 12345)",
    )
    .await;
    let tasks = claim(pool, "big", "big", 10).await;
    let got: Vec<(i32, Value)> = tasks
        .iter()
        .map(|t| (t.task_index, t.input.clone().unwrap()))
        .collect();
    assert_eq!(
        got,
        [
            (0, json!({"i": 0, "pad": "x".repeat(16)})),
            (12344, json!({"i": 12344, "pad": "x".repeat(16)})),
        ]
    );
}

#[tokio::test]
async fn a_heartbeat_counts_the_live_workers_of_its_queue() {
    let db = test_db().await;
    let pool = db.pool();
    // (queue, stopped, deprecated, seconds since the last heartbeat): only the first two are live peers.
    let workers = [
        ("peers", false, false, 0),
        ("peers", false, false, 5),
        ("peers", true, false, 0),
        ("peers", false, true, 0),
        ("peers", false, false, 60),
        ("elsewhere", false, false, 0),
    ];
    let mut ids = Vec::new();
    for (queue, stopped, deprecated, silent) in workers {
        let id = Uuid::new_v4();
        sqlx::query(
            "insert into pgflow.workers (worker_id, queue_name, function_name, last_heartbeat_at, stopped_at, deprecated_at)
             values ($1, $2, 'peers-test', now() - make_interval(secs => $3),
                     case when $4 then now() end, case when $5 then now() end)",
        )
        .bind(id)
        .bind(queue)
        .bind(f64::from(silent))
        .bind(stopped)
        .bind(deprecated)
        .execute(pool)
        .await
        .unwrap();
        ids.push(id);
    }
    let peers = |id: Uuid| async move {
        let beat: Value = sqlx::query_scalar("select pgflow.worker_heartbeat($1)")
            .bind(id)
            .fetch_one(pool)
            .await
            .unwrap();
        beat["peers"].as_i64().unwrap()
    };
    assert_eq!(peers(ids[0]).await, 2, "itself and the other live worker");
    assert_eq!(peers(ids[5]).await, 1, "alone on its queue");
    // A stopped worker's beat revives it (it is alive after all): one more peer.
    assert_eq!(peers(ids[2]).await, 3);
    // A deprecated worker is draining: it does not count, itself included.
    assert_eq!(peers(ids[3]).await, 3);
    // A silent worker that beats again is live again.
    assert_eq!(peers(ids[4]).await, 4);
}
