//! Workers: [`Worker`] runs every step of a flow from its queue; a step worker (from
//! [`StepQueued::worker`](crate::StepQueued::worker)) runs one step from its private queue; a
//! [`QueueWorker`] polls one declared [`Queue`] and runs the steps that several deployments
//! route there.
//!
//! Inside, every worker is one queue and a registry of deployments it serves there (`registry`); startup
//! checks the registry, compiles, checks coverage and registers (`startup`); `serve` claims (`claim`), runs
//! (`execute`) and records (`record`) until it stops, with heartbeats and maintenance beside it (`background`)
//! and one retry policy (`retry`).

mod answers;
mod background;
mod batch;
pub(crate) mod claim;
mod connect;
mod drive;
mod error;
mod execute;
mod record;
mod registry;
mod report;
mod result;
mod retry;
mod revoke;
mod serve;
mod startup;

use std::fmt;
use std::marker::PhantomData;
use std::time::Duration;

use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

pub use crate::config::{Compilation, ConfigError, WorkerConfig};
pub use error::{CoverageGap, GapReason, UnsupportedBatch, WorkerError};
pub use report::{AliasActivation, CompileStatus, DeploymentStatus, StopReason, WorkerReport};

use crate::deployments::{Deployment, Queue, RoutesTo};
use crate::flows::Flow;
use registry::{DefaultDeployment, Registry};

/// What a queue worker runs: the deployments served on queue `Q`. The `K` of [`Worker<K>`] and
/// [`WorkerBuilder<K>`] for a [`QueueWorker<Q>`]; never built.
pub struct OnQueue<Q>(PhantomData<fn() -> Q>);

impl<Q> fmt::Debug for OnQueue<Q> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("OnQueue")
    }
}

/// Where a zero-configuration worker gets its connections: a pool it opens on `DATABASE_URL` when it runs
/// (the `C` of a [`WorkerBuilder`] from `QueueWorker::builder_from_env`, `Worker::builder_from_env` or
/// [`StepWorkerSpec::run`](crate::step_queued::StepWorkerSpec::run)). The pool has
/// [`WorkerConfig::pool_size`] connections.
#[derive(Debug, Clone, Copy, Default)]
pub struct FromEnv;

/// A worker that polls the declared queue `Q` and runs the steps of every deployment it serves there, of
/// several concrete flows (for example two versions of one flow while the older drains, or several flows
/// sharing a queue).
///
/// ```no_run
/// use pgflow_runtime::{deployment, flow, queue, QueueWorker};
///
/// #[flow(slug = "communityThreadsV1", input = String)]
/// mod community_v1 {
///     use pgflow_runtime::StepError;
///     #[step]
///     async fn classify(text: String) -> Result<String, StepError> { Ok(text) }
/// }
///
/// #[flow(slug = "communityThreadsV2", input = String)]
/// mod community_v2 {
///     use pgflow_runtime::StepError;
///     #[step]
///     async fn classify(text: String) -> Result<String, StepError> { Ok(text.to_lowercase()) }
/// }
///
/// #[queue("classify_threads")]
/// pub struct ClassifyThreads;
///
/// #[deployment(alias = "communityThreads", name = CommunityV1Deployment)]
/// pub fn community_v1(step: community_v1::Step) {
///     match step {
///         community_v1::Step::Classify => ClassifyThreads,
///     }
/// }
///
/// #[deployment(alias = "communityThreads", name = CommunityV2Deployment)]
/// pub fn community_v2(step: community_v2::Step) {
///     match step {
///         community_v2::Step::Classify => ClassifyThreads,
///     }
/// }
///
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// // V1 drains while V2, served last, is the version the alias starts.
/// QueueWorker::<ClassifyThreads>::builder(pool)
///     .serve::<CommunityV1Deployment>()
///     .serve::<CommunityV2Deployment>()
///     .max_concurrent(4)
///     .build()?
///     .run_until_signal()
///     .await?;
/// # Ok(()) }
/// ```
pub type QueueWorker<Q> = Worker<OnQueue<Q>>;

