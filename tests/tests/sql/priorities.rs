//! Priorities with aging: on a queue with priorities enabled, the claim reads visible messages by rank (the
//! send time minus priority x aging), so higher priorities are claimed first and a low priority waits at most
//! (difference of priorities) x aging behind higher ones; other queues are read by message id as before.

use pgflow_sql::SqlState;
use pgflow_tests::test_db;
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use crate::support::*;

/// A two-step flow `prio` (`first`, then `second`) on queue `prio`, a map flow, and a worker registered.
async fn flow(pool: &PgPool) {
    exec(
        pool,
        "select pgflow.create_flow('prio');
         select pgflow.add_step('prio', 'first');
         select pgflow.add_step('prio', 'second', array['first']);",
    )
    .await;
    register_worker(pool).await;
}

/// Starts one run per priority (input {"n": i}, i its position), in one call; returns their ids.
async fn start_with(pool: &PgPool, priorities: &[i32], first_n: usize) -> Vec<Uuid> {
    let inputs: Vec<serde_json::Value> = (0..priorities.len())
        .map(|i| json!({ "n": first_n + i }))
        .collect();
    sqlx::query_scalar("select run_id from pgflow.start_flows('prio', $1, null, $2)")
        .bind(&inputs)
        .bind(priorities)
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Claims up to `qty` tasks with read_and_claim_tasks (the pgflow-rs claim); returns the runs' inputs' n, in
/// message order.
async fn claim_ns(pool: &PgPool, qty: i32) -> Vec<i64> {
    let mut ns: Vec<(i64, i64)> = sqlx::query_as(
        "select c.msg_id, (r.input ->> 'n')::bigint
         from pgflow.read_and_claim_tasks('prio', $1, 30, $2, array['prio', 'prio'], array['first', 'second']) c
         join pgflow.runs r using (run_id)
         where c.outcome = 'claimed'",
    )
    .bind(qty)
    .bind(WORKER)
    .fetch_all(pool)
    .await
    .unwrap();
    ns.sort();
    ns.into_iter().map(|(_, n)| n).collect()
}

fn sorted(mut v: Vec<i64>) -> Vec<i64> {
    v.sort();
    v
}

#[tokio::test]
async fn with_priorities_the_high_ones_are_claimed_before_an_older_backlog_of_low_ones() {
    let db = test_db().await;
    let pool = db.pool();
    flow(pool).await;
    exec(pool, "select pgflow.set_queue_priority('prio', '1 hour')").await;
    // A backlog of ten low-priority runs (n 0..9), then three high ones (n 10..12) and two middle ones.
    start_with(pool, &[0; 10], 0).await;
    start_with(pool, &[5, 5, 5], 10).await;
    start_with(pool, &[2, 2], 13).await;
    assert_eq!(sorted(claim_ns(pool, 3).await), [10, 11, 12]);
    assert_eq!(sorted(claim_ns(pool, 2).await), [13, 14]);
    // Within one priority, message order (a start_flows call sends its runs' messages in run-id order).
    let low = claim_ns(pool, 4).await;
    assert!(low.len() == 4 && low.iter().all(|n| *n < 10), "{low:?}");
    // A run's later messages (its dependent step) carry its rank: the high run's second step overtakes the
    // rest of the low backlog.
    let high: Uuid =
        sqlx::query_scalar("select run_id from pgflow.runs where (input ->> 'n')::int = 10")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(
        complete(pool, high, "first", 0, json!(1)).await,
        "completed"
    );
    assert_eq!(claim_ns(pool, 1).await, [10]);
    let rest = claim_ns(pool, 10).await;
    assert_eq!(sorted([low, rest].concat()), (0..10).collect::<Vec<i64>>());
}

#[tokio::test]
async fn aging_claims_a_low_priority_task_older_than_its_head_start_before_newer_high_ones() {
    let db = test_db().await;
    let pool = db.pool();
    flow(pool).await;
    // Priority 5 against 0 is a head start of 5 x 1 minute.
    exec(pool, "select pgflow.set_queue_priority('prio', '1 minute')").await;
    start_with(pool, &[0, 0], 0).await;
    start_with(pool, &[5, 5], 2).await;
    // As if run 0's task had been sent 301 s before the high ones and run 1's 299 s before: the rank of a
    // priority-0 message is its send time.
    exec(
        pool,
        "with high as (select min(extract(epoch from q.enqueued_at))::float8 as sent
                       from pgmq.q_prio q join pgflow.step_tasks t on t.queue_name = 'prio' and t.message_id = q.msg_id
                       join pgflow.runs r using (run_id) where r.priority = 5)
         update pgmq.q_prio q
         set headers = jsonb_build_object('pgflow_rank',
                                          high.sent - case (r.input ->> 'n')::int when 0 then 301 else 299 end)
         from high, pgflow.step_tasks t join pgflow.runs r using (run_id)
         where t.queue_name = 'prio' and t.message_id = q.msg_id and r.priority = 0",
    )
    .await;
    assert_eq!(
        claim_ns(pool, 1).await,
        [0],
        "older than its head start: first"
    );
    assert_eq!(sorted(claim_ns(pool, 2).await), [2, 3]);
    assert_eq!(claim_ns(pool, 1).await, [1]);
}

