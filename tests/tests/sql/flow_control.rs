//! Flow control in the claim: concurrency limits per queue and per key, a rate limit per queue. Held tasks are
//! not claimed, spend no attempt and stay hidden until a slot frees; other keys are not blocked.

use pgflow_sql::SqlState;
use pgflow_tests::test_db;
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use crate::support::*;

/// Claims with read_and_claim_tasks (the pgflow-rs worker's claim) and returns the claimed (run, msg) pairs.
async fn read_and_claim(pool: &PgPool, qty: i32) -> Vec<(Uuid, i64)> {
    register_worker(pool).await;
    sqlx::query_as(
        "select run_id, msg_id from pgflow.read_and_claim_tasks('limited', $1, 30, $2, array['limited'], array['work'])
         where outcome = 'claimed'",
    )
    .bind(qty)
    .bind(WORKER)
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn flow(pool: &PgPool) {
    exec(
        pool,
        "select pgflow.create_flow('limited'); select pgflow.add_step('limited', 'work');",
    )
    .await;
}

async fn start_tenants(pool: &PgPool, tenants: &[&str]) -> Vec<Uuid> {
    let inputs: Vec<serde_json::Value> = tenants.iter().map(|t| json!({"tenant": t})).collect();
    sqlx::query_scalar("select run_id from pgflow.start_flows('limited', $1)")
        .bind(&inputs)
        .fetch_all(pool)
        .await
        .unwrap()
}

async fn started(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "select count(*) from pgflow.step_tasks where flow_slug = 'limited' and status = 'started'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn attempts(pool: &PgPool) -> i64 {
    sqlx::query_scalar("select coalesce(sum(attempts_count), 0)::bigint from pgflow.step_tasks where flow_slug = 'limited'")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn bad_limits_get_a_clear_error_and_create_nothing() {
    let db = test_db().await;
    let pool = db.pool();
    flow(pool).await;
    for (sql, code, text) in [
        (
            "select pgflow.set_queue_limit('limited', 0)",
            SqlState::InvalidParameterValue,
            "max_started must be at least 1, got 0",
        ),
        (
            "select pgflow.set_queue_limit('limited', rate_limit => -5, rate_period => '1 minute')",
            SqlState::InvalidParameterValue,
            "rate_limit must be at least 1 start per period, got -5",
        ),
        (
            "select pgflow.set_queue_limit('limited', rate_limit => 5, rate_period => '-1 minute')",
            SqlState::InvalidParameterValue,
            "a positive rate_period",
        ),
        (
            "select pgflow.set_queue_limit('limited', rate_limit => 5)",
            SqlState::InvalidParameterValue,
            "a rate needs both",
        ),
        (
            "select pgflow.set_queue_limit('nosuchqueue', 3)",
            SqlState::UndefinedObject,
            "queue \"nosuchqueue\" is not a queue pgflow routes tasks to",
        ),
        (
            "select pgflow.set_key_limit('limited', 'nope', '{tenant}', 2)",
            SqlState::UndefinedObject,
            "flow \"limited\" has no step \"nope\"",
        ),
        (
            "select pgflow.set_key_limit('limited', 'work', '{tenant}', 0)",
            SqlState::InvalidParameterValue,
            "max_per_key must be at least 1, got 0",
        ),
        (
            "select pgflow.set_key_limit('limited', 'work', '{}', 2)",
            SqlState::InvalidParameterValue,
            "key_path is empty",
        ),
    ] {
        let err = sqlx::query(sql).execute(pool).await.unwrap_err();
        assert_eq!(SqlState::of(&err), Some(code), "{sql}: {err}");
        assert!(err.to_string().contains(text), "{sql}: {err}");
    }
    let n: i64 = sqlx::query_scalar(
        "select (select count(*) from pgflow.queue_limits) + (select count(*) from pgflow.key_limits)",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(n, 0);
}

#[tokio::test]
async fn a_queue_limit_holds_the_rest_without_spending_attempts_and_a_freed_slot_wakes_one() {
    let db = test_db().await;
    let pool = db.pool();
    flow(pool).await;
    exec(pool, "select pgflow.set_queue_limit('limited', 3)").await;
    start_tenants(pool, &["a"; 10]).await;

    // Two sessions claim at once: together at most 3.
    let (x, y) = tokio::join!(read_and_claim(pool, 10), read_and_claim(pool, 10));
    assert_eq!(x.len() + y.len(), 3, "{x:?} {y:?}");
    assert_eq!(started(pool).await, 3);
    assert_eq!(attempts(pool).await, 3, "held tasks spend no attempt");
    // The held messages are hidden: another claim reads nothing instead of spinning on them.
    assert!(read_and_claim(pool, 10).await.is_empty());
    assert_eq!(live_messages(pool, "limited").await, 10);

    // A slot frees: exactly one held message comes back, and is claimed.
    let (run, _) = x.first().or(y.first()).copied().unwrap();
    assert_eq!(complete(pool, run, "work", 0, json!(1)).await, "completed");
    let next = read_and_claim(pool, 10).await;
    assert_eq!(next.len(), 1, "{next:?}");
    assert_eq!(started(pool).await, 3);

    // Lifting the limit: the parked ones come back by their park time at the latest.
    exec(pool, "select pgflow.clear_queue_limit('limited')").await;
    make_visible(pool, "limited").await;
    assert_eq!(read_and_claim(pool, 10).await.len(), 6);
}

#[tokio::test]
async fn a_key_limit_bounds_each_key_without_blocking_the_others() {
    let db = test_db().await;
    let pool = db.pool();
    flow(pool).await;
    exec(
        pool,
        "select pgflow.set_key_limit('limited', 'work', '{tenant}', 2)",
    )
    .await;
    // A backlog of tenant A, then one task of tenant B and one of C behind it.
    let mut tenants = vec!["a"; 200];
    tenants.push("b");
    tenants.push("c");
    start_tenants(pool, &tenants).await;

    // Reads of 16: A's extra tasks are parked out of the way, so B and C are reached within the backlog's
    // length in reads (no read sees a parked message again).
    let mut claimed = Vec::new();
    for _ in 0..14 {
        claimed.extend(read_and_claim(pool, 16).await);
    }
    let per_tenant: Vec<(String, i64)> = sqlx::query_as(
        "select r.input ->> 'tenant', count(*) from pgflow.step_tasks t join pgflow.runs r using (run_id)
         where t.status = 'started' group by 1 order by 1",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        per_tenant,
        vec![
            ("a".to_owned(), 2),
            ("b".to_owned(), 1),
            ("c".to_owned(), 1)
        ]
    );
    assert_eq!(attempts(pool).await, 4);

    // Completing an A task wakes one parked A message (the oldest), not the whole backlog.
    let a_run: Uuid = sqlx::query_scalar(
        "select t.run_id from pgflow.step_tasks t join pgflow.runs r using (run_id)
         where t.status = 'started' and r.input ->> 'tenant' = 'a' limit 1",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    complete(pool, a_run, "work", 0, json!(1)).await;
    let next = read_and_claim(pool, 16).await;
    assert_eq!(next.len(), 1, "{next:?}");
    assert_eq!(started(pool).await, 4);
}

#[tokio::test]
async fn a_rate_limit_admits_at_most_its_tokens_and_refills() {
    let db = test_db().await;
    let pool = db.pool();
    flow(pool).await;
    exec(
        pool,
        "select pgflow.set_queue_limit('limited', rate_limit => 4, rate_period => '1 hour')",
    )
    .await;
    start_tenants(pool, &["a"; 10]).await;
    assert_eq!(read_and_claim(pool, 10).await.len(), 4);
    make_visible(pool, "limited").await;
    assert!(read_and_claim(pool, 10).await.is_empty(), "no token left");
    assert_eq!(attempts(pool).await, 4);
    // An hour later the bucket is full again (4 tokens, not 8: it holds at most rate_limit).
    exec(
        pool,
        "update pgflow.queue_limits set refilled_at = refilled_at - interval '2 hours'",
    )
    .await;
    make_visible(pool, "limited").await;
    assert_eq!(read_and_claim(pool, 10).await.len(), 4);
}