/// Builds a [`Worker`]; every setting has a default (see [`WorkerConfig`]).
///
/// `K` is what the worker runs (a flow `F`, or [`OnQueue<Q>`] for a [`QueueWorker<Q>`]); `C` is where its
/// connections come from: the caller's [`PgPool`] (the default), or [`FromEnv`] for a zero-configuration
/// worker. The settings are the same for every kind.
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
pub struct WorkerBuilder<K, C = PgPool> {
    connection: C,
    registry: Registry,
    config: WorkerConfig,
    _kind: PhantomData<fn() -> K>,
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

impl<K, C> WorkerBuilder<K, C> {
    fn with(connection: C, registry: Registry) -> Self {
        WorkerBuilder {
            connection,
            registry,
            config: WorkerConfig::default(),
            _kind: PhantomData,
        }
    }

    /// A worker for the steps deployment `D` routes to `queue` (a step worker: one step's private queue).
    pub(crate) fn deployment<D: Deployment>(connection: C, queue: &str) -> Self {
        let mut registry = Registry::new(queue);
        registry.add::<D>();
        WorkerBuilder::with(connection, registry)
    }

    /// Replaces every setting at once.
    pub fn config(mut self, config: WorkerConfig) -> Self {
        self.config = config;
        self
    }

    setters! {
        /// Handlers running at once (default 10).
        max_concurrent: usize,
        /// Most messages one claim asks for, unless more handler slots are free (default 32).
        batch_size: usize,
        /// Results waiting to be recorded at most; claiming pauses at this many (default 128).
        max_unrecorded: usize,
        /// Wait after an empty read, doubling while idle (default 25 ms); queue signals wake an idle
        /// worker sooner.
        poll_interval: Duration,
        /// Longest wait between reads while idle (default 1 s).
        max_poll_wait: Duration,
        /// How far ahead a claim looks: it also asks for the tasks the handler slots are expected to
        /// finish within this window, by their average run time (default 100 ms; zero: only free slots).
        prefetch: Duration,
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
        /// Most runs deleted per retention batch; a sweep repeats full batches for up to one interval (default 1000).
        retention_batch: usize,
        /// Cap of the backoff after database errors (default 5 s).
        poll_error_backoff_max: Duration,
        /// Most outputs recorded per exchange (default 64).
        completion_batch_size: usize,
        /// Most exchanges (record outputs and claim, one round trip each) in flight at once (default 3),
        /// shared out among the live workers of the queue (each runs its share, rounded up, at least one);
        /// beyond the first, only with a backlog (`batch_size` outputs waiting, or a full claim after a
        /// full one).
        completion_flushers: usize,
        /// Startup compilation policy (default [`Compilation::Verify`]).
        compilation: Compilation,
        /// Install or upgrade the schema at startup (default `false`; refused with
        /// [`Pooling::Transaction`](crate::pooling::Pooling::Transaction), installing needs a direct connection).
        auto_install: bool,
        /// How the pool reaches PostgreSQL (default [`Pooling::Direct`](crate::pooling::Pooling::Direct));
        /// [`Pooling::transaction()`](crate::pooling::Pooling::transaction) behind PgBouncer in transaction mode.
        pooling: crate::pooling::Pooling,
        /// How often to fire due schedules, `None` to leave them to other workers (default 1 s).
        schedule_interval: Option<Duration>,
    }

    /// Declares a schedule: stored (or updated) at startup, before the worker claims anything; an invalid
    /// one fails startup with [`WorkerError::Schedule`].
    pub fn schedule(mut self, schedule: crate::schedules::Schedule) -> Self {
        self.config.schedules.push(schedule);
        self
    }