#[tokio::test]
async fn the_rank_is_the_send_time_minus_priority_times_aging_and_retry_run_keeps_it() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('prio', max_attempts => 1);
         select pgflow.add_step('prio', 'first');
         select pgflow.add_step('prio', 'second', array['first']);",
    )
    .await;
    register_worker(pool).await;
    exec(
        pool,
        "select pgflow.set_queue_priority('prio', '10 seconds')",
    )
    .await;
    let run: Uuid =
        sqlx::query_scalar("select run_id from pgflow.start_flow('prio', '{\"n\": 0}', null, 3)")
            .fetch_one(pool)
            .await
            .unwrap();
    let lag = "select extract(epoch from q.enqueued_at)::float8 - (q.headers ->> 'pgflow_rank')::float8
               from pgmq.q_prio q join pgflow.step_tasks t on t.queue_name = 'prio' and t.message_id = q.msg_id
               where t.run_id = $1 and t.status = 'queued'";
    let head_start: f64 = sqlx::query_scalar(lag)
        .bind(run)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!((head_start - 30.0).abs() < 1.0, "{head_start}");
    // The task fails for good (one attempt), the run fails; retry_run sends a new message with the rank.
    assert_eq!(claim_ns(pool, 1).await, [0]);
    assert_eq!(fail(pool, run, "first", 0, "boom").await, "failed");
    exec(pool, &format!("select pgflow.retry_run('{run}')")).await;
    let head_start: f64 = sqlx::query_scalar(lag)
        .bind(run)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!((head_start - 30.0).abs() < 1.0, "{head_start}");
    let priority: i32 = sqlx::query_scalar("select priority from pgflow.runs where run_id = $1")
        .bind(run)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(priority, 3);
}

#[tokio::test]
async fn without_the_setting_the_order_is_by_message_id_and_clearing_it_drops_the_index() {
    let db = test_db().await;
    let pool = db.pool();
    flow(pool).await;
    start_with(pool, &[0, 0, 0], 0).await;
    start_with(pool, &[9, 9], 3).await;
    let first = claim_ns(pool, 2).await;
    assert!(
        first.iter().all(|n| *n < 3),
        "by message id: the low ones first, {first:?}"
    );
    let headers: i64 =
        sqlx::query_scalar("select count(*) from pgmq.q_prio where headers is not null")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(headers, 0, "no rank on a queue without priorities");

    exec(pool, "select pgflow.set_queue_priority('prio', '1 minute')").await;
    let index = "select count(*) from pg_indexes where schemaname = 'pgmq' and indexname = 'q_prio_pgflow_rank'";
    let n: i64 = sqlx::query_scalar(index).fetch_one(pool).await.unwrap();
    assert_eq!(n, 1);
    // Messages sent before the setting have no rank and are read first, by message id.
    start_with(pool, &[9], 5).await;
    let next = sorted(claim_ns(pool, 2).await);
    let last_low = (0..3).find(|n| !first.contains(n)).unwrap();
    assert!(
        next[0] == last_low && next[1] >= 3 && next[1] <= 4,
        "{next:?}"
    );
    assert_eq!(claim_ns(pool, 1).await, [7 - next[1]]);
    assert_eq!(claim_ns(pool, 1).await, [5]);

    let cleared: bool = sqlx::query_scalar("select pgflow.clear_queue_priority('prio')")
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(cleared);
    let n: i64 = sqlx::query_scalar(index).fetch_one(pool).await.unwrap();
    assert_eq!(n, 0);
    let again: bool = sqlx::query_scalar("select pgflow.clear_queue_priority('prio')")
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(!again);
}

