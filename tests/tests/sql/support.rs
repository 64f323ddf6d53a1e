//! Helpers of the SQL tests: running SQL, claiming, completing and inspecting tasks and queues.
//!
//! Starting runs and reading run, step and task rows are shared with the runtime tests
//! ([`pgflow_tests::state`]) and re-exported here.

pub(crate) use pgflow_tests::state::{active_tasks, run_output, run_status, start, step_status};
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

/// The worker every helper claims with (registered on first use).
pub(crate) const WORKER: Uuid = Uuid::from_u128(0x1111_1111_1111_1111_1111_1111_1111_1111);

/// A task as `pgflow.start_tasks` returns it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub(crate) struct Task {
    pub(crate) flow_slug: String,
    pub(crate) run_id: Uuid,
    pub(crate) step_slug: String,
    pub(crate) input: Option<Value>,
    pub(crate) msg_id: i64,
    pub(crate) task_index: i32,
    pub(crate) flow_input: Option<Value>,
}

/// Runs one or more SQL statements, panicking with the SQL on error.
pub(crate) async fn exec(pool: &PgPool, sql: &str) {
    sqlx::raw_sql(sql)
        .execute(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}\nfailed: {e}"));
}

/// Runs SQL that must fail and returns the database error message.
pub(crate) async fn exec_err(pool: &PgPool, sql: &str) -> String {
    match sqlx::raw_sql(sql).execute(pool).await {
        Ok(_) => panic!("expected an error from: {sql}"),
        Err(e) => e
            .as_database_error()
            .map(|d| d.message().to_string())
            .unwrap_or_else(|| e.to_string()),
    }
}

/// Registers the test worker (idempotent).
pub(crate) async fn register_worker(pool: &PgPool) {
    sqlx::query(
        "insert into pgflow.workers (worker_id, queue_name, function_name) values ($1, 'any', 'test')
         on conflict (worker_id) do nothing",
    )
    .bind(WORKER)
    .execute(pool)
    .await
    .expect("register worker");
}

/// Reads up to `qty` visible messages of `queue` and claims them with the three-argument start_tasks.
pub(crate) async fn claim(pool: &PgPool, flow: &str, queue: &str, qty: i32) -> Vec<Task> {
    register_worker(pool).await;
    let ids = read(pool, queue, qty).await;
    start_tasks(pool, flow, &ids).await
}

/// Reads up to `qty` visible message ids of `queue` (visibility 30 s).
pub(crate) async fn read(pool: &PgPool, queue: &str, qty: i32) -> Vec<i64> {
    sqlx::query_scalar("select msg_id from pgmq.read(queue_name => $1, vt => 30, qty => $2)")
        .bind(queue)
        .bind(qty)
        .fetch_all(pool)
        .await
        .expect("pgmq.read")
}

/// The three-argument start_tasks.
pub(crate) async fn start_tasks(pool: &PgPool, flow: &str, ids: &[i64]) -> Vec<Task> {
    register_worker(pool).await;
    sqlx::query_as(
        "select * from pgflow.start_tasks(flow_slug => $1, msg_ids => $2, worker_id => $3) order by step_slug, task_index",
    )
    .bind(flow)
    .bind(ids)
    .bind(WORKER)
    .fetch_all(pool)
    .await
    .unwrap_or_else(|e| panic!("start_tasks({flow}): {e}"))
}

/// Completes a task; returns the task's status afterwards.
pub(crate) async fn complete(
    pool: &PgPool,
    run: Uuid,
    step: &str,
    index: i32,
    output: Value,
) -> String {
    sqlx::query_scalar(
        "select status from pgflow.complete_task(run_id => $1, step_slug => $2, task_index => $3, output => $4)",
    )
    .bind(run)
    .bind(step)
    .bind(index)
    .bind(output)
    .fetch_one(pool)
    .await
    .unwrap_or_else(|e| panic!("complete_task({step}/{index}): {e}"))
}

/// Fails a task; returns the task's status afterwards.
pub(crate) async fn fail(pool: &PgPool, run: Uuid, step: &str, index: i32, error: &str) -> String {
    sqlx::query_scalar(
        "select status from pgflow.fail_task(run_id => $1, step_slug => $2, task_index => $3, error_message => $4)",
    )
    .bind(run)
    .bind(step)
    .bind(index)
    .bind(error)
    .fetch_one(pool)
    .await
    .unwrap_or_else(|e| panic!("fail_task({step}/{index}): {e}"))
}

pub(crate) async fn skip_reason(pool: &PgPool, run: Uuid, step: &str) -> Option<String> {
    sqlx::query_scalar(
        "select skip_reason from pgflow.step_states where run_id = $1 and step_slug = $2",
    )
    .bind(run)
    .bind(step)
    .fetch_one(pool)
    .await
    .expect("skip reason")
}

/// Task statuses of one step, by task index.
pub(crate) async fn task_statuses(pool: &PgPool, run: Uuid, step: &str) -> Vec<String> {
    sqlx::query_scalar(
        "select status from pgflow.step_tasks where run_id = $1 and step_slug = $2 order by task_index",
    )
    .bind(run)
    .bind(step)
    .fetch_all(pool)
    .await
    .expect("task statuses")
}

/// Number of messages still live (not archived) in a queue.
pub(crate) async fn live_messages(pool: &PgPool, queue: &str) -> i64 {
    sqlx::query_scalar(&format!("select count(*) from pgmq.q_{queue}"))
        .fetch_one(pool)
        .await
        .expect("live messages")
}

/// Seconds from now until the message becomes visible again.
pub(crate) async fn seconds_until_visible(pool: &PgPool, queue: &str, msg_id: i64) -> f64 {
    sqlx::query_scalar(&format!(
        "select extract(epoch from vt - clock_timestamp())::float8 from pgmq.q_{queue} where msg_id = $1"
    ))
    .bind(msg_id)
    .fetch_one(pool)
    .await
    .expect("message visibility")
}

/// Makes every message of the queue visible now (instead of waiting for a backoff).
pub(crate) async fn make_visible(pool: &PgPool, queue: &str) {
    exec(
        pool,
        &format!("update pgmq.q_{queue} set vt = clock_timestamp()"),
    )
    .await;
}
