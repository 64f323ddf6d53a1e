//! Events: pg_notify on the run channel without Supabase, and Realtime's payloads when it exists.

use std::time::Duration;

use crate::support::*;
use pgflow_tests::test_db;
use serde_json::{json, Value};
use sqlx::postgres::PgListener;
use uuid::Uuid;

/// Collects `count` notifications, checking each is a compact payload of `run`.
async fn collect(listener: &mut PgListener, run: Uuid, count: usize) -> Vec<String> {
    let mut events = Vec::new();
    while events.len() < count {
        let note = tokio::time::timeout(Duration::from_secs(10), listener.recv())
            .await
            .expect("an event within 10 s")
            .unwrap();
        let payload: Value = serde_json::from_str(note.payload()).unwrap();
        assert_eq!(payload["run_id"], json!(run.to_string()));
        assert!(
            payload.get("output").is_none(),
            "outputs are not sent through NOTIFY"
        );
        events.push(payload["event"].as_str().unwrap().to_string());
    }
    events
}

#[tokio::test]
async fn run_events_arrive_on_the_run_channel_without_supabase() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('noisy'); select pgflow.add_step('noisy', 'a');",
    )
    .await;
    let run = Uuid::new_v4();
    let channel: String = sqlx::query_scalar("select pgflow.run_channel($1)")
        .bind(run)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(channel, format!("pgflow_run_{}", run.simple()));

    let mut listener = PgListener::connect(db.url()).await.unwrap();
    listener.listen(&channel).await.unwrap();
    // Watched before it exists (the caller chose the run id): run:started is sent too.
    let status: Option<String> = sqlx::query_scalar("select pgflow.watch_run($1)")
        .bind(run)
        .fetch_one(&mut listener)
        .await
        .unwrap();
    assert_eq!(status, None, "no such run yet");
    sqlx::query("select pgflow.start_flow('noisy', '{}', $1)")
        .bind(run)
        .execute(pool)
        .await
        .unwrap();
    claim(pool, "noisy", "noisy", 1).await;
    complete(pool, run, "a", 0, json!({"big": "x".repeat(20_000)})).await;

    assert_eq!(
        collect(&mut listener, run, 2).await,
        ["run:started", "run:completed"]
    );
}

#[tokio::test]
async fn step_events_are_notified_too_when_pgflow_notify_is_all() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('chatty'); select pgflow.add_step('chatty', 'a');",
    )
    .await;
    register_worker(pool).await;
    let run = Uuid::new_v4();
    let channel: String = sqlx::query_scalar("select pgflow.run_channel($1)")
        .bind(run)
        .fetch_one(pool)
        .await
        .unwrap();
    let mut listener = PgListener::connect(db.url()).await.unwrap();
    listener.listen(&channel).await.unwrap();

    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("set pgflow.notify = 'all'")
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query("select pgflow.start_flow('chatty', '{}', $1)")
        .bind(run)
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query("select * from pgflow.start_tasks('chatty', array(select msg_id from pgmq.read('chatty', 30, 1)), $1)")
        .bind(WORKER)
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query("select pgflow.complete_task($1, 'a', 0, '1')")
        .bind(run)
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query("reset pgflow.notify")
        .execute(&mut *conn)
        .await
        .unwrap();

    assert_eq!(
        collect(&mut listener, run, 4).await,
        [
            "run:started",
            "step:a:started",
            "step:a:completed",
            "run:completed"
        ]
    );
}

