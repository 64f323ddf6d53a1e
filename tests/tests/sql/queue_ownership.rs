//! Queue lifecycle under stress: a dropped private queue that startup verification recreates keeps working,
//! and two concurrent compilations can never end up sharing one generated queue.

use std::time::Duration;

use crate::step_support::*;
use crate::support::*;
use pgflow_sql::SqlState;
use pgflow_tests::{test_db, wait_until};
use serde_json::json;
use sqlx::{Connection, PgConnection};

#[tokio::test]
async fn a_recreated_step_queue_continues_after_the_message_ids_of_past_tasks() {
    let db = test_db().await;
    let pool = db.pool();
    let shape = shape(vec![step("only", &[])]);
    compile(pool, "recr", &shape, "step").await;
    for _ in 0..3 {
        start(pool, "recr", json!({})).await;
    }
    let before: i64 = sqlx::query_scalar(
        "select max(message_id) from pgflow.step_tasks where queue_name = 'recr__only'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(before, 3);

    exec(pool, "select pgmq.drop_queue('recr__only')").await;
    assert_eq!(compile(pool, "recr", &shape, "step").await, "verified");
    assert_eq!(pgmq_queues(pool).await, ["recr__only"]);

    // Every new run starts; its message id continues after the recorded ones.
    let run = start(pool, "recr", json!({})).await;
    let msg = task_msg(pool, run, "only").await;
    assert!(msg > before, "new message id {msg} must be above {before}");
    start(pool, "recr", json!({})).await;
}

#[tokio::test]
async fn concurrent_compiles_of_two_flows_cannot_share_a_generated_queue() {
    let db = test_db().await;
    let pool = db.pool();
    // Flow "x" step "y__z" and flow "x__y" step "z" both resolve to the queue "x__y__z".
    let x = shape(vec![step("y__z", &[])]);
    let xy = shape(vec![step("z", &[])]);

    let mut a = PgConnection::connect_with(&db.options()).await.unwrap();
    sqlx::query("begin").execute(&mut a).await.unwrap();
    let compiled: serde_json::Value = sqlx::query_scalar(
        "select pgflow.ensure_flow_compiled(flow_slug => 'x', shape => $1, queue_mode => 'step')",
    )
    .bind(&x)
    .fetch_one(&mut a)
    .await
    .unwrap();
    assert_eq!(compiled["status"], "compiled");

    // The second compilation waits for the queue name instead of passing the ownership check alongside.
    let b_pool = pool.clone();
    let b = tokio::spawn(async move {
        sqlx::query_scalar::<_, serde_json::Value>(
            "select pgflow.ensure_flow_compiled(flow_slug => 'x__y', shape => $1, queue_mode => 'step') /* second compile */",
        )
        .bind(&xy)
        .fetch_one(&b_pool)
        .await
    });
    wait_until(
        Duration::from_secs(10),
        "the second compile to wait",
        || async {
            sqlx::query_scalar::<_, bool>(
                "select exists (select 1 from pg_stat_activity where datname = current_database()
               and wait_event_type = 'Lock' and query like '%second compile%')",
            )
            .fetch_one(pool)
            .await
            .unwrap()
        },
    )
    .await;
    sqlx::query("commit").execute(&mut a).await.unwrap();

    let e = db_error(b.await.unwrap().unwrap_err());
    assert_eq!(e.code, SqlState::QueueNotPrivate, "{e:?}");
    assert_eq!(
        e.message,
        "Queue \"x__y__z\" for step \"z\" of flow \"x__y\" is already used by another flow."
    );
    assert_eq!(routes(pool, "x").await, [("y__z".into(), "x__y__z".into())]);
    assert!(routes(pool, "x__y").await.is_empty());
}
