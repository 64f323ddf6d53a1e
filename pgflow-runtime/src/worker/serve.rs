//! The worker's life after startup: the background duties, the driver (claims, handlers, results and
//! the stop, see `drive.rs`), handing back what is left, and the report.

use crate::observability::worker::WorkerMetrics;
use crate::pooling::run;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::background::{self, Maintenance};
use super::background::{OwnBackends, Peers};
use super::claim::{Claimer, Unsupported};
use super::drive::{Driver, Fatal};
use super::error::{Context, UnsupportedBatch, WorkerError};
use super::execute::Shared;
use super::record::{Pending, Recorder, Stats};
use super::registry::Registry;
use super::result::TaskResult;
use super::revoke::{self, Revocations};
use super::startup::{self, Prepared};
use super::{StopReason, WorkerReport};
use crate::config::WorkerConfig;
use crate::statements;

/// A worker whose startup succeeded: compiled, registered, not yet claiming.
pub(crate) struct Ready {
    pub(crate) pool: PgPool,
    pub(crate) registry: Arc<Registry>,
    pub(crate) config: WorkerConfig,
    pub(crate) worker_id: Uuid,
    pub(crate) prepared: Prepared,
}

/// Startup (see [`startup::prepare`]) and the banner.
pub(crate) async fn prepare(
    pool: PgPool,
    registry: Registry,
    config: WorkerConfig,
    worker_id: Uuid,
) -> Result<Ready, WorkerError> {
    let prepared = startup::prepare(&pool, &registry, &config, worker_id).await?;
    for schedule in &config.schedules {
        schedule
            .set_with(&pool, config.pooling.is_transaction())
            .await?;
    }
    let deployments: Vec<String> = prepared
        .deployments
        .iter()
        .map(ToString::to_string)
        .collect();
    tracing::info!(
        %worker_id,
        worker_name = %prepared.function_name,
        queue = %registry.queue,
        deployments = %deployments.join("; "),
        max_concurrent = config.max_concurrent,
        batch_size = config.batch_size,
        "pgflow worker started"
    );
    for flow in &registry.flows {
        if !flow.serves_whole_flow() {
            startup::log_uncovered_routes(&pool, config.pooling.is_transaction(), flow.slug).await;
        }
    }
    Ok(Ready {
        pool,
        registry: Arc::new(registry),
        config,
        worker_id,
        prepared,
    })
}

/// Claims, runs and records until `shutdown` fires (or deprecation, the fence, a fatal claim), then stops.
pub(crate) async fn serve(
    ready: Ready,
    shutdown: CancellationToken,
) -> Result<WorkerReport, WorkerError> {
    let Ready {
        pool,
        registry,
        config,
        worker_id,
        prepared,
    } = ready;
    let stats = Arc::new(Stats::default());
    let wake = Arc::new(Notify::new());
    let own = OwnBackends::new(config.pooling.is_transaction());
    let peers = Peers::default();

    // Claiming stops when `stop` fires: shutdown, deprecation, a disabled function, a fatal claim.
    let stop = shutdown.child_token();
    let reason: Arc<Mutex<Option<StopReason>>> = Arc::new(Mutex::new(None));
    let background_done = CancellationToken::new();
    let revocations = Revocations::default();
    let background = spawn_background(
        &pool,
        worker_id,
        &config,
        &registry.queue,
        &wake,
        (&own, &peers),
        &stop,
        &reason,
        &background_done,
        &revocations,
    );

    let (driver, claimer, results) = driver(
        &pool,
        &registry,
        &config,
        worker_id,
        &stats,
        stop,
        &reason,
        wake,
        (own, peers),
        revocations,
    );
    let fatal = driver.run(results).await;
    background_done.cancel();
    for handle in background {
        let _ = handle.await;
    }
    let released = release(&pool, config.pooling.is_transaction(), worker_id).await;
    finish(&pool, &claimer, prepared, fatal, &reason, &stats, released).await
}