    /// The worker function (`pgflow.worker_functions.function_name`); default: the queue name.
    pub fn worker_name(mut self, name: impl Into<String>) -> Self {
        self.config.worker_name = Some(name.into());
        self
    }
}

impl<K> WorkerBuilder<K> {
    /// Validates the settings.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] naming the first invalid setting.
    pub fn build(self) -> Result<Worker<K>, ConfigError> {
        self.config.validate()?;
        Ok(Worker {
            pool: self.connection,
            registry: self.registry,
            config: self.config,
            worker_id: Uuid::new_v4(),
            _kind: PhantomData,
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

impl<K> WorkerBuilder<K, FromEnv> {
    /// Connects with `DATABASE_URL` (a pool of [`WorkerConfig::pool_size`] connections) and runs until
    /// SIGTERM or ctrl-c (see [`Worker::run_until_signal`]).
    ///
    /// ```no_run
    /// # use pgflow_runtime::{flow, StepError};
    /// # #[flow(slug = "greet", input = String)]
    /// # mod greet { use pgflow_runtime::StepError;
    /// #   #[step] async fn hello(name: String) -> Result<String, StepError> { Ok(name) } }
    /// # async fn demo() -> Result<(), pgflow_runtime::worker::WorkerError> {
    /// pgflow_runtime::Worker::<greet::Greet>::builder_from_env().max_concurrent(4).run().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`WorkerError::Config`] for an invalid setting, [`WorkerError::DatabaseUrlMissing`] or
    /// [`WorkerError::DatabaseUrlInvalid`] without a usable `DATABASE_URL`, [`WorkerError::Database`] when
    /// the database cannot be reached, then as [`Worker::run`].
    pub async fn run(self) -> Result<WorkerReport, WorkerError> {
        self.config.validate()?;
        let pool = connect::from_env(&self.config).await?;
        let WorkerBuilder {
            registry, config, ..
        } = self;
        let worker = WorkerBuilder::<K>::with(pool, registry)
            .config(config)
            .build()?;
        worker.run_until_signal().await
    }
}

impl<Q: Queue, C> WorkerBuilder<OnQueue<Q>, C> {
    /// Adds deployment `D` to the registry: the worker runs the steps `D` routes to `Q`, and compiles or
    /// verifies `D` at startup, activating its alias.
    ///
    /// Serve every version a queue still carries: the worker refuses to start while the queue can carry a
    /// (flow, step) pair it cannot run (see [`WorkerError::CoverageGap`]). Several deployments may share an
    /// alias (versions of one flow while the older drains): the one served **last** activates it, the others
    /// are compiled or verified only. `D` must route a step to `Q` ([`RoutesTo<Q>`]), or this does not
    /// compile.
    pub fn serve<D: RoutesTo<Q>>(mut self) -> Self {
        self.registry.add::<D>();
        self
    }
}

impl<K, C> fmt::Debug for WorkerBuilder<K, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkerBuilder")
            .field("queue", &self.registry.queue)
            .field("serves", &self.registry.describe())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// A configured worker; [`Worker::run`] starts it.
///
/// `K` is what it runs: a flow `F` ([`Worker::<F>::builder`](Worker::builder) for every step on the flow's
/// single queue, or a step worker from [`StepQueued::worker`](crate::StepQueued::worker)), or
/// [`OnQueue<Q>`] for a [`QueueWorker<Q>`]. Every kind is one queue and a registry of deployments (a plain
/// flow is its own default deployment), started, run and stopped the same way.
///
/// Startup, in this order, before the worker registers or claims: it checks the registry (each concrete flow
/// once, each routing a step to the queue), checks the schema, compiles or verifies every deployment
/// (`ensure_flow_compiled`, activating its alias) and its routes, derives the exact (flow, step) pairs of its
/// queue, refuses to start while the queue can carry a pair it cannot run
/// ([`WorkerError::CoverageGap`]), registers, and logs one banner. Compilation and alias activation commit
/// before registration. Then it claims continuously (each read asks for at most the free slots), runs
/// handlers concurrently, enforces each step's timeout, and records every outcome. Several workers (and
/// processes) may serve one queue.
pub struct Worker<K> {
    pool: PgPool,
    registry: Registry,
    config: WorkerConfig,
    worker_id: Uuid,
    _kind: PhantomData<fn() -> K>,
}

impl<F: Flow> Worker<F> {
    /// A worker for every step of `F`, on the flow's single queue. The pool stays the caller's.
    pub fn builder(pool: PgPool) -> WorkerBuilder<F> {
        WorkerBuilder::deployment::<DefaultDeployment<F>>(pool, &Self::queue_name())
    }

    /// A zero-configuration worker for every step of `F`: it connects with `DATABASE_URL` when it runs and
    /// runs until SIGTERM or ctrl-c. Settings can still be changed on the returned builder.
    pub fn builder_from_env() -> WorkerBuilder<F, FromEnv> {
        WorkerBuilder::deployment::<DefaultDeployment<F>>(FromEnv, &Self::queue_name())
    }

    fn queue_name() -> String {
        pgflow_sql::names::default_queue_name(F::SLUG)
    }
}

impl<Q: Queue> Worker<OnQueue<Q>> {
    /// A worker polling queue `Q`, with no deployment yet: add each with
    /// [`serve`](WorkerBuilder::serve). The pool stays the caller's; it is the queue's connections.
    pub fn builder(pool: PgPool) -> WorkerBuilder<OnQueue<Q>> {
        WorkerBuilder::with(pool, Registry::new(Q::NAME))
    }

    /// A zero-configuration worker polling queue `Q`: add deployments with
    /// [`serve`](WorkerBuilder::serve), then [`run`](WorkerBuilder::run) connects with `DATABASE_URL` and
    /// runs until SIGTERM or ctrl-c.
    ///
    /// ```no_run
    /// # use pgflow_runtime::{deployment, flow, queue};
    /// # #[flow(slug = "communityThreadsV1", input = String)]
    /// # mod community_v1 { use pgflow_runtime::StepError;
    /// #   #[step] async fn classify(text: String) -> Result<String, StepError> { Ok(text) } }
    /// # #[queue("classify_threads")]
    /// # pub struct ClassifyThreads;
    /// # #[deployment(alias = "communityThreads", name = CommunityV1Deployment)]
    /// # pub fn community_v1(step: community_v1::Step) {
    /// #     match step { community_v1::Step::Classify => ClassifyThreads }
    /// # }
    /// use pgflow_runtime::QueueWorker;
    ///
    /// # async fn demo() -> Result<(), pgflow_runtime::worker::WorkerError> {
    /// QueueWorker::<ClassifyThreads>::builder_from_env().serve::<CommunityV1Deployment>().run().await?;
    /// # Ok(()) }
    /// ```
    pub fn builder_from_env() -> WorkerBuilder<OnQueue<Q>, FromEnv> {
        WorkerBuilder::with(FromEnv, Registry::new(Q::NAME))
    }
}

impl<K> Worker<K> {
    /// This worker's id (`pgflow.workers.worker_id`).
    pub fn id(&self) -> Uuid {
        self.worker_id
    }

    /// The settings.
    pub fn config(&self) -> &WorkerConfig {
        &self.config
    }

    /// The queue this worker polls.
    pub fn queue(&self) -> &str {
        &self.registry.queue
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
    /// A startup failure (the registry's own rules, schema, [`WorkerError::ShapeMismatch`], routing and
    /// queue checks, [`WorkerError::CoverageGap`], a disabled function, a database error), or
    /// [`WorkerError::Unsupported`] when the worker met messages it must not run. Database errors while
    /// running are retried with backoff.
    pub async fn run(self, shutdown: CancellationToken) -> Result<WorkerReport, WorkerError> {
        let ready = self.prepare().await?;
        serve::serve(ready, shutdown).await
    }

    async fn prepare(self) -> Result<serve::Ready, WorkerError> {
        serve::prepare(self.pool, self.registry, self.config, self.worker_id).await
    }

    /// Runs startup here (so its errors are returned, and the flows are compiled and the worker
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
        let deployments = ready.prepared.deployments.clone();
        let token = shutdown.clone();
        let join = tokio::spawn(serve::serve(ready, shutdown));
        Ok(WorkerHandle {
            worker_id,
            deployments,
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

impl<K> fmt::Debug for Worker<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Worker")
            .field("worker_id", &self.worker_id)
            .field("queue", &self.registry.queue)
            .field("serves", &self.registry.describe())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// A worker serving in a background task (from [`Worker::spawn`]).
#[derive(Debug)]
pub struct WorkerHandle {
    worker_id: Uuid,
    deployments: Vec<DeploymentStatus>,
    token: CancellationToken,
    join: JoinHandle<Result<WorkerReport, WorkerError>>,
}

impl WorkerHandle {
    /// The worker id.
    pub fn id(&self) -> Uuid {
        self.worker_id
    }

    /// What startup did with each deployment (compile status, alias activation), in registry order.
    pub fn deployments(&self) -> &[DeploymentStatus] {
        &self.deployments
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
