//! Helpers of the runtime tests: fast worker settings, spawning workers, waiting for them.
//!
//! Reading run, step and task rows is shared with the SQL tests ([`pgflow_tests::state`]) and
//! re-exported here.

use std::time::Duration;

use pgflow_runtime::{Flow, Worker, WorkerBuilder, WorkerHandle, WorkerReport};
pub(crate) use pgflow_tests::state::{
    active_tasks, run_output, run_status, step_status, task, wait_finished,
};
pub(crate) use pgflow_tests::LIMIT;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// Settings that keep tests fast.
pub(crate) fn fast<F: Flow>(b: WorkerBuilder<F>) -> WorkerBuilder<F> {
    b.poll_interval(Duration::from_millis(10))
        .max_poll_wait(Duration::from_millis(50))
        .heartbeat_interval(Duration::from_millis(100))
        .shutdown_grace(Duration::from_secs(5))
        .cancel_grace(Duration::from_millis(500))
        .maintenance_interval(Some(Duration::from_millis(500)))
        .dead_worker_timeout(Some(Duration::from_secs(1)))
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

/// Waits until `count` workers are registered (spawned here or by a child process).
pub(crate) async fn wait_for_workers(pool: &PgPool, count: i64) {
    let what = format!("{count} registered worker(s)");
    pgflow_tests::wait_until(LIMIT, &what, || async {
        sqlx::query_scalar::<_, i64>("select count(*) from pgflow.workers")
            .fetch_one(pool)
            .await
            .expect("count workers")
            == count
    })
    .await;
}

/// Compiles `F` as a plain flow (what a worker's startup does), so runs can start before any worker.
pub(crate) async fn compile<F: Flow>(pool: &PgPool) {
    let result: serde_json::Value =
        sqlx::query_scalar("select pgflow.ensure_flow_compiled(flow_slug => $1, shape => $2)")
            .bind(F::SLUG)
            .bind(F::shape())
            .fetch_one(pool)
            .await
            .unwrap();
    assert_ne!(result["status"], "mismatch", "{result}");
}
