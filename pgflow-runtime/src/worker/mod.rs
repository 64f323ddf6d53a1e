//! Workers: [`Worker`] runs every step of a flow from its queue; a step worker (from
//! [`StepQueued::worker`](crate::StepQueued::worker)) runs one step from its private queue.
//!
//! Inside, a worker is one queue and the steps it serves there (`subscription`); startup compiles and
//! registers (`startup`); `serve` claims (`claim`), runs (`execute`) and records (`record`) until it stops,
//! with heartbeats and maintenance beside it (`background`) and one retry policy (`retry`).

mod background;
mod claim;
mod error;
mod execute;
mod record;
mod retry;
mod serve;
mod startup;
mod subscription;

use std::fmt;
use std::marker::PhantomData;
use std::time::Duration;

use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

pub use crate::config::{Compilation, ConfigError, WorkerConfig};
pub use error::{UnsupportedBatch, WorkerError};

use crate::flow::Flow;
pub(crate) use subscription::FlowEntry;
use subscription::Subscription;

/// Builds a [`Worker`]; every setting has a default (see [`WorkerConfig`]).
///
/// ```no_run
/// # use pgflow_runtime::{flow, StepError};
/// # #[flow(slug = "greet", input = String)]
/// # mod greet { use pgflow_runtime::StepError;
/// #   #[step] async fn hello(name: String) -> Result<String, StepError> { Ok(format!("hello {name}")) } }
/// use pgflow_runtime::worker::Worker;
/// use std::time::Duration;
///
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let report = Worker::<greet::Greet>::builder(pool)
///     .max_concurrent(16)
///     .shutdown_grace(Duration::from_secs(10))
///     .build()?
///     .run_until_signal()
///     .await?;
/// println!("stopped: {:?}", report.stop_reason);
/// # Ok(()) }
/// ```
#[must_use = "a builder does nothing until `build` and `run`"]
pub struct WorkerBuilder<F: Flow> {
    pool: PgPool,
    entry: FlowEntry,
    config: WorkerConfig,
    _flow: PhantomData<fn() -> F>,
}

macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident: $ty:ty),* $(,)?) => {$(
        $(#[$doc])*
        pub fn $name(mut self, value: $ty) -> Self {
            self.config.$name = value;
            self
        }
    )*};
}

impl<F: Flow> WorkerBuilder<F> {
    pub(crate) fn new(pool: PgPool, entry: FlowEntry) -> Self {
        WorkerBuilder {
            pool,
            entry,
            config: WorkerConfig::default(),
            _flow: PhantomData,
        }
    }

    /// Replaces every setting at once.
    pub fn config(mut self, config: WorkerConfig) -> Self {
        self.config = config;
        self
    }

    setters! {
        /// Handlers running at once (default 10).
        max_concurrent: usize,
        /// Most messages one read asks for (default 10).
        batch_size: usize,
        /// Results waiting to be recorded at most; claiming pauses at this many (default 128).
        max_unrecorded: usize,
        /// Wait after an empty read, doubling while idle (default 50 ms).
        poll_interval: Duration,
        /// Longest wait between reads while idle (default 250 ms).
        max_poll_wait: Duration,
        /// Visibility of a read message until its claim (default 5 s, whole seconds).
        read_visibility: Duration,
        /// Heartbeat period (default 2 s).
        heartbeat_interval: Duration,
        /// A worker silent for longer is dead and its tasks are requeued, `None` to leave that to
        /// stalled recovery (default 10 s).
        dead_worker_timeout: Option<Duration>,
        /// Time in-flight handlers get on shutdown (default 30 s).
        shutdown_grace: Duration,
        /// Time cancelled handlers get after the grace (default 2 s).
        cancel_grace: Duration,
        /// Maintenance period (recovery and retention), `None` to leave it to others (default 5 s).
        maintenance_interval: Option<Duration>,
        /// Age at which finished history is deleted, `None` to keep everything (default 7 days).
        retention: Option<Duration>,
        /// Most runs deleted per maintenance sweep (default 1000).
        retention_batch: usize,
        /// Cap of the backoff after database errors (default 5 s).
        poll_error_backoff_max: Duration,
        /// Most outputs recorded per `complete_tasks` call (default 64).
        completion_batch_size: usize,
        /// `complete_tasks` calls in flight at once (default 4).
        completion_flushers: usize,
        /// Startup compilation policy (default [`Compilation::Verify`]).
        compilation: Compilation,
        /// Install or upgrade the schema at startup (default `false`).
        auto_install: bool,
    }

