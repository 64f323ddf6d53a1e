//! The in-run baseline: pgflow's SQL core driven the way upstream pgflow's TypeScript worker drives it.
//!
//! What it models, per worker (one worker per scenario; the bench's K is its handler concurrency):
//!
//! 1. **Poll**: `select * from pgmq.read_with_poll(queue, vt => 5, qty => 10, max_poll_seconds => 2,
//!    poll_interval_ms => 100)`. As upstream does, the wait happens *inside* the statement (PGMQ re-reads
//!    every 100 ms for up to 2 s), and every column of the message is fetched.
//! 2. **Claim**: one `select * from pgflow.start_tasks(flow_slug, msg_ids, worker_id)` for the whole batch.
//! 3. **Execute**: each task's handler, then one `select * from pgflow.complete_task(run_id, step_slug,
//!    task_index, output)` per task (its own autocommit transaction), with up to K tasks in flight at once.
//! 4. **Batch barrier**: the next poll is sent only when every task of the batch has completed, as upstream's
//!    worker waits for a batch before it reads again.
//! 5. **Stop**: `select pgflow.mark_worker_stopped(worker_id)`, as upstream's worker does when it shuts down.
//!    Without it the worker row would count as a live worker of the queue for the liveness window (30 s),
//!    and a pgflow-rs worker started on the same queue in that time would take a smaller share of
//!    `completion_flushers`.
//!
//! So a task costs 1 `complete_task` round trip and commit of its own, plus its share (≥ 1/10) of one poll and
//! one claim. At K above the batch size (10) the barrier caps the concurrency at the batch.
//!
//! Connections: K + 1, opened up front (one for the poll and the claim, K for concurrent completions; a
//! completion takes whichever of the K is free), as upstream's pooled client does. They are held directly,
//! not through an sqlx `PgPool`: sqlx's pool pings a connection (a bare Sync, one round trip) every time it
//! is returned, and again when it is lent out unless `test_before_acquire(false)`, which would add one or
//! two round trips to every statement that upstream's client does not pay. (The pgflow-rs worker's pool does
//! pay them; the budget scenario shows them as pings.)
//!
//! Why this baseline: it runs the *same* SQL core, on the same server, in the same run as the pgflow-rs
//! worker, so the ratio between the two isolates what the worker's protocol (batched claims and
//! completions) changes, and both are also given as ratios to the raw PGMQ floor of the same run.

use futures::{StreamExt as _, TryStreamExt as _};
use serde_json::Value;
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection as _, PgConnection, Row as _};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::db::BenchFlow;

/// Upstream's defaults for the poll.
const VISIBILITY_SECONDS: i32 = 5;
const BATCH: i32 = 10;
const MAX_POLL_SECONDS: i32 = 2;
const POLL_INTERVAL_MS: i32 = 100;

/// The connections of an upstream-style worker with `k` concurrent handlers: one for the poll and the
/// claim, `k` for completions, all opened before it returns.
pub(crate) async fn connect(
    options: &PgConnectOptions,
    k: usize,
) -> Result<(PgConnection, Vec<PgConnection>), sqlx::Error> {
    let poll = PgConnection::connect_with(options).await?;
    let mut lanes = Vec::with_capacity(k.max(1));
    for _ in 0..k.max(1) {
        lanes.push(PgConnection::connect_with(options).await?);
    }
    Ok((poll, lanes))
}

/// One upstream-style worker: poll, claim the batch, complete its tasks with up to `k` in flight, repeat
/// until `stop` fires. A poll in progress when `stop` fires is allowed to finish (at most
/// `MAX_POLL_SECONDS`), so no backend is left sleeping inside `read_with_poll`.
pub(crate) async fn worker(
    (mut poll, lanes): (PgConnection, Vec<PgConnection>),
    slug: String,
    worker_id: Uuid,
    k: usize,
    stop: CancellationToken,
) -> Result<(), sqlx::Error> {
    let queue = slug.to_lowercase();
    let k = k.max(1).min(lanes.len());
    // At most `k` completions are in flight and each holds one of the `k` lanes, so one is always free.
    let lanes = std::sync::Mutex::new(lanes);
    while !stop.is_cancelled() {
        let messages = sqlx::query(
            "select * from pgmq.read_with_poll(queue_name => $1, vt => $2, qty => $3, \
             max_poll_seconds => $4, poll_interval_ms => $5)",
        )
        .bind(&queue)
        .bind(VISIBILITY_SECONDS)
        .bind(BATCH)
        .bind(MAX_POLL_SECONDS)
        .bind(POLL_INTERVAL_MS)
        .fetch_all(&mut poll)
        .await?;
        if messages.is_empty() {
            continue;
        }
        let ids = messages
            .iter()
            .map(|m| m.try_get::<i64, _>("msg_id"))
            .collect::<Result<Vec<_>, _>>()?;
        let tasks = sqlx::query(
            "select * from pgflow.start_tasks(flow_slug => $1, msg_ids => $2, worker_id => $3)",
        )
        .bind(&slug)
        .bind(&ids)
        .bind(worker_id)
        .fetch_all(&mut poll)
        .await?;
        // The batch barrier: every task of this batch completes before the next poll.
        futures::stream::iter(tasks)
            .map(|task| {
                let lanes = &lanes;
                async move {
                    let run_id: Uuid = task.try_get("run_id")?;
                    let step_slug: String = task.try_get("step_slug")?;
                    let task_index: i32 = task.try_get("task_index")?;
                    let flow_input: Option<Value> = task.try_get("flow_input")?;
                    let input: Option<Value> = task.try_get("input")?;
                    let input = flow_input.or(input).unwrap_or(Value::Null);
                    let output = BenchFlow::handle(&step_slug, &input);
                    let mut conn = lanes
                        .lock()
                        .expect("lanes lock")
                        .pop()
                        .expect("a free lane for every task in flight");
                    sqlx::query(
                        "select * from pgflow.complete_task(run_id => $1, step_slug => $2, \
                         task_index => $3, output => $4)",
                    )
                    .bind(run_id)
                    .bind(&step_slug)
                    .bind(task_index)
                    .bind(&output)
                    .execute(&mut conn)
                    .await?;
                    lanes.lock().expect("lanes lock").push(conn);
                    Ok::<(), sqlx::Error>(())
                }
            })
            .buffer_unordered(k)
            .try_collect::<()>()
            .await?;
    }
    crate::db::stop_worker(&mut poll, worker_id).await?;
    poll.close().await?;
    for conn in lanes.into_inner().expect("lanes lock") {
        conn.close().await?;
    }
    Ok(())
}