/// The driver and its parts: the recorder, the handlers' shared state, the claimer.
#[allow(clippy::too_many_arguments)]
fn driver(
    pool: &PgPool,
    registry: &Arc<Registry>,
    config: &WorkerConfig,
    worker_id: Uuid,
    stats: &Arc<Stats>,
    stop: CancellationToken,
    reason: &Arc<Mutex<Option<StopReason>>>,
    wake: Arc<Notify>,
    (own, peers): (OwnBackends, Peers),
    revocations: Revocations,
) -> (Driver, Arc<Claimer>, mpsc::UnboundedReceiver<TaskResult>) {
    let pending: Pending = Arc::default();
    let (tx, rx) = mpsc::unbounded_channel();
    let (flow_slugs, step_slugs) = registry.pairs();
    let metrics = Arc::new(WorkerMetrics::new(
        &registry.queue,
        &flow_slugs,
        &step_slugs,
    ));
    let recorder = Arc::new(Recorder {
        metrics: Arc::clone(&metrics),
        pool: pool.clone(),
        worker_id,
        backoff_max: config.poll_error_backoff_max,
        stats: Arc::clone(stats),
        pending: Arc::clone(&pending),
        pooled: config.pooling.is_transaction(),
    });
    let shared = Arc::new(Shared {
        pool: pool.clone(),
        registry: Arc::clone(registry),
        handlers: CancellationToken::new(),
        // Within the claim visibility buffer (2 s), so the failure lands before the message reappears.
        timeout_cancel_wait: config.cancel_grace.min(Duration::from_secs(1)),
        results: tx,
        pending,
        pooled: config.pooling.is_transaction(),
        revocations,
        metrics,
        #[cfg(feature = "otel")]
        worker_id,
    });
    let claimer = Arc::new(Claimer {
        queue: registry.queue.clone(),
        flow_slugs,
        step_slugs,
        read_visibility_secs: i32::try_from(config.read_visibility.as_secs())
            .unwrap_or(i32::MAX)
            .max(1),
        worker_id,
        pooled: config.pooling.is_transaction(),
    });

    let driver = Driver {
        pool: pool.clone(),
        claimer: Arc::clone(&claimer),
        config: config.clone(),
        shared,
        recorder,
        stop,
        reason: Arc::clone(reason),
        wake,
        own,
        peers,
    };
    (driver, claimer, rx)
}

/// After the driver: a fatal claim disables the function; the worker is marked stopped; the report.
async fn finish(
    pool: &PgPool,
    claimer: &Claimer,
    prepared: Prepared,
    fatal: Option<Fatal>,
    reason: &Mutex<Option<StopReason>>,
    stats: &Stats,
    released: u64,
) -> Result<WorkerReport, WorkerError> {
    let worker_id = claimer.worker_id;
    let unsupported = match fatal {
        Some(Fatal(u)) => Some(unsupported(pool, claimer, &prepared.function_name, u).await?),
        None => None,
    };
    run!(
        claimer.pooled,
        pool,
        sqlx::query(statements::MARK_WORKER_STOPPED).bind(worker_id),
        execute
    )
    .await
    .during("marking the worker stopped")?;
    if let Some(err) = unsupported {
        return Err(err);
    }
    let stop_reason = reason
        .lock()
        .expect("stop reason lock")
        .unwrap_or(StopReason::Shutdown);
    let report = WorkerReport {
        worker_id,
        stop_reason,
        compile_status: prepared
            .deployments
            .first()
            .map_or(super::CompileStatus::Skipped, |d| d.compile_status),
        deployments: prepared.deployments,
        completed: stats.completed.load(Ordering::Relaxed),
        failed: stats.failed.load(Ordering::Relaxed),
        stale: stats.stale.load(Ordering::Relaxed),
        deferred: stats.deferred.load(Ordering::Relaxed),
        released,
    };
    tracing::info!(%worker_id, queue = %claimer.queue, reason = ?report.stop_reason, completed = report.completed,
        failed = report.failed, stale = report.stale, deferred = report.deferred, released = report.released,
        "pgflow worker stopped");
    Ok(report)
}