    /// The worker function (`pgflow.worker_functions.function_name`); default: the queue name.
    pub fn worker_name(mut self, name: impl Into<String>) -> Self {
        self.config.worker_name = Some(name.into());
        self
    }

    /// Validates the settings.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] naming the first invalid setting.
    pub fn build(self) -> Result<Worker<F>, ConfigError> {
        self.config.validate()?;
        Ok(Worker {
            pool: self.pool,
            subscription: Subscription::single(self.entry),
            config: self.config,
            worker_id: Uuid::new_v4(),
            _flow: PhantomData,
        })
    }

    /// Builds and runs until `shutdown` fires (see [`Worker::run`]).
    ///
    /// # Errors
    ///
    /// See [`Worker::run`]; an invalid setting is [`WorkerError::Config`].
    pub async fn run(self, shutdown: CancellationToken) -> Result<WorkerReport, WorkerError> {
        self.build()?.run(shutdown).await
    }
}

impl<F: Flow> fmt::Debug for WorkerBuilder<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkerBuilder")
            .field("flow", &F::SLUG)
            .field("step", &self.entry.served_step)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// A configured worker; [`Worker::run`] starts it.
///
/// Startup checks the schema, compiles or verifies the flow (`ensure_flow_compiled`), registers
/// the worker function and the worker, and logs one banner. Then it claims continuously (each
/// read asks for at most the free slots), runs handlers concurrently, enforces each step's
/// timeout, and records every outcome. Several workers (and processes) may serve one queue.
pub struct Worker<F: Flow> {
    pool: PgPool,
    subscription: Subscription,
    config: WorkerConfig,
    worker_id: Uuid,
    _flow: PhantomData<fn() -> F>,
}

impl<F: Flow> Worker<F> {
    /// A worker for every step of `F`, on the flow's single queue. The pool stays the caller's.
    pub fn builder(pool: PgPool) -> WorkerBuilder<F> {
        WorkerBuilder::new(pool, FlowEntry::plain::<F>())
    }

    /// This worker's id (`pgflow.workers.worker_id`).
    pub fn id(&self) -> Uuid {
        self.worker_id
    }

    /// The settings.
    pub fn config(&self) -> &WorkerConfig {
        &self.config
    }

    /// Runs until `shutdown` fires, the worker is deprecated or its function disabled.
    ///
    /// On stop it claims nothing more, lets in-flight handlers finish within `shutdown_grace`,
    /// then cancels the rest (their tokens fire; after `cancel_grace` they are dropped), records
    /// every finished outcome, hands back unfinished tasks (queued again at once, attempt not
    /// consumed) and marks the worker stopped. The pool is never closed.
    ///
    /// # Errors
    ///
    /// A startup failure (schema, [`WorkerError::ShapeMismatch`], queue checks, a disabled
    /// function, a database error), or [`WorkerError::Unsupported`] when the worker met
    /// messages it must not run. Database errors while running are retried with backoff.
    pub async fn run(self, shutdown: CancellationToken) -> Result<WorkerReport, WorkerError> {
        let ready = self.prepare().await?;
        serve::serve(ready, shutdown).await
    }

    async fn prepare(self) -> Result<serve::Ready, WorkerError> {
        serve::prepare(self.pool, self.subscription, self.config, self.worker_id).await
    }

    /// Runs startup here (so its errors are returned, and the flow is compiled and the worker
    /// registered when this returns), then serves in a background task until `shutdown` fires.
    ///
    /// ```no_run
    /// # use pgflow_runtime::{flow, StepError};
    /// # #[flow(slug = "greet", input = String)]
    /// # mod greet { use pgflow_runtime::StepError;
    /// #   #[step] async fn hello(name: String) -> Result<String, StepError> { Ok(name) } }
    /// use pgflow_runtime::{Client, Worker};
    /// use std::time::Duration;
    /// use tokio_util::sync::CancellationToken;
    ///
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// let worker = Worker::<greet::Greet>::builder(pool.clone())
    ///     .build()?
    ///     .spawn(CancellationToken::new())
    ///     .await?;
    /// let run = Client::new(pool).start::<greet::Greet>(&"Ada".into()).await?;
    /// run.wait(Duration::from_secs(10)).await?;
    /// let report = worker.stop().await?;
    /// # let _ = report; Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// Startup errors, as for [`Worker::run`].
    pub async fn spawn(self, shutdown: CancellationToken) -> Result<WorkerHandle, WorkerError> {
        let worker_id = self.worker_id;
        let ready = self.prepare().await?;
        let token = shutdown.clone();
        let join = tokio::spawn(serve::serve(ready, shutdown));
        Ok(WorkerHandle {
            worker_id,
            token,
            join,
        })
    }