#[tokio::test]
async fn events_go_to_realtime_send_with_upstream_topics_and_payloads_when_it_exists() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "create schema realtime;
         create table realtime.messages (
           id bigserial primary key, topic text not null, event text, payload jsonb, private boolean,
           inserted_at timestamptz not null default clock_timestamp());
         create function realtime.send(payload jsonb, event text, topic text, private boolean default true)
         returns void language sql as $$
           insert into realtime.messages (topic, event, payload, private) values (topic, event, payload, private)
         $$;
         select pgflow.create_flow('rt', max_attempts => 1);
         select pgflow.add_step('rt', 'a');
         select pgflow.add_step('rt', 'b', array['a']);",
    )
    .await;
    let run = start(pool, "rt", json!({"in": 1})).await;
    claim(pool, "rt", "rt", 1).await;
    complete(pool, run, "a", 0, json!("A")).await;
    claim(pool, "rt", "rt", 1).await;
    fail(pool, run, "b", 0, "nope").await;

    let rows: Vec<(String, String, Value, bool)> =
        sqlx::query_as("select topic, event, payload, private from realtime.messages order by id")
            .fetch_all(pool)
            .await
            .unwrap();
    let topic = format!("pgflow:run:{run}");
    assert!(rows
        .iter()
        .all(|(t, _, _, private)| *t == topic && !private));
    let events: Vec<_> = rows.iter().map(|(_, e, _, _)| e.as_str()).collect();
    assert_eq!(
        events,
        [
            "run:started",
            "step:a:started",
            "step:a:completed",
            "step:b:started",
            "step:b:failed",
            "run:failed"
        ]
    );
    let started = &rows[0].2;
    assert_eq!(started["event_type"], "run:started");
    assert_eq!(started["flow_slug"], "rt");
    assert_eq!(started["input"], json!({"in": 1}));
    assert_eq!(started["remaining_steps"], 2);
    let completed = &rows[2].2;
    assert_eq!(completed["output"], json!("A"));
    assert_eq!(completed["step_slug"], "a");
    let failed = &rows[5].2;
    assert_eq!(failed["error_message"], "nope");
    assert_eq!(failed["status"], "failed");
}

/// Starts a one-step run of `flow` with the given id, claims its task and completes it, on `pool`.
async fn run_one_step(pool: &sqlx::PgPool, flow: &str, run: Uuid) {
    sqlx::query("select pgflow.start_flow($1, '{}', $2)")
        .bind(flow)
        .bind(run)
        .execute(pool)
        .await
        .unwrap();
    claim(pool, flow, flow, 1).await;
    assert_eq!(complete(pool, run, "a", 0, json!(1)).await, "completed");
}

/// The first notification on `channel` since the last call, `None` when there was none: everything up to a
/// sentinel sent now.
async fn first_event_before_sentinel(
    pool: &sqlx::PgPool,
    listener: &mut PgListener,
    channel: &str,
) -> Option<Value> {
    sqlx::query("select pg_notify($1, '{\"event\": \"sentinel\"}')")
        .bind(channel)
        .execute(pool)
        .await
        .unwrap();
    let mut first = None;
    loop {
        let note = tokio::time::timeout(Duration::from_secs(10), listener.recv())
            .await
            .expect("a notification within 10 s")
            .unwrap();
        let payload: Value = serde_json::from_str(note.payload()).unwrap();
        if payload["event"] == "sentinel" {
            return first;
        }
        first.get_or_insert(payload);
    }
}

#[tokio::test]
async fn by_default_a_run_nobody_watches_sends_no_events_and_pgflow_notify_run_restores_them() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('quiet'); select pgflow.add_step('quiet', 'a');",
    )
    .await;
    let unwatched = Uuid::new_v4();
    let channel = format!("pgflow_run_{}", unwatched.simple());
    let mut listener = PgListener::connect(db.url()).await.unwrap();
    listener.listen(&channel).await.unwrap();
    run_one_step(pool, "quiet", unwatched).await;
    assert_eq!(
        first_event_before_sentinel(pool, &mut listener, &channel).await,
        None,
        "listening alone is not watching: no run:started, no run:completed"
    );

    // The old default, every run's run events, is the mode 'run' of the emitting sessions.
    let all = Uuid::new_v4();
    let channel = format!("pgflow_run_{}", all.simple());
    listener.listen(&channel).await.unwrap();
    exec(
        pool,
        &format!(
            "begin; set local pgflow.notify = 'run'; select pgflow.start_flow('quiet', '{{}}', '{all}'); commit;"
        ),
    )
    .await;
    assert_eq!(
        first_event_before_sentinel(pool, &mut listener, &channel)
            .await
            .map(|p| p["event"].clone()),
        Some(json!("run:started"))
    );
}