#[allow(clippy::too_many_arguments)]
fn spawn_background(
    pool: &PgPool,
    worker_id: Uuid,
    config: &WorkerConfig,
    queue: &str,
    wake: &Arc<Notify>,
    (own, peers): (&OwnBackends, &Peers),
    stop: &CancellationToken,
    reason: &Arc<Mutex<Option<StopReason>>>,
    done: &CancellationToken,
    revocations: &Revocations,
) -> Vec<JoinHandle<()>> {
    let mut handles = Vec::new();
    handles.push(tokio::spawn(revoke::watch(
        pool.clone(),
        config.pooling.is_transaction(),
        revocations.clone(),
        done.clone(),
    )));
    {
        let (stop, reason, done) = (stop.clone(), Arc::clone(reason), done.clone());
        let beat = background::Beat {
            pool: pool.clone(),
            pooled: config.pooling.is_transaction(),
            worker_id,
            interval: config.heartbeat_interval,
            peers: peers.clone(),
        };
        handles.push(tokio::spawn(async move {
            background::heartbeat(beat, stop, &reason, done).await;
        }));
    }
    // Behind a transaction pooler without a direct connection nothing listens: the driver polls.
    if let Some(direct) = config.pooling.listen_on() {
        let options = direct.map_or_else(|| pool.connect_options().as_ref().clone(), Clone::clone);
        handles.push(tokio::spawn(background::listen(
            options,
            queue.to_owned(),
            Arc::clone(wake),
            own.clone(),
            done.clone(),
        )));
    }
    if let Some(interval) = config.schedule_interval {
        handles.push(tokio::spawn(crate::schedules::tick(
            pool.clone(),
            config.pooling.is_transaction(),
            interval,
            done.clone(),
        )));
    }
    if let Some(interval) = config.maintenance_interval {
        handles.push(tokio::spawn(background::maintain(
            pool.clone(),
            Maintenance {
                interval,
                dead_after: config.dead_worker_timeout,
                retention: config.retention,
                retention_batch: config.retention_batch,
                pooled: config.pooling.is_transaction(),
            },
            done.clone(),
        )));
    }
    handles
}

/// Hands back unfinished tasks (queued again at once, attempt not consumed); 0 when the database cannot
/// be reached in time, in which case recovery requeues them once this worker's heartbeat is missed.
async fn release(pool: &PgPool, pooled: bool, worker_id: Uuid) -> u64 {
    let call = run!(
        pooled,
        pool,
        sqlx::query_scalar::<_, i32>(statements::RELEASE_WORKER_TASKS).bind(worker_id),
        fetch_one
    );
    match tokio::time::timeout(Duration::from_secs(10), call).await {
        Ok(Ok(n)) => {
            if n > 0 {
                tracing::warn!(%worker_id, released = n, "handed back unfinished tasks");
            }
            u64::try_from(n).unwrap_or(0)
        }
        Ok(Err(e)) => {
            tracing::warn!(%worker_id, error = %e, "cannot hand back unfinished tasks; recovery will requeue them");
            0
        }
        Err(_) => {
            tracing::warn!(%worker_id, "handing back unfinished tasks timed out; recovery will requeue them");
            0
        }
    }
}

/// The fatal path of the classifying claim: disable the function persistently, log once.
async fn unsupported(
    pool: &PgPool,
    claimer: &Claimer,
    function_name: &str,
    u: Unsupported,
) -> Result<WorkerError, WorkerError> {
    let err = WorkerError::Unsupported(Box::new(UnsupportedBatch {
        queue: claimer.queue.clone(),
        msg_ids: u.msg_ids,
        supported: claimer
            .flow_slugs
            .iter()
            .zip(&claimer.step_slugs)
            .map(|(f, s)| ((*f).to_owned(), (*s).to_owned()))
            .collect(),
        function_name: function_name.to_owned(),
        message_flows: u.flows,
        message_steps: u.steps,
    }));
    run!(
        claimer.pooled,
        pool,
        sqlx::query(statements::DISABLE_WORKER_FUNCTION)
            .bind(function_name)
            .bind(err.to_string()),
        execute
    )
    .await
    .during("disabling the worker function")?;
    tracing::error!(error = %err, "stopping: unsupported messages");
    Ok(err)
}