    /// [`Worker::run`] until SIGTERM or ctrl-c.
    ///
    /// # Errors
    ///
    /// See [`Worker::run`].
    pub async fn run_until_signal(self) -> Result<WorkerReport, WorkerError> {
        let token = CancellationToken::new();
        let trigger = token.clone();
        let watcher = tokio::spawn(async move {
            shutdown_signal().await;
            trigger.cancel();
        });
        let result = self.run(token).await;
        watcher.abort();
        result
    }
}

impl<F: Flow> fmt::Debug for Worker<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Worker")
            .field("flow", &F::SLUG)
            .field("worker_id", &self.worker_id)
            .field("queue", &self.subscription.queue)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// A worker serving in a background task (from [`Worker::spawn`]).
#[derive(Debug)]
pub struct WorkerHandle {
    worker_id: Uuid,
    token: CancellationToken,
    join: JoinHandle<Result<WorkerReport, WorkerError>>,
}

impl WorkerHandle {
    /// The worker id.
    pub fn id(&self) -> Uuid {
        self.worker_id
    }

    /// Requests shutdown without waiting.
    pub fn shutdown(&self) {
        self.token.cancel();
    }

    /// Requests shutdown and waits until the worker has stopped.
    ///
    /// # Errors
    ///
    /// See [`WorkerHandle::join`].
    pub async fn stop(self) -> Result<WorkerReport, WorkerError> {
        self.token.cancel();
        self.join().await
    }

    /// Waits until the worker stops on its own (shutdown token, deprecation, disabled function).
    ///
    /// # Errors
    ///
    /// The worker's fatal error; a panic inside the worker task is resumed here.
    pub async fn join(self) -> Result<WorkerReport, WorkerError> {
        match self.join.await {
            Ok(result) => result,
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
    }
}

/// Resolves on SIGTERM (Unix) or ctrl-c.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => return ctrl_c.await,
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    ctrl_c.await;
}

/// Why a worker stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StopReason {
    /// The shutdown token fired.
    Shutdown,
    /// `pgflow.workers.deprecated_at` was set.
    Deprecated,
    /// The worker function was disabled.
    Disabled,
}

/// What startup compilation did with a flow (`pgflow.ensure_flow_compiled`'s status).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CompileStatus {
    /// The flow did not exist and was created.
    Compiled,
    /// The stored flow matched this build.
    Verified,
    /// The stored flow differed and was replaced (a local database, or `Compilation::AllowDataLoss`).
    Recompiled,
    /// Compilation was skipped (`Compilation::Skip`).
    Skipped,
}

impl CompileStatus {
    /// The SQL status text (`compiled`, `verified`, `recompiled`) or `skipped`.
    pub const fn as_str(self) -> &'static str {
        match self {
            CompileStatus::Compiled => "compiled",
            CompileStatus::Verified => "verified",
            CompileStatus::Recompiled => "recompiled",
            CompileStatus::Skipped => "skipped",
        }
    }
}

impl fmt::Display for CompileStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a worker did, returned when it stops cleanly.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct WorkerReport {
    /// The worker id.
    pub worker_id: Uuid,
    /// Why it stopped.
    pub stop_reason: StopReason,
    /// What startup compilation did with the flow.
    pub compile_status: CompileStatus,
    /// Tasks whose output was recorded.
    pub completed: u64,
    /// Tasks whose failure was recorded (retried or not).
    pub failed: u64,
    /// Results ignored as stale: the task had moved on to another attempt (or finished) meanwhile.
    pub stale: u64,
    /// Unfinished tasks handed back at shutdown.
    pub released: u64,
}
