//! Helpers of the runtime tests: fast worker settings, spawning workers, waiting for them.
//!
//! Reading run, step and task rows is shared with the SQL tests ([`pgflow_tests::state`]) and
//! re-exported here.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use pgflow_runtime::{
    worker::DeploymentStatus, worker::WorkerBuilder, worker::WorkerError, worker::WorkerHandle,
    worker::WorkerReport, Flow, Worker,
};
pub(crate) use pgflow_tests::state::{
    active_tasks, run_output, run_status, step_status, task, wait_finished,
};
pub(crate) use pgflow_tests::LIMIT;
use sqlx::PgPool;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// A bounded wait: a test that awaits a worker's refusal fails after [`LIMIT`] when the refusal breaks,
/// instead of hanging with a worker that runs.
pub(crate) trait Bounded: std::future::Future + Sized {
    /// Awaits `self` for at most [`LIMIT`]; panics after it.
    async fn bounded(self) -> Self::Output {
        tokio::time::timeout(LIMIT, self).await.expect(
            "finished within the limit (a worker that should have refused to start is running)",
        )
    }
}

impl<F: std::future::Future> Bounded for F {}

/// Settings that keep tests fast.
pub(crate) fn fast<K>(b: WorkerBuilder<K>) -> WorkerBuilder<K> {
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
    /// The worker id.
    pub(crate) fn id(&self) -> uuid::Uuid {
        self.0.id()
    }

    /// What startup did with each deployment.
    pub(crate) fn deployments(&self) -> &[DeploymentStatus] {
        self.0.deployments()
    }

    /// Requests shutdown and waits for the report.
    pub(crate) async fn stop(self) -> WorkerReport {
        tokio::time::timeout(LIMIT, self.0.stop())
            .await
            .expect("worker stops in time")
            .expect("worker result")
    }

    /// Waits until the worker stops on its own, with its error if it stopped on one.
    pub(crate) async fn outcome(self) -> Result<WorkerReport, WorkerError> {
        tokio::time::timeout(LIMIT, self.0.join())
            .await
            .expect("worker stops in time")
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
pub(crate) async fn spawn_with<K>(builder: WorkerBuilder<K>) -> Running {
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

/// The (flow, step) pairs a worker registered (`pgflow.worker_routes`), sorted.
pub(crate) async fn registered_pairs(pool: &PgPool, worker: uuid::Uuid) -> Vec<(String, String)> {
    sqlx::query_as(
        "select flow_slug, step_slug from pgflow.worker_routes where worker_id = $1 \
         order by flow_slug, step_slug",
    )
    .bind(worker)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Whether a `pgflow.workers` row exists for the worker.
pub(crate) async fn is_registered(pool: &PgPool, worker: uuid::Uuid) -> bool {
    sqlx::query_scalar("select exists (select 1 from pgflow.workers where worker_id = $1)")
        .bind(worker)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The concrete slug an alias points at, if it exists.
pub(crate) async fn alias_target(pool: &PgPool, alias: &str) -> Option<String> {
    sqlx::query_scalar("select flow_slug from pgflow.flow_aliases where alias = $1")
        .bind(alias)
        .fetch_optional(pool)
        .await
        .unwrap()
}

/// In-flight handler counts of one step, and the most seen at once.
pub(crate) struct Gauge {
    now: AtomicUsize,
    max: AtomicUsize,
    /// Opens once two holders have overlapped.
    overlapped: Semaphore,
}

impl Gauge {
    pub(crate) const fn new() -> Self {
        Gauge {
            now: AtomicUsize::new(0),
            max: AtomicUsize::new(0),
            overlapped: Semaphore::const_new(0),
        }
    }

    /// Counts one more holder until the guard drops.
    pub(crate) fn enter(&'static self) -> GaugeGuard {
        let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        if self.max.fetch_max(now, Ordering::SeqCst) < 2 && now >= 2 {
            self.overlapped.add_permits(Semaphore::MAX_PERMITS);
        }
        GaugeGuard(self)
    }

    /// Waits (at most `limit`) until two holders have overlapped once.
    pub(crate) async fn overlap(&self, limit: Duration) {
        let _ = tokio::time::timeout(limit, self.overlapped.acquire()).await;
    }

    /// The most holders seen at once.
    pub(crate) fn max(&self) -> usize {
        self.max.load(Ordering::SeqCst)
    }
}

/// One holder of a [`Gauge`], counted until dropped.
pub(crate) struct GaugeGuard(&'static Gauge);

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.now.fetch_sub(1, Ordering::SeqCst);
    }
}
