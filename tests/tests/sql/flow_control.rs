//! Flow control in the claim: concurrency limits per queue and per key, rate limits per queue and per key. Held
//! tasks are not claimed, spend no attempt and stay hidden until a slot frees or a token comes; other keys are
//! not blocked.

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
        (
            "select pgflow.set_key_limit('limited', 'work', '{tenant}')",
            SqlState::InvalidParameterValue,
            "give max_per_key, rate_limit or both",
        ),
        (
            "select pgflow.set_key_limit('limited', 'work', '{tenant}', rate_limit => 0, rate_period => '1 minute')",
            SqlState::InvalidParameterValue,
            "rate_limit must be at least 1 start per period, got 0",
        ),
        (
            "select pgflow.set_key_limit('limited', 'work', '{tenant}', rate_limit => -2, rate_period => '1 minute')",
            SqlState::InvalidParameterValue,
            "rate_limit must be at least 1 start per period, got -2",
        ),
        (
            "select pgflow.set_key_limit('limited', 'work', '{tenant}', 2, rate_limit => 5)",
            SqlState::InvalidParameterValue,
            "a rate needs both rate_limit and a positive rate_period, got 5 per NULL",
        ),
        (
            "select pgflow.set_key_limit('limited', 'work', '{tenant}', rate_limit => 5, rate_period => '0 seconds')",
            SqlState::InvalidParameterValue,
            "a positive rate_period",
        ),
        (
            "select pgflow.set_key_limit('limited', 'work', '{tenant}', rate_period => '1 minute')",
            SqlState::InvalidParameterValue,
            "give max_per_key, rate_limit or both",
        ),
        (
            "select pgflow.set_key_limit('nosuchflow', 'work', '{tenant}', rate_limit => 5, rate_period => '1 minute')",
            SqlState::UndefinedObject,
            "flow \"nosuchflow\" has no step \"work\"",
        ),
    ] {
        let err = sqlx::query(sql).execute(pool).await.unwrap_err();
        assert_eq!(SqlState::of(&err), Some(code), "{sql}: {err}");
        assert!(err.to_string().contains(text), "{sql}: {err}");
    }
    let n: i64 = sqlx::query_scalar(
        "select (select count(*) from pgflow.queue_limits) + (select count(*) from pgflow.key_limits)
                + (select count(*) from pgflow.key_buckets)",
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

async fn slots(pool: &PgPool) -> i64 {
    sqlx::query_scalar("select count(*) from pgflow.limit_slots")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_batch_within_the_limits_is_admitted_whole_and_counts_against_them() {
    let db = test_db().await;
    let pool = db.pool();
    flow(pool).await;
    // A queue limit of 5 and a rate of 4 an hour: a claim of 3 fits both (admitted whole, without the
    // admission query), and still takes 3 slots and 3 tokens, so the next claim gets only the last token.
    exec(
        pool,
        "select pgflow.set_queue_limit('limited', 5, rate_limit => 4, rate_period => '1 hour')",
    )
    .await;
    start_tenants(pool, &["a"; 10]).await;
    assert_eq!(read_and_claim(pool, 3).await.len(), 3);
    assert_eq!(slots(pool).await, 3);
    assert_eq!(read_and_claim(pool, 10).await.len(), 1);
    assert_eq!(slots(pool).await, 4);
    assert_eq!(started(pool).await, 4);
    assert_eq!(attempts(pool).await, 4);
}

#[tokio::test]
async fn deleting_a_flow_deletes_the_slots_of_its_started_tasks() {
    let db = test_db().await;
    let pool = db.pool();
    flow(pool).await;
    exec(pool, "select pgflow.set_queue_limit('limited', 2)").await;
    start_tenants(pool, &["a"; 3]).await;
    assert_eq!(read_and_claim(pool, 3).await.len(), 2);
    assert_eq!(slots(pool).await, 2);
    exec(pool, "select pgflow.delete_flow_and_data('limited')").await;
    assert_eq!(slots(pool).await, 0, "no slot outlives its task");
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
    // A backlog of tenant A, then one task of tenant B and one of C behind it (a second call: one call's
    // messages need not be in the order of its inputs).
    start_tenants(pool, &["a"; 200]).await;
    start_tenants(pool, &["b", "c"]).await;

    // The first read of 16 meets only A: two are claimed, and A's slots are then all taken, so the rest of
    // A's backlog is parked at once, not read by claim after claim. The second read reaches B and C.
    assert_eq!(read_and_claim(pool, 16).await.len(), 2);
    let parked: i64 = sqlx::query_scalar(
        "select count(*) from pgflow.parked_messages where limit_key = 'limited/work/a'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(parked, 198, "every A task but the two claimed is parked");
    assert_eq!(read_and_claim(pool, 16).await.len(), 2);
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
async fn parking_a_full_keys_backlog_leaves_a_message_another_session_holds() {
    let db = test_db().await;
    let pool = db.pool();
    flow(pool).await;
    exec(
        pool,
        "select pgflow.set_key_limit('limited', 'work', '{tenant}', 1)",
    )
    .await;
    start_tenants(pool, &["a"; 20]).await;
    let last: i64 = sqlx::query_scalar("select max(msg_id) from pgmq.q_limited")
        .fetch_one(pool)
        .await
        .unwrap();
    // Another session holds A's last message, as a claim in flight would.
    let mut other = pool.begin().await.unwrap();
    sqlx::query("select 1 from pgmq.q_limited where msg_id = $1 for update")
        .bind(last)
        .execute(&mut *other)
        .await
        .unwrap();

    // The claim admits one A task, holds the other three of its read, and parks the rest of A's backlog
    // without waiting for the held message, which it leaves alone.
    assert_eq!(read_and_claim(pool, 4).await.len(), 1);
    let parked: Vec<i64> = sqlx::query_scalar(
        "select msg_id from pgflow.parked_messages where limit_key = 'limited/work/a' order by msg_id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(parked.len(), 18, "{parked:?}");
    assert!(!parked.contains(&last));
    other.rollback().await.unwrap();
    let visible: Vec<i64> =
        sqlx::query_scalar("select msg_id from pgmq.q_limited where vt <= clock_timestamp()")
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(visible, vec![last]);
    // That message is read and held like any other of A.
    assert!(read_and_claim(pool, 4).await.is_empty());
    assert_eq!(attempts(pool).await, 1);
}

#[tokio::test]
async fn a_claim_does_not_wait_for_another_claim_of_the_same_key_and_takes_the_other_keys() {
    let db = test_db().await;
    let pool = db.pool();
    flow(pool).await;
    exec(
        pool,
        "select pgflow.set_key_limit('limited', 'work', '{tenant}', 2)",
    )
    .await;
    start_tenants(pool, &["a"]).await;
    start_tenants(pool, &["a", "b"]).await;
    register_worker(pool).await;

    // A claim in flight: it has taken A's first task and not committed yet, so it holds key A.
    let mut first = pool.begin().await.unwrap();
    let claimed: Vec<i64> = sqlx::query_scalar(
        "select msg_id from pgflow.read_and_claim_tasks('limited', 1, 30, $1, array['limited'], array['work'])
         where outcome = 'claimed'",
    )
    .bind(WORKER)
    .fetch_all(&mut *first)
    .await
    .unwrap();
    assert_eq!(claimed.len(), 1);

    // A second claim meanwhile does not wait for it: it takes B's task, and holds A's second task briefly
    // (not parked, no attempt spent) although A has a free slot, since it cannot count A's slots now.
    let second = tokio::time::timeout(std::time::Duration::from_secs(10), read_and_claim(pool, 10))
        .await
        .expect("the second claim waited for the first");
    assert_eq!(second.len(), 1, "{second:?}");
    let tenant: String =
        sqlx::query_scalar("select input ->> 'tenant' from pgflow.runs where run_id = $1")
            .bind(second[0].0)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(tenant, "b");
    let parked: i64 = sqlx::query_scalar("select count(*) from pgflow.parked_messages")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(parked, 0, "a task of a busy key is not parked");
    let back_in: f64 = sqlx::query_scalar(
        "select extract(epoch from q.vt - clock_timestamp())::float8 from pgmq.q_limited q
         join pgflow.step_tasks t on t.queue_name = 'limited' and t.message_id = q.msg_id
         where t.status = 'queued'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(back_in < 1.0, "A's second task comes back in {back_in} s");

    // Once the first claim commits, A's second task is read again and admitted: A then runs 2 of its 2.
    first.commit().await.unwrap();
    let mut again = Vec::new();
    for _ in 0..100 {
        again = read_and_claim(pool, 10).await;
        if !again.is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(again.len(), 1, "{again:?}");
    assert_eq!(started(pool).await, 3);
    assert_eq!(attempts(pool).await, 3);
    assert_eq!(slots(pool).await, 3);
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

/// Per key, how many tasks started since `after` (a database time), from the task rows.
async fn starts_per_key(pool: &PgPool, after: chrono::DateTime<chrono::Utc>) -> Vec<(String, i64)> {
    sqlx::query_as(
        "select r.input ->> 'tenant', count(*) from pgflow.step_tasks t join pgflow.runs r using (run_id)
         where t.flow_slug = 'limited' and t.started_at > $1 group by 1 order by 1",
    )
    .bind(after)
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn db_now(pool: &PgPool) -> chrono::DateTime<chrono::Utc> {
    sqlx::query_scalar("select clock_timestamp()")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Makes every message visible (as if any hold had ended), then four sessions claim at once, again and again,
/// until no message comes back within a second: every message read is either claimed or held (hidden again),
/// so each round reaches further. A task whose key another of the four claims held at that moment is hidden
/// for only milliseconds, and read again.
async fn drain_with_four_claimers(pool: &PgPool) {
    make_visible(pool, "limited").await;
    loop {
        let visible: i64 = sqlx::query_scalar(
            "select count(*) from pgmq.q_limited where vt <= clock_timestamp() + interval '1 second'",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if visible == 0 {
            return;
        }
        tokio::join!(
            read_and_claim(pool, 8),
            read_and_claim(pool, 8),
            read_and_claim(pool, 8),
            read_and_claim(pool, 8)
        );
    }
}

#[tokio::test]
async fn a_key_rate_admits_at_most_its_tokens_per_key_and_period_across_concurrent_claimers() {
    let db = test_db().await;
    let pool = db.pool();
    flow(pool).await;
    // Three starts per tenant per hour: the test runs in far less than the 1/3 hour a new token takes, so
    // each period below is ended by moving the buckets back by an hour.
    exec(
        pool,
        "select pgflow.set_key_limit('limited', 'work', '{tenant}', rate_limit => 3, rate_period => '1 hour')",
    )
    .await;
    let mut tenants = vec!["a"; 20];
    tenants.extend(["b"; 20]);
    tenants.extend(["c"; 5]);
    tenants.push("d");
    start_tenants(pool, &tenants).await;

    let mut total = 0;
    for (period, expected) in [
        (1, [("a", 3), ("b", 3), ("c", 3), ("d", 1)].as_slice()),
        (2, [("a", 3), ("b", 3), ("c", 2)].as_slice()),
        (3, [("a", 3), ("b", 3)].as_slice()),
    ] {
        let since = db_now(pool).await;
        drain_with_four_claimers(pool).await;
        let got = starts_per_key(pool, since).await;
        let expected: Vec<(String, i64)> = expected
            .iter()
            .map(|(k, n)| ((*k).to_owned(), *n))
            .collect();
        assert_eq!(got, expected, "period {period}");
        total += expected.iter().map(|(_, n)| n).sum::<i64>();
        assert_eq!(attempts(pool).await, total, "held tasks spend no attempt");
        // Held messages are hidden until their turn's token: at least a third of an hour away.
        let soonest: f64 = sqlx::query_scalar(
            "select min(extract(epoch from vt - clock_timestamp()))::float8 from pgmq.q_limited q
             join pgflow.step_tasks t on t.queue_name = 'limited' and t.message_id = q.msg_id
             where t.status = 'queued'",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        assert!(
            soonest > 600.0,
            "period {period}: a held message comes back in {soonest} s"
        );
        exec(
            pool,
            "update pgflow.key_buckets set refilled_at = refilled_at - interval '1 hour'",
        )
        .await;
    }
    // The buckets of keys idle for a whole period (full again, the same as no bucket) are pruned by the
    // claims: d spent nothing after the first period, c nothing after the second.
    let keys: Vec<String> =
        sqlx::query_scalar("select limit_key from pgflow.key_buckets order by 1")
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(keys, ["limited/work/a", "limited/work/b"]);
}

async fn complete_started(pool: &PgPool) {
    let runs: Vec<Uuid> = sqlx::query_scalar(
        "select run_id from pgflow.step_tasks where flow_slug = 'limited' and status = 'started'",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    for run in runs {
        assert_eq!(complete(pool, run, "work", 0, json!(1)).await, "completed");
    }
}

#[tokio::test]
async fn a_key_rate_and_a_key_concurrency_limit_hold_together_and_a_new_rate_applies_at_once() {
    let db = test_db().await;
    let pool = db.pool();
    flow(pool).await;
    exec(
        pool,
        "select pgflow.set_key_limit('limited', 'work', '{tenant}', 2, rate_limit => 5, rate_period => '1 hour')",
    )
    .await;
    start_tenants(pool, &["a"; 10]).await;
    // Two at once (the concurrency limit) although five tokens are there: three are left.
    drain_with_four_claimers(pool).await;
    assert_eq!(started(pool).await, 2);
    // A lower rate caps what is left at the new rate: one token.
    exec(
        pool,
        "select pgflow.set_key_limit('limited', 'work', '{tenant}', 2, rate_limit => 1, rate_period => '1 hour')",
    )
    .await;
    let tokens: f64 = sqlx::query_scalar("select tokens from pgflow.key_buckets")
        .fetch_one(pool)
        .await
        .unwrap();
    assert!((tokens - 1.0).abs() < 1e-9, "{tokens}");
    // Both slots free, one token: one start, then none.
    complete_started(pool).await;
    drain_with_four_claimers(pool).await;
    assert_eq!(attempts(pool).await, 3);
    complete_started(pool).await;
    drain_with_four_claimers(pool).await;
    assert_eq!(attempts(pool).await, 3);
    // Removing the rate drops the buckets and brings the parked messages back at once (no make_visible):
    // the concurrency limit alone then admits two.
    exec(
        pool,
        "select pgflow.set_key_limit('limited', 'work', '{tenant}', 2)",
    )
    .await;
    let buckets: i64 = sqlx::query_scalar("select count(*) from pgflow.key_buckets")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(buckets, 0);
    assert_eq!(read_and_claim(pool, 16).await.len(), 2);
    assert_eq!(attempts(pool).await, 5);
}
