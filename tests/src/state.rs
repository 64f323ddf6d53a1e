//! Starting runs through the SQL interface, and reading or waiting on run, step and task rows.

use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use crate::{wait_until, LIMIT};

/// Starts a run of `flow` with `pgflow.start_flow` (as any language could) and returns its id.
pub async fn start(pool: &PgPool, flow: &str, input: Value) -> Uuid {
    sqlx::query_scalar("select run_id from pgflow.start_flow(flow_slug => $1, input => $2)")
        .bind(flow)
        .bind(input)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("start_flow({flow}): {e}"))
}

/// `pgflow.runs.status` of the run.
pub async fn run_status(pool: &PgPool, run: Uuid) -> String {
    sqlx::query_scalar("select status from pgflow.runs where run_id = $1")
        .bind(run)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("status of run {run}: {e}"))
}

/// `pgflow.runs.output` of the run (`None` until it completes).
pub async fn run_output(pool: &PgPool, run: Uuid) -> Option<Value> {
    sqlx::query_scalar("select output from pgflow.runs where run_id = $1")
        .bind(run)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("output of run {run}: {e}"))
}

/// Waits (up to [`LIMIT`]) until the run is no longer `started`; returns its status.
pub async fn wait_finished(pool: &PgPool, run: Uuid) -> String {
    wait_until(LIMIT, "the run to finish", || async {
        run_status(pool, run).await != "started"
    })
    .await;
    run_status(pool, run).await
}

/// `pgflow.step_states.status` of one step of the run.
pub async fn step_status(pool: &PgPool, run: Uuid, step: &str) -> String {
    sqlx::query_scalar("select status from pgflow.step_states where run_id = $1 and step_slug = $2")
        .bind(run)
        .bind(step)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("status of step {step}: {e}"))
}

/// `(status, attempts_count, error_message)` of one task.
pub async fn task(
    pool: &PgPool,
    run: Uuid,
    step: &str,
    index: i32,
) -> (String, i32, Option<String>) {
    sqlx::query_as(
        "select status, attempts_count, error_message from pgflow.step_tasks \
         where run_id = $1 and step_slug = $2 and task_index = $3",
    )
    .bind(run)
    .bind(step)
    .bind(index)
    .fetch_one(pool)
    .await
    .unwrap_or_else(|e| panic!("task {step}/{index}: {e}"))
}

/// Number of tasks of the run that are still `queued` or `started`.
pub async fn active_tasks(pool: &PgPool, run: Uuid) -> i64 {
    sqlx::query_scalar(
        "select count(*) from pgflow.step_tasks where run_id = $1 and status in ('queued', 'started')",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap_or_else(|e| panic!("active tasks of run {run}: {e}"))
}
