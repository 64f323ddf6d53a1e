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
    exchange_for(executor, worker, &["a", "b", "c", "d"], done, qty).await
}

/// [`exchange`] by a worker that runs only the steps `serves` of flow `dia`.
async fn exchange_for<'c>(
    executor: impl sqlx::PgExecutor<'c>,
    worker: Uuid,
    serves: &[&str],
    done: &[(Uuid, &str, i32, i32, serde_json::Value)],
    qty: i32,
) -> Vec<PgRow> {
    let flows = vec!["dia"; serves.len()];
    let runs: Vec<Uuid> = done.iter().map(|d| d.0).collect();
    let steps: Vec<&str> = done.iter().map(|d| d.1).collect();
    let indexes: Vec<i32> = done.iter().map(|d| d.2).collect();
    let attempts: Vec<i32> = done.iter().map(|d| d.3).collect();
    let outputs: Vec<&serde_json::Value> = done.iter().map(|d| &d.4).collect();
    sqlx::query(
        "select * from pgflow.exchange(queue_name => 'dia', worker_id => $1, flow_slugs => $8,
           step_slugs => $9, qty => $2, vt => 30, run_ids => $3, done_step_slugs => $4, task_indexes => $5,
           outputs => $6, attempts => $7)",
    )
    .bind(worker)
    .bind(qty)
    .bind(&runs)
    .bind(&steps)
    .bind(&indexes)
    .bind(&outputs)
    .bind(&attempts)
    .bind(&flows)
    .bind(serves)
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
    // b and c were created claimed for the worker (the foreign message left one slot to the read); a worker
    // stopping on the report hands them back, as any task it claimed ahead.
    assert_eq!(task_statuses(pool, run, "b").await, ["started"]);
    let released: i32 = sqlx::query_scalar("select pgflow.release_worker_tasks($1)")
        .bind(worker)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(released, 2);
    assert_eq!(task_statuses(pool, run, "b").await, ["queued"]);
    assert_eq!(task_statuses(pool, run, "c").await, ["queued"]);
    assert_eq!(live_messages(pool, "dia").await, 3);
    assert_eq!(visible_messages(pool, "dia").await, 3);
}

/// Messages of `queue` visible now.
async fn visible_messages(pool: &PgPool, queue: &str) -> i64 {
    sqlx::query_scalar(&format!(
        "select count(*) from pgmq.q_{queue} where vt <= clock_timestamp()"
    ))
    .fetch_one(pool)
    .await
    .unwrap()
}

/// This session's counts of rows updated in `pgflow.step_tasks` and in queue `dia`'s table, and of calls of
/// `pgflow.read_and_claim_tasks` (counted only with `track_functions` on). PostgreSQL keeps them in the session
/// until it reports them, at most once a second and never inside a transaction, so they can include earlier
/// transactions' counts: a test takes the difference over its own transaction ([`since`]).
async fn counts(conn: &mut PgConnection) -> [i64; 3] {
    let (tasks, messages, reads): (i64, i64, i64) = sqlx::query_as(
        "select coalesce((select n_tup_upd from pg_stat_xact_user_tables
                          where schemaname = 'pgflow' and relname = 'step_tasks'), 0),
                coalesce((select n_tup_upd from pg_stat_xact_user_tables
                          where schemaname = 'pgmq' and relname = 'q_dia'), 0),
                coalesce((select sum(calls) from pg_stat_xact_user_functions
                          where schemaname = 'pgflow' and funcname = 'read_and_claim_tasks'), 0)::bigint",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    [tasks, messages, reads]
}

/// The [`counts`] added between `before` and `after`: task updates, message updates, reads.
fn since(before: [i64; 3], after: [i64; 3]) -> [i64; 3] {
    [0, 1, 2].map(|i| after[i] - before[i])
}

