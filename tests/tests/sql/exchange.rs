//! One round trip per worker cycle (pgflow.exchange: record outputs, then claim, in one transaction), and the
//! queue signals that wake idle workers without making senders wait for each other.

use std::time::Duration;

use crate::step_support::*;
use crate::support::*;
use pgflow_tests::test_db;
use serde_json::json;
use sqlx::postgres::{PgListener, PgRow};
use sqlx::{Connection, PgConnection, PgPool, Row};
use uuid::Uuid;

/// diamond: a -> (b, c) -> d, compiled as flow `dia` on queue `dia`; returns a worker registered for it.
pub(crate) async fn setup(pool: &PgPool) -> Uuid {
    compile(
        pool,
        "dia",
        &shape(vec![
            step("a", &[]),
            step("b", &["a"]),
            step("c", &["a"]),
            step("d", &["b", "c"]),
        ]),
        "flow",
    )
    .await;
    let worker = Uuid::new_v4();
    register(pool, worker, "dia", "dia", "dia", None).await;
    worker
}

/// One exchange: the completions (run, step, index, attempt, output) and a claim of `qty`.
pub(crate) async fn exchange<'c>(
    executor: impl sqlx::PgExecutor<'c>,
    worker: Uuid,
    done: &[(Uuid, &str, i32, i32, serde_json::Value)],
    qty: i32,
) -> Vec<PgRow> {
    let runs: Vec<Uuid> = done.iter().map(|d| d.0).collect();
    let steps: Vec<&str> = done.iter().map(|d| d.1).collect();
    let indexes: Vec<i32> = done.iter().map(|d| d.2).collect();
    let attempts: Vec<i32> = done.iter().map(|d| d.3).collect();
    let outputs: Vec<&serde_json::Value> = done.iter().map(|d| &d.4).collect();
    sqlx::query(
        "select * from pgflow.exchange(queue_name => 'dia', worker_id => $1,
           flow_slugs => array['dia', 'dia', 'dia', 'dia'], step_slugs => array['a', 'b', 'c', 'd'],
           qty => $2, vt => 30, run_ids => $3, done_step_slugs => $4, task_indexes => $5, outputs => $6,
           attempts => $7)",
    )
    .bind(worker)
    .bind(qty)
    .bind(&runs)
    .bind(&steps)
    .bind(&indexes)
    .bind(&outputs)
    .bind(&attempts)
    .fetch_all(executor)
    .await
    .unwrap()
}

fn outcomes(rows: &[PgRow]) -> Vec<(String, Option<String>)> {
    rows.iter()
        .map(|r| (r.get("outcome"), r.get("step_slug")))
        .collect()
}

#[tokio::test]
async fn an_exchange_records_outputs_and_claims_the_steps_they_made_ready_in_one_call() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let run = start(pool, "dia", json!({})).await;

    let first = exchange(pool, worker, &[], 4).await;
    assert_eq!(outcomes(&first), [("claimed".into(), Some("a".into()))]);

    // Completing `a` makes b and c ready; the same call claims both, no poll in between.
    let second = exchange(pool, worker, &[(run, "a", 0, 1, json!("A"))], 4).await;
    assert_eq!(
        outcomes(&second),
        [
            ("applied".into(), Some("a".into())),
            ("claimed".into(), Some("b".into())),
            ("claimed".into(), Some("c".into()))
        ]
    );
    assert_eq!(
        second[1].get::<serde_json::Value, _>("input"),
        json!({"a": "A"})
    );

    let third = exchange(
        pool,
        worker,
        &[(run, "b", 0, 1, json!("B")), (run, "c", 0, 1, json!("C"))],
        4,
    )
    .await;
    assert_eq!(
        outcomes(&third),
        [
            ("applied".into(), Some("b".into())),
            ("applied".into(), Some("c".into())),
            ("claimed".into(), Some("d".into()))
        ]
    );
    // A stale result in an exchange changes nothing; a result without claiming is fine too.
    let last = exchange(
        pool,
        worker,
        &[
            (run, "b", 0, 1, json!("late")),
            (run, "d", 0, 1, json!("D")),
        ],
        0,
    )
    .await;
    assert_eq!(
        outcomes(&last),
        [
            ("stale".into(), Some("b".into())),
            ("applied".into(), Some("d".into()))
        ]
    );
    assert_eq!(run_status(pool, run).await, "completed");
    assert_eq!(run_output(pool, run).await, Some(json!({"d": "D"})));
}

