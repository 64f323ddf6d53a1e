//! Shared helpers: fast worker settings, spawning workers, reading task state.

use std::time::Duration;

use pgflow_runtime::{Flow, Worker, WorkerBuilder, WorkerHandle, WorkerReport};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Generous limit for bounded waits.
pub(crate) const LIMIT: Duration = Duration::from_secs(30);

/// Settings that keep tests fast.
pub(crate) fn fast<F: Flow>(b: WorkerBuilder<F>) -> WorkerBuilder<F> {
    b.poll_interval(Duration::from_millis(10))
        .max_poll_wait(Duration::from_millis(50))
        .heartbeat_interval(Duration::from_millis(100))
        .shutdown_grace(Duration::from_secs(5))
        .cancel_grace(Duration::from_millis(500))
        .stalled_recovery_interval(Some(Duration::from_millis(500)))
        .poll_error_backoff_max(Duration::from_millis(500))
}

/// A running worker (startup finished: the flow is compiled, the worker registered).
pub(crate) struct Running(WorkerHandle);

impl Running {
    /// Requests shutdown and waits for the report.
    pub(crate) async fn stop(self) -> WorkerReport {
        tokio::time::timeout(LIMIT, self.0.stop())
            .await
            .expect("worker stops in time")
            .expect("worker result")
    }

    /// Waits until the worker stops on its own.
    pub(crate) async fn join(self) -> WorkerReport {
        tokio::time::timeout(LIMIT, self.0.join())
            .await
            .expect("worker stops in time")
            .expect("worker result")
    }
}

/// Starts a plain worker for `F` with fast settings.
pub(crate) async fn spawn<F: Flow>(pool: &PgPool) -> Running {
    spawn_with(fast(Worker::<F>::builder(pool.clone()))).await
}

/// Starts a configured worker.
pub(crate) async fn spawn_with<F: Flow>(builder: WorkerBuilder<F>) -> Running {
    let worker = builder.build().expect("valid config");
    Running(
        worker
            .spawn(CancellationToken::new())
            .await
            .expect("worker starts"),
    )
}

/// `pgflow.runs.status`.
pub(crate) async fn run_status(pool: &PgPool, run: Uuid) -> String {
    sqlx::query_scalar("select status from pgflow.runs where run_id = $1")
        .bind(run)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Waits until the run is no longer `started`; returns its status.
pub(crate) async fn wait_finished(pool: &PgPool, run: Uuid) -> String {
    pgflow_tests::wait_until(LIMIT, "the run to finish", || async {
        run_status(pool, run).await != "started"
    })
    .await;
    run_status(pool, run).await
}

/// `(status, attempts_count, error_message)` of one task.
pub(crate) async fn task(
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
    .unwrap()
}

/// Tasks of the run still `queued` or `started`.
pub(crate) async fn live_tasks(pool: &PgPool, run: Uuid) -> i64 {
    sqlx::query_scalar(
        "select count(*) from pgflow.step_tasks where run_id = $1 and status in ('queued', 'started')",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// `pgflow.step_states.status`.
pub(crate) async fn step_status(pool: &PgPool, run: Uuid, step: &str) -> String {
    sqlx::query_scalar("select status from pgflow.step_states where run_id = $1 and step_slug = $2")
        .bind(run)
        .bind(step)
        .fetch_one(pool)
        .await
        .unwrap()
}