#[tokio::test]
async fn an_exchange_creates_the_dependents_its_worker_takes_already_claimed() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let run = start(pool, "dia", json!({})).await;
    exchange(pool, worker, &[], 1).await;

    let mut conn = pool.acquire().await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    let before = counts(&mut tx).await;
    let rows = exchange(&mut *tx, worker, &[(run, "a", 0, 1, json!("A"))], 4).await;
    // a's completion is the only task update; b and c were never queued, read, updated or made invisible.
    let [tasks, messages, _] = since(before, counts(&mut tx).await);
    assert_eq!((tasks, messages), (1, 0));
    tx.commit().await.unwrap();
    assert_eq!(
        outcomes(&rows),
        [
            ("applied".into(), Some("a".into())),
            ("claimed".into(), Some("b".into())),
            ("claimed".into(), Some("c".into()))
        ]
    );
    assert_eq!(
        rows[1].get::<serde_json::Value, _>("input"),
        json!({"a": "A"})
    );
    assert_eq!(rows[1].get::<i32, _>("attempts_count"), 1);
    assert_eq!(rows[1].get::<i32, _>("timeout"), 30);

    // As a claim leaves them: started by this worker at attempt 1, the messages read once and hidden for
    // the step timeout plus the claim buffer.
    for step in ["b", "c"] {
        let (status, attempts, last_worker, read_ct, read_stamped, hidden_for): (
            String,
            i32,
            Uuid,
            i32,
            bool,
            f64,
        ) = sqlx::query_as(
            "select t.status, t.attempts_count, t.last_worker_id, q.read_ct, q.last_read_at is not null,
                    extract(epoch from q.vt - clock_timestamp())::float8
             from pgflow.step_tasks t join pgmq.q_dia q on q.msg_id = t.message_id
             where t.run_id = $1 and t.step_slug = $2",
        )
        .bind(run)
        .bind(step)
        .fetch_one(pool)
        .await
        .unwrap();
        assert_eq!(
            (
                status.as_str(),
                attempts,
                last_worker,
                read_ct,
                read_stamped
            ),
            ("started", 1, worker, 1, true)
        );
        let buffer: f64 =
            sqlx::query_scalar("select pgflow._claim_visibility_buffer_seconds()::float8")
                .fetch_one(pool)
                .await
                .unwrap();
        assert!(
            hidden_for > 30.0 + buffer - 10.0 && hidden_for <= 30.0 + buffer,
            "{step} hidden for {hidden_for} s"
        );
    }
    // Their results are fenced to that attempt like any other claim's.
    let done = exchange(
        pool,
        worker,
        &[(run, "b", 0, 1, json!("B")), (run, "c", 0, 1, json!("C"))],
        4,
    )
    .await;
    assert_eq!(
        outcomes(&done),
        [
            ("applied".into(), Some("b".into())),
            ("applied".into(), Some("c".into())),
            ("claimed".into(), Some("d".into()))
        ]
    );
    assert_eq!(
        done[2].get::<serde_json::Value, _>("input"),
        json!({"b": "B", "c": "C"})
    );
}

#[tokio::test]
async fn an_exchange_leaves_its_queues_older_visible_messages_to_its_read() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let first = start(pool, "dia", json!({})).await;
    exchange(pool, worker, &[], 1).await;
    let second = start(pool, "dia", json!({})).await;

    // Two free slots: the older visible message (the second run's a) takes one, b the other; c waits
    // in the queue, as a read after the completion would have left it.
    let rows = exchange(pool, worker, &[(first, "a", 0, 1, json!("A"))], 2).await;
    let mut claimed: Vec<(Uuid, String)> = rows
        .iter()
        .filter(|r| r.get::<String, _>("outcome") == "claimed")
        .map(|r| (r.get("run_id"), r.get("step_slug")))
        .collect();
    claimed.sort();
    let mut expected = vec![(first, "b".to_string()), (second, "a".to_string())];
    expected.sort();
    assert_eq!(claimed, expected);
    assert_eq!(task_statuses(pool, first, "c").await, ["queued"]);
    assert_eq!(visible_messages(pool, "dia").await, 1);

    // No free slot: nothing is created claimed.
    let rows = exchange(pool, worker, &[(second, "a", 0, 1, json!("A"))], 0).await;
    assert_eq!(outcomes(&rows), [("applied".into(), Some("a".into()))]);
    assert_eq!(task_statuses(pool, second, "b").await, ["queued"]);
    assert_eq!(task_statuses(pool, second, "c").await, ["queued"]);
}

#[tokio::test]
async fn the_read_after_claims_at_creation_runs_only_when_it_can_find_something() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let first = start(pool, "dia", json!({})).await;
    exchange(pool, worker, &[], 1).await;

    let all = ["a", "b", "c", "d"];

    // Nothing else is on the queue: b and c are created claimed, and the two other free slots read nothing.
    let (got, _, reads) = record_a(pool, worker, &all, first).await;
    assert_eq!(
        got,
        [
            ("applied".into(), Some("a".into())),
            ("claimed".into(), Some("b".into())),
            ("claimed".into(), Some("c".into()))
        ]
    );
    assert_eq!(reads, 0, "no read when the queue had nothing visible");

    // An older visible message: the read runs, and takes it.
    let second = start(pool, "dia", json!({})).await;
    exchange(pool, worker, &[], 1).await;
    let third = start(pool, "dia", json!({})).await;
    let (got, _, reads) = record_a(pool, worker, &all, second).await;
    assert_eq!(reads, 1, "the read takes the older visible message");
    assert!(
        got.contains(&("claimed".into(), Some("a".into()))),
        "{got:?}"
    );
    assert_eq!(task_statuses(pool, third, "a").await, ["started"]);

    // A task created queued on the queue (c, which this worker does not run): the read runs and reports it.
    let partial = worker_of(pool, &WITHOUT_C).await;
    let fourth = start(pool, "dia", json!({})).await;
    exchange_for(pool, partial, &WITHOUT_C, &[], 1).await;
    let (got, _, reads) = record_a(pool, partial, &WITHOUT_C, fourth).await;
    assert_eq!(reads, 1, "the read looks at the task created queued");
    assert_eq!(got.last().unwrap().0, "unsupported", "{got:?}");
}

