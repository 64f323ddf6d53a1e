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
