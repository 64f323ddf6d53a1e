//! Flow control enforced by the database across every worker process: a concurrency limit and a rate limit
//! per queue, a concurrency limit and a rate limit per key (a value of the run input, such as a tenant id)
//! per step, and priorities with aging per queue.
//! Tasks held back by a limit are not claimed, spend no attempt, and their messages stay hidden until a
//! slot frees (see `pgflow-sql/schema/16_flow_control.sql`). Setting limits is the schema owner's right.
//!
//! ```no_run
//! # use std::time::Duration;
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), sqlx::Error> {
//! use pgflow_runtime::flow_control;
//! // At most 8 tasks of queue `send_emails` at once, and at most 100 starts per minute.
//! flow_control::set_queue_limit(&pool, "send_emails", Some(8), Some((100, Duration::from_secs(60)))).await?;
//! // At most 2 tasks of step `sync` of flow `crm` per tenant (`input.tenant`).
//! flow_control::set_key_limit(&pool, "crm", "sync", &["tenant"], 2).await?;
//! // At most 10 starts of step `report` per tenant per minute (a token bucket per tenant).
//! flow_control::set_key_limits(&pool, "crm", "report", &["tenant"], None, Some((10, Duration::from_secs(60))))
//!     .await?;
//! // Higher-priority runs first on queue `sync`; one priority step is a head start of 30 s.
//! flow_control::set_queue_priority(&pool, "sync", Duration::from_secs(30)).await?;
//! # Ok(()) }
//! ```

use std::time::Duration;

use sqlx::postgres::types::PgInterval;
use sqlx::PgPool;

/// Sets the limits of queue `queue`: at most `max_started` of its tasks started at once, at most
/// `rate.0` starts per `rate.1` (a token bucket). At least one of them.
///
/// # Errors
///
/// The database's refusal (a queue pgflow routes no task to, a limit of 0, a zero period), or a database
/// error. Nothing changes then.
pub async fn set_queue_limit(
    pool: &PgPool,
    queue: &str,
    max_started: Option<u32>,
    rate: Option<(u32, Duration)>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "select 1 from pgflow.set_queue_limit(queue_name => $1, max_started => $2, rate_limit => $3, \
         rate_period => $4)",
    )
    .bind(queue)
    .bind(max_started.map(to_i32))
    .bind(rate.map(|r| to_i32(r.0)))
    .bind(rate.map(|r| interval(r.1)))
    .execute(pool)
    .await
    .map(drop)
}

/// Removes the limits of queue `queue`; whether it had any.
///
/// # Errors
///
/// A database error.
pub async fn clear_queue_limit(pool: &PgPool, queue: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("select pgflow.clear_queue_limit(queue_name => $1)")
        .bind(queue)
        .fetch_one(pool)
        .await
}

/// Sets the per-key limit of step `step` of the concrete flow `flow_slug`: at most `max_per_key` of its tasks
/// whose run input has the same value at `key_path` started at once; other keys are not blocked. Replaces a
/// rate set by [`set_key_limits`] (it has none).
///
/// # Errors
///
/// The database's refusal (an unknown flow or step, an empty path, a limit of 0), or a database error.
pub async fn set_key_limit(
    pool: &PgPool,
    flow_slug: &str,
    step: &str,
    key_path: &[&str],
    max_per_key: u32,
) -> Result<(), sqlx::Error> {
    set_key_limits(pool, flow_slug, step, key_path, Some(max_per_key), None).await
}

/// Sets the per-key limits of step `step` of the concrete flow `flow_slug`, for its tasks whose run input
/// has the same value at `key_path`: at most `max_per_key` of them started at once, at most `rate.0` starts
/// per `rate.1` (a token bucket per key value). At least one of them. Tasks held by a key's rate wait,
/// without spending an attempt, until their key's next token; other keys are not blocked.
///
/// # Errors
///
/// The database's refusal (an unknown flow or step, an empty path, neither limit, a limit or rate of 0, a
/// zero period), or a database error. Nothing changes then.
pub async fn set_key_limits(
    pool: &PgPool,
    flow_slug: &str,
    step: &str,
    key_path: &[&str],
    max_per_key: Option<u32>,
    rate: Option<(u32, Duration)>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "select 1 from pgflow.set_key_limit(flow_slug => $1, step_slug => $2, key_path => $3, \
         max_per_key => $4, rate_limit => $5, rate_period => $6)",
    )
    .bind(flow_slug)
    .bind(step)
    .bind(key_path)
    .bind(max_per_key.map(to_i32))
    .bind(rate.map(|r| to_i32(r.0)))
    .bind(rate.map(|r| interval(r.1)))
    .execute(pool)
    .await
    .map(drop)
}

fn to_i32(n: u32) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

fn interval(d: Duration) -> PgInterval {
    PgInterval {
        months: 0,
        days: 0,
        microseconds: i64::try_from(d.as_micros()).unwrap_or(i64::MAX),
    }
}

/// Enables priorities on queue `queue`: its claims take higher-priority runs' tasks first
/// ([`Start::priority`](crate::client::Start::priority)), and `aging` is what one priority step is worth: a
/// task of priority p waits at most (q - p) x `aging` behind tasks of priority q sent at the same time. Creates
/// an index on the queue's PGMQ table (sends and claims on that queue wait while it is built). Messages sent
/// before carry no rank and are claimed first.
///
/// # Errors
///
/// The database's refusal (a queue pgflow routes no task to, an aging of zero), or a database error.
pub async fn set_queue_priority(
    pool: &PgPool,
    queue: &str,
    aging: Duration,
) -> Result<(), sqlx::Error> {
    sqlx::query("select 1 from pgflow.set_queue_priority(queue_name => $1, aging => $2)")
        .bind(queue)
        .bind(interval(aging))
        .execute(pool)
        .await
        .map(drop)
}

/// Disables priorities on queue `queue` (claims take its tasks by message id again) and drops the index;
/// whether it had them.
///
/// # Errors
///
/// A database error.
pub async fn clear_queue_priority(pool: &PgPool, queue: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("select pgflow.clear_queue_priority(queue_name => $1)")
        .bind(queue)
        .fetch_one(pool)
        .await
}

/// Removes the per-key limit of a step; whether it had one.
///
/// # Errors
///
/// A database error.
pub async fn clear_key_limit(
    pool: &PgPool,
    flow_slug: &str,
    step: &str,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("select pgflow.clear_key_limit(flow_slug => $1, step_slug => $2)")
        .bind(flow_slug)
        .bind(step)
        .fetch_one(pool)
        .await
}