#[tokio::test]
async fn an_unsupported_claim_in_an_exchange_still_records_the_outputs() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let run = start(pool, "dia", json!({})).await;
    exchange(pool, worker, &[], 1).await;
    exec(pool, "select pgmq.send('dia', '{\"foreign\": true}')").await;
    let rows = exchange(pool, worker, &[(run, "a", 0, 1, json!("A"))], 10).await;
    let got = outcomes(&rows);
    assert_eq!(got[0], ("applied".into(), Some("a".into())));
    assert_eq!(got.last().unwrap().0, "unsupported");
    assert_eq!(step_status(pool, run, "a").await, "completed");
    assert_eq!(task_statuses(pool, run, "b").await, ["queued"]);
}

#[tokio::test]
async fn new_tasks_signal_their_queue_without_making_senders_wait_for_each_other() {
    let db = test_db().await;
    let pool = db.pool();
    setup(pool).await;
    let mut listener = PgListener::connect_with(pool).await.unwrap();
    listener.listen("pgflow_queue_signal").await.unwrap();
    start(pool, "dia", json!({})).await;
    let note = tokio::time::timeout(Duration::from_secs(10), listener.recv())
        .await
        .expect("a queue signal")
        .unwrap();
    assert_eq!(note.payload(), "dia");

    // A transaction that signalled holds the queue's signal row until it commits; another sender skips the
    // signal instead of waiting for it.
    sqlx::query("update pgflow.queue_signals set signaled_at = '-infinity'")
        .execute(pool)
        .await
        .unwrap();
    let mut a = PgConnection::connect_with(&db.options()).await.unwrap();
    sqlx::query("begin").execute(&mut a).await.unwrap();
    sqlx::query("select pgflow.start_flow('dia', '{}')")
        .execute(&mut a)
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), start(pool, "dia", json!({})))
        .await
        .expect("the second sender does not wait for the first");
    sqlx::query("commit").execute(&mut a).await.unwrap();
    assert_eq!(live_messages(pool, "dia").await, 3);
}

#[tokio::test]
async fn an_exchange_creating_tasks_does_not_hold_back_the_signal_of_a_new_run() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    // A second worker of the queue, which the exchange's signal is for.
    register(pool, Uuid::new_v4(), "dia", "dia", "dia", None).await;
    let run = start(pool, "dia", json!({})).await;
    let first = exchange(pool, worker, &[], 4).await;
    assert_eq!(outcomes(&first), [("claimed".into(), Some("a".into()))]);
    sqlx::query("update pgflow.queue_signals set signaled_at = '-infinity'")
        .execute(pool)
        .await
        .unwrap();
    let mut listener = PgListener::connect_with(pool).await.unwrap();
    listener.listen("pgflow_queue_signal").await.unwrap();

    // A worker's exchange records `a`, creating b and c: it signals the queue and, until it commits, holds
    // its signal. The worker that sent it ignores that signal (it claims b and c itself).
    let mut busy = PgConnection::connect_with(&db.options()).await.unwrap();
    sqlx::query("begin").execute(&mut busy).await.unwrap();
    exchange(&mut busy, worker, &[(run, "a", 0, 1, json!("A"))], 0).await;

    // A run started meanwhile still signals, so an idle worker wakes for its first task.
    let mut starter = PgConnection::connect_with(&db.options()).await.unwrap();
    let starter_pid: i32 = sqlx::query_scalar("select pg_backend_pid()")
        .fetch_one(&mut starter)
        .await
        .unwrap();
    sqlx::query("select pgflow.start_flow('dia', '{}')")
        .execute(&mut starter)
        .await
        .unwrap();
    let note = tokio::time::timeout(Duration::from_secs(10), listener.recv())
        .await
        .expect("the new run's queue signal")
        .unwrap();
    assert_eq!(
        (note.payload(), note.process_id() as i32),
        ("dia", starter_pid)
    );

    // The exchange's own signal follows at its commit, throttled apart.
    sqlx::query("commit").execute(&mut busy).await.unwrap();
    let note = tokio::time::timeout(Duration::from_secs(10), listener.recv())
        .await
        .expect("the exchange's queue signal")
        .unwrap();
    assert_eq!(note.payload(), "dia");
    assert_ne!(note.process_id() as i32, starter_pid);
    let sources: Vec<String> = sqlx::query_scalar(
        "select source from pgflow.queue_signals where queue_name = 'dia' and signaled_at > '-infinity' order by source",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(sources, ["exchange", "other"]);
}