#[tokio::test]
async fn bad_priority_settings_and_starts_get_a_clear_error_and_create_nothing() {
    let db = test_db().await;
    let pool = db.pool();
    flow(pool).await;
    for (sql, code, text) in [
        (
            "select pgflow.set_queue_priority('nosuchqueue', '1 minute')",
            SqlState::UndefinedObject,
            "queue \"nosuchqueue\" is not a queue pgflow routes tasks to",
        ),
        (
            "select pgflow.set_queue_priority('prio', '0 seconds')",
            SqlState::InvalidParameterValue,
            "aging must be a positive interval, got 00:00:00",
        ),
        (
            "select pgflow.set_queue_priority('prio', '-1 minute')",
            SqlState::InvalidParameterValue,
            "aging must be a positive interval",
        ),
        (
            "select pgflow.set_queue_priority('prio', null)",
            SqlState::InvalidParameterValue,
            "aging must be a positive interval, got NULL",
        ),
        (
            "select pgflow.start_flows('prio', array['{}'::jsonb, '{}'::jsonb], null, array[1])",
            SqlState::InvalidParameterValue,
            "1 priorities for 2 inputs",
        ),
    ] {
        let err = sqlx::query(sql).execute(pool).await.unwrap_err();
        assert_eq!(SqlState::of(&err), Some(code), "{sql}: {err}");
        assert!(err.to_string().contains(text), "{sql}: {err}");
    }
    let n: i64 = sqlx::query_scalar(
        "select (select count(*) from pgflow.queue_priorities) + (select count(*) from pgflow.runs)
                + (select count(*) from pg_indexes where schemaname = 'pgmq' and indexname like '%pgflow_rank')",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(n, 0);
}

#[tokio::test]
async fn the_ranked_read_goes_through_the_rank_index_without_sorting_the_queue() {
    let db = test_db().await;
    let pool = db.pool();
    flow(pool).await;
    exec(pool, "select pgflow.set_queue_priority('prio', '1 minute')").await;
    let priorities: Vec<i32> = (0..2000).map(|i| i % 10).collect();
    start_with(pool, &priorities, 0).await;
    exec(pool, "analyze pgmq.q_prio").await;
    // The statement of the queue's 'lock_visible_ranked' operation, as the claim plans it (a generic plan,
    // sequential scans off).
    let mut conn = pool.acquire().await.unwrap();
    sqlx::raw_sql(
        "set plan_cache_mode = force_generic_plan; set enable_seqscan = off;
         prepare ranked(int) as
           select q.msg_id from pgmq.q_prio q where q.vt <= clock_timestamp()
           order by (q.headers ->> 'pgflow_rank')::float8 nulls first, q.msg_id
           limit $1 for update skip locked",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    let plan: Vec<String> = sqlx::query_scalar("explain execute ranked(16)")
        .fetch_all(&mut *conn)
        .await
        .unwrap();
    let plan = plan.join("\n");
    assert!(plan.contains("q_prio_pgflow_rank"), "{plan}");
    assert!(!plan.contains("Sort"), "{plan}");
}