/// The steps of a worker of flow `dia` that does not run c.
const WITHOUT_C: [&str; 3] = ["a", "b", "d"];

/// Registers a worker of `dia`'s function, on its queue, that runs only `steps` of it.
async fn worker_of(pool: &PgPool, steps: &[&str]) -> Uuid {
    let worker = Uuid::new_v4();
    let flows = vec!["dia"; steps.len()];
    sqlx::query(
        "select pgflow.register_worker(worker_id => $1, function_name => 'dia', queue_name => 'dia',
           flow_slugs => $2, step_slugs => $3)",
    )
    .bind(worker)
    .bind(&flows)
    .bind(steps)
    .execute(pool)
    .await
    .unwrap();
    worker
}

/// Records run `run`'s `a` through one exchange with 4 free slots by a worker of `steps`, and returns the
/// outcomes, how many task and message rows the transaction updated, and how many reads it made.
async fn record_a(
    pool: &PgPool,
    worker: Uuid,
    steps: &[&str],
    run: Uuid,
) -> (Vec<(String, Option<String>)>, (i64, i64), i64) {
    let mut conn = pool.acquire().await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    sqlx::query("set local track_functions = 'pl'")
        .execute(&mut *tx)
        .await
        .unwrap();
    let before = counts(&mut tx).await;
    let rows = exchange_for(&mut *tx, worker, steps, &[(run, "a", 0, 1, json!("A"))], 4).await;
    let [tasks, messages, reads] = since(before, counts(&mut tx).await);
    tx.commit().await.unwrap();
    (outcomes(&rows), (tasks, messages), reads)
}

#[tokio::test]
async fn flow_control_priorities_start_delays_and_the_fence_keep_their_claims() {
    // Each of these decides more than queue order, so b and c are queued and claimed by the read (which
    // updates their tasks and messages) or not claimed at all.
    for case in ["limit", "priority", "delay", "disabled", "pairs"] {
        let db = test_db().await;
        let pool = db.pool();
        let mut worker = setup(pool).await;
        let mut steps = vec!["a", "b", "c", "d"];
        if case == "pairs" {
            // A worker of the same function that runs only a, b and d from the queue.
            steps = WITHOUT_C.to_vec();
            worker = worker_of(pool, &steps).await;
        }
        let run = start(pool, "dia", json!({})).await;
        exchange_for(pool, worker, &steps, &[], 1).await;
        let change = match case {
            "limit" => "select pgflow.set_queue_limit('dia', 10)",
            "priority" => "select pgflow.set_queue_priority('dia', interval '1 minute')",
            "delay" => "update pgflow.steps set opt_start_delay = 1 where step_slug = 'c'",
            "disabled" => "select pgflow.disable_worker_function('dia', 'deploy')",
            _ => "select 1",
        };
        exec(pool, change).await;
        let (got, updates, _) = record_a(pool, worker, &steps, run).await;
        let claimed = |steps: &[&str]| -> Vec<(String, Option<String>)> {
            std::iter::once(("applied".to_string(), Some("a".to_string())))
                .chain(
                    steps
                        .iter()
                        .map(|s| ("claimed".to_string(), Some(s.to_string()))),
                )
                .collect()
        };
        match case {
            "limit" | "priority" => {
                assert_eq!(got, claimed(&["b", "c"]), "{case}");
                // At least a's completion and the read's claim of b and c.
                assert!(updates.0 >= 3 && updates.1 >= 2, "{case}: {updates:?}");
            }
            // b is created claimed; c waits for its delay, then for a claim.
            "delay" => {
                assert_eq!(got, claimed(&["b"]), "{case}");
                assert_eq!(task_statuses(pool, run, "c").await, ["queued"], "{case}");
            }
            "disabled" => {
                assert_eq!(got[0], ("applied".into(), Some("a".into())), "{case}");
                assert_eq!(got[1].0, "disabled", "{case}");
                assert_eq!(task_statuses(pool, run, "b").await, ["queued"], "{case}");
            }
            _ => {
                // b is this worker's; c is not, and the read reports it.
                assert_eq!(got[..2], claimed(&["b"])[..], "{case}");
                assert_eq!(got.last().unwrap().0, "unsupported", "{case}");
                assert_eq!(task_statuses(pool, run, "c").await, ["queued"], "{case}");
            }
        }
    }
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