#[tokio::test]
async fn a_watch_gets_the_events_after_it_until_unwatched() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('seen'); select pgflow.add_step('seen', 'a');
         select pgflow.add_step('seen', 'b', array['a']);",
    )
    .await;
    let run = Uuid::new_v4();
    sqlx::query("select pgflow.start_flow('seen', '{}', $1)")
        .bind(run)
        .execute(pool)
        .await
        .unwrap();
    let channel = format!("pgflow_run_{}", run.simple());
    let mut listener = PgListener::connect(db.url()).await.unwrap();
    listener.listen(&channel).await.unwrap();
    let status: Option<String> = sqlx::query_scalar("select pgflow.watch_run($1)")
        .bind(run)
        .fetch_one(&mut listener)
        .await
        .unwrap();
    assert_eq!(status.as_deref(), Some("started"));
    // Watching twice is one registration.
    sqlx::query("select pgflow.watch_run($1)")
        .bind(run)
        .execute(&mut listener)
        .await
        .unwrap();
    let watchers: i64 =
        sqlx::query_scalar("select count(*) from pgflow.run_watchers where run_id = $1")
            .bind(run)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(watchers, 1);

    // Unwatched again: the run's completion sends nothing.
    sqlx::query("select pgflow.unwatch_run($1)")
        .bind(run)
        .execute(&mut listener)
        .await
        .unwrap();
    claim(pool, "seen", "seen", 1).await;
    complete(pool, run, "a", 0, json!(1)).await;
    claim(pool, "seen", "seen", 1).await;
    complete(pool, run, "b", 0, json!(2)).await;
    assert_eq!(
        first_event_before_sentinel(pool, &mut listener, &channel).await,
        None
    );
}

#[tokio::test]
async fn a_watch_waits_for_a_completion_in_flight_and_reads_its_result() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('race'); select pgflow.add_step('race', 'a');",
    )
    .await;
    let run = Uuid::new_v4();
    sqlx::query("select pgflow.start_flow('race', '{}', $1)")
        .bind(run)
        .execute(pool)
        .await
        .unwrap();
    claim(pool, "race", "race", 1).await;

    // A completion that has checked for watchers (there are none) but not committed yet.
    let mut completing = pool.begin().await.unwrap();
    sqlx::query("select pgflow.complete_task($1, 'a', 0, '1')")
        .bind(run)
        .execute(&mut *completing)
        .await
        .unwrap();
    let mut listener = PgListener::connect(db.url()).await.unwrap();
    listener
        .listen(&format!("pgflow_run_{}", run.simple()))
        .await
        .unwrap();
    let watcher_pid: i32 = sqlx::query_scalar("select pg_backend_pid()")
        .fetch_one(&mut listener)
        .await
        .unwrap();
    let watch = tokio::spawn(async move {
        let status: Option<String> = sqlx::query_scalar("select pgflow.watch_run($1)")
            .bind(run)
            .fetch_one(&mut listener)
            .await
            .unwrap();
        status
    });
    // The watch waits on the run row the completion holds.
    pgflow_tests::wait_until(
        Duration::from_secs(10),
        "watch_run waiting for the completion's run row",
        || async {
            let blocked: bool = sqlx::query_scalar("select cardinality(pg_blocking_pids($1)) > 0")
                .bind(watcher_pid)
                .fetch_one(pool)
                .await
                .unwrap();
            blocked
        },
    )
    .await;
    completing.commit().await.unwrap();
    // So it reads the completed run: a waiter that watches and then reads misses nothing.
    assert_eq!(watch.await.unwrap().as_deref(), Some("completed"));
}

#[tokio::test]
async fn maintenance_removes_the_watches_of_sessions_that_have_ended() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('gone'); select pgflow.add_step('gone', 'a');",
    )
    .await;
    let run = start(pool, "gone", json!({})).await;
    let mut ended = PgListener::connect(db.url()).await.unwrap();
    sqlx::query("select pgflow.watch_run($1)")
        .bind(run)
        .execute(&mut ended)
        .await
        .unwrap();
    let ended_pid: i32 = sqlx::query_scalar("select pg_backend_pid()")
        .fetch_one(&mut ended)
        .await
        .unwrap();
    drop(ended);
    let mut live = pool.acquire().await.unwrap();
    sqlx::query("select pgflow.watch_run($1)")
        .bind(run)
        .execute(&mut *live)
        .await
        .unwrap();
    pgflow_tests::wait_until(
        Duration::from_secs(10),
        "the watching session to end",
        || async {
            let alive: bool =
                sqlx::query_scalar("select exists (select 1 from pg_stat_activity where pid = $1)")
                    .bind(ended_pid)
                    .fetch_one(pool)
                    .await
                    .unwrap();
            !alive
        },
    )
    .await;
    exec(pool, "select pgflow.run_maintenance()").await;
    let pids: Vec<i32> =
        sqlx::query_scalar("select backend_pid from pgflow.run_watchers where run_id = $1")
            .bind(run)
            .fetch_all(pool)
            .await
            .unwrap();
    let live_pid: i32 = sqlx::query_scalar("select pg_backend_pid()")
        .fetch_one(&mut *live)
        .await
        .unwrap();
    assert_eq!(pids, [live_pid]);
}