/// The first queue signal since the last call, `None` when there was none: everything up to a sentinel sent now.
async fn next_signal(pool: &PgPool, listener: &mut PgListener) -> Option<String> {
    exec(pool, "select pg_notify('pgflow_queue_signal', 'sentinel')").await;
    let mut first = None;
    loop {
        let note = tokio::time::timeout(Duration::from_secs(10), listener.recv())
            .await
            .expect("a notification within 10 s")
            .unwrap();
        if note.payload() == "sentinel" {
            return first;
        }
        first.get_or_insert_with(|| note.payload().to_string());
    }
}

/// Starts a run (its signal checked), claims its `a` and records it in an exchange of `worker`: the signal that
/// exchange sent, if any. Signals are throttled per queue and source, so none is recent before each send.
async fn signal_of_recording_a(
    pool: &PgPool,
    listener: &mut PgListener,
    worker: Uuid,
) -> Option<String> {
    let reset = "update pgflow.queue_signals set signaled_at = '-infinity'";
    exec(pool, reset).await;
    let run = start(pool, "dia", json!({})).await;
    assert_eq!(next_signal(pool, listener).await.as_deref(), Some("dia"));
    // Claims the new run's `a` (and whatever earlier runs left queued).
    let claimed = exchange(pool, worker, &[], 10).await;
    assert!(outcomes(&claimed).contains(&("claimed".into(), Some("a".into()))));
    exec(pool, reset).await;
    let done = exchange(pool, worker, &[(run, "a", 0, 1, json!("A"))], 0).await;
    assert_eq!(outcomes(&done), [("applied".into(), Some("a".into()))]);
    next_signal(pool, listener).await
}

#[tokio::test]
async fn an_exchange_signals_a_queue_only_when_another_live_worker_serves_it() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let mut listener = PgListener::connect_with(pool).await.unwrap();
    listener.listen("pgflow_queue_signal").await.unwrap();

    // Alone on the queue: recording `a` creates b and c and signals nobody (the worker claims them itself).
    assert_eq!(
        signal_of_recording_a(pool, &mut listener, worker).await,
        None
    );

    // A stopped worker, a deprecated one and one whose heartbeat is past the liveness window do not count.
    for (column, value) in [
        ("stopped_at", "now()"),
        ("deprecated_at", "now()"),
        ("last_heartbeat_at", "now() - interval '1 hour'"),
    ] {
        let other = Uuid::new_v4();
        register(pool, other, "dia", "dia", "dia", None).await;
        sqlx::query(&format!(
            "update pgflow.workers set {column} = {value} where worker_id = $1"
        ))
        .bind(other)
        .execute(pool)
        .await
        .unwrap();
    }
    assert_eq!(
        signal_of_recording_a(pool, &mut listener, worker).await,
        None
    );

    // A live second worker on the queue: the exchange's new tasks wake it.
    register(pool, Uuid::new_v4(), "dia", "dia", "dia", None).await;
    assert_eq!(
        signal_of_recording_a(pool, &mut listener, worker)
            .await
            .as_deref(),
        Some("dia")
    );
}
