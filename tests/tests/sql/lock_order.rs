//! The one lock order (run, message, task): a claim holding messages it read and a transaction that archives
//! or moves messages of the same tasks never deadlock, and no update is lost.

use std::time::Duration;

use crate::step_support::*;
use crate::support::*;
use pgflow_tests::{test_db, wait_until};
use serde_json::json;
use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

/// A plain flow "lk" whose root map has max_attempts 1, so one failure exhausts it and fails the run.
async fn setup(pool: &PgPool) -> Uuid {
    let mut shape = shape(vec![json!({
        "slug": "each", "stepType": "map", "dependencies": [],
        "whenUnmet": "skip", "whenExhausted": "fail",
        "requiredInputPattern": {"defined": false}, "forbiddenInputPattern": {"defined": false},
        "options": {"maxAttempts": 1}
    })]);
    shape["options"]["maxAttempts"] = json!(1);
    compile(pool, "lk", &shape, "flow").await;
    let worker = Uuid::new_v4();
    register(pool, worker, "lk-worker", "lk", "lk", None).await;
    worker
}

/// Waits until some other session of this database waits for a lock while running `what`.
async fn wait_for_lock_wait(pool: &PgPool, what: &str) {
    let like = format!("%{what}%");
    wait_until(Duration::from_secs(10), "a session waiting on a lock", || {
        let like = like.clone();
        async move {
            sqlx::query_scalar::<_, bool>(
                "select exists (select 1 from pg_stat_activity
                 where datname = current_database() and wait_event_type = 'Lock' and query like $1)",
            )
            .bind(like)
            .fetch_one(pool)
            .await
            .unwrap()
        }
    })
    .await;
}

async fn connect(db: &pgflow_tests::TestDb) -> PgConnection {
    PgConnection::connect_with(&db.options()).await.unwrap()
}

#[tokio::test]
async fn a_claim_holding_a_read_message_and_a_failure_cancelling_its_task_do_not_deadlock() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let run = start(pool, "lk", json!([1, 2, 3])).await;
    // Element 0 is claimed and running.
    let first = read(pool, "lk", 1).await;
    let claimed = claim_tasks(pool, "lk", "lk", None, &first, worker).await;
    assert_eq!(claimed["tasks"][0]["task_index"], 0);

    // Session B reads element 1's message in an open transaction.
    let mut b = connect(&db).await;
    sqlx::query("begin").execute(&mut b).await.unwrap();
    let sibling: Vec<i64> = sqlx::query_scalar("select msg_id from pgmq.read('lk', 30, 1)")
        .fetch_all(&mut b)
        .await
        .unwrap();
    assert_eq!(sibling.len(), 1);

    // Session A: element 0's failure exhausts the step, fails the run and cancels the queued siblings;
    // it waits for B's message.
    let a_pool = pool.clone();
    let a = tokio::spawn(async move {
        sqlx::query_scalar::<_, String>(
            "select status from pgflow.fail_task($1, 'each', 0, 'boom') /* session A */",
        )
        .bind(run)
        .fetch_one(&a_pool)
        .await
    });
    wait_for_lock_wait(pool, "session A").await;

    // Session B claims the sibling it read: no deadlock (40P01), it finishes at once.
    let result = claim_json(
        tokio::time::timeout(
            Duration::from_secs(10),
            sqlx::query(
                "select * from pgflow.claim_tasks(queue_name => 'lk', msg_ids => $1, worker_id => $2,
                   flow_slugs => array['lk'], step_slugs => array['each'])",
            )
            .bind(&sibling)
            .bind(worker)
            .fetch_all(&mut b),
        )
        .await
        .expect("the claim must not wait for session A")
        .expect("the claim must not fail (no deadlock)"),
    );
    assert_eq!(result["outcome"], "claimed", "{result}");
    sqlx::query("commit").execute(&mut b).await.unwrap();

    let status = a
        .await
        .unwrap()
        .expect("session A must not fail (no deadlock)");
    assert_eq!(status, "failed");

    // Nothing lost: the run failed, every sibling (the one B claimed included) is cancelled and its message
    // archived, and no message of the run is left in the queue.
    assert_eq!(run_status(pool, run).await, "failed");
    assert_eq!(
        task_statuses(pool, run, "each").await,
        ["failed", "cancelled", "cancelled"]
    );
    assert_eq!(live_messages(pool, "lk").await, 0);
}

#[tokio::test]
async fn a_claim_holding_a_read_message_and_a_completion_of_that_task_do_not_deadlock() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let run = start(pool, "lk", json!([1])).await;
    let msgs = read(pool, "lk", 1).await;
    claim_tasks(pool, "lk", "lk", None, &msgs, worker).await;
    // The claim's visibility runs out while the handler still works: session B reads the message again.
    make_visible(pool, "lk").await;
    let mut b = connect(&db).await;
    sqlx::query("begin").execute(&mut b).await.unwrap();
    let again: Vec<i64> = sqlx::query_scalar("select msg_id from pgmq.read('lk', 30, 1)")
        .fetch_all(&mut b)
        .await
        .unwrap();
    assert_eq!(again, msgs);

    // Session A records the handler's output and waits for B's message.
    let a_pool = pool.clone();
    let a = tokio::spawn(async move {
        sqlx::query_scalar::<_, String>(
            "select status from pgflow.complete_task($1, 'each', 0, '\"ok\"'::jsonb) /* session A */",
        )
        .bind(run)
        .fetch_one(&a_pool)
        .await
    });
    wait_for_lock_wait(pool, "session A").await;

    let result = claim_json(
        tokio::time::timeout(
            Duration::from_secs(10),
            sqlx::query(
                "select * from pgflow.claim_tasks(queue_name => 'lk', msg_ids => $1, worker_id => $2,
                   flow_slugs => array['lk'], step_slugs => array['each'])",
            )
            .bind(&again)
            .bind(worker)
            .fetch_all(&mut b),
        )
        .await
        .expect("the claim must not wait for session A")
        .expect("the claim must not fail (no deadlock)"),
    );
    // The task is still started: the duplicate is deferred, no attempt used.
    assert_eq!(result["outcome"], "claimed");
    assert_eq!(result["deferred"], json!(again));
    sqlx::query("commit").execute(&mut b).await.unwrap();

    assert_eq!(a.await.unwrap().unwrap(), "completed");
    assert_eq!(run_status(pool, run).await, "completed");
    assert_eq!(
        task_state(pool, run, "each", 0).await,
        ("completed".into(), 1)
    );
    assert_eq!(live_messages(pool, "lk").await, 0);
}
