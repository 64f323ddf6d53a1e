//! The worker's life after startup, in parts with one job each: the claim loop, draining handlers,
//! flushing results within the grace, handing back what is left, and the report.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::{mpsc, Notify, Semaphore};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::background::{self, Maintenance};
use super::claim::{ClaimOutcome, Claimer, Unsupported};
use super::error::{Context, UnsupportedBatch, WorkerError};
use super::execute::{self, Shared};
use super::record::{describe, Pending, Recorder, Stats};
use super::registry::Registry;
use super::retry::Backoff;
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
            startup::log_uncovered_routes(&pool, flow.slug).await;
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

/// Why the claim loop ended with an error to report.
struct Fatal(Unsupported);

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
    let pending: Pending = Arc::default();
    let wake = Arc::new(Notify::new());

    // Claiming stops when `stop` fires: shutdown, deprecation, a disabled function, a fatal claim.
    let stop = shutdown.child_token();
    let reason: Arc<Mutex<Option<StopReason>>> = Arc::new(Mutex::new(None));
    let background_done = CancellationToken::new();
    let background = spawn_background(&pool, worker_id, &config, &stop, &reason, &background_done);

    let (tx, rx) = mpsc::unbounded_channel();
    let recorder = tokio::spawn(
        Recorder {
            pool: pool.clone(),
            worker_id,
            batch: config.completion_batch_size,
            flushers: config.completion_flushers,
            backoff_max: config.poll_error_backoff_max,
            wake: Arc::clone(&wake),
            stats: Arc::clone(&stats),
            pending: Arc::clone(&pending),
        }
        .run(rx),
    );
    let shared = Arc::new(Shared {
        pool: pool.clone(),
        registry: Arc::clone(&registry),
        handlers: CancellationToken::new(),
        // Within the claim visibility buffer (2 s), so the failure lands before the message reappears.
        timeout_cancel_wait: config.cancel_grace.min(Duration::from_secs(1)),
        results: tx,
        pending: Arc::clone(&pending),
    });
    let (flow_slugs, step_slugs) = registry.pairs();
    let claimer = Claimer {
        queue: registry.queue.clone(),
        flow_slugs,
        step_slugs,
        read_visibility_secs: i32::try_from(config.read_visibility.as_secs())
            .unwrap_or(i32::MAX)
            .max(1),
        worker_id,
    };

    let mut tasks = JoinSet::new();
    let fatal = claim_loop(
        &pool, &claimer, &config, &shared, &mut tasks, &stop, &reason, &wake,
    )
    .await;

    // Stop: drain handlers, then flush results, both within the grace; then hand back the rest.
    let stopped_at = Instant::now();
    let deadline = stopped_at + config.shutdown_grace + config.cancel_grace;
    drain(&mut tasks, &shared, &config, worker_id).await;
    // Every task runner has ended: dropping the last handle on the results channel lets the recorder finish.
    drop(shared);
    flush_within(recorder, &pending, deadline).await;
    background_done.cancel();
    for handle in background {
        let _ = handle.await;
    }

    let released = release(&pool, worker_id).await;
    let unsupported = match fatal {
        Some(Fatal(u)) => Some(unsupported(&pool, &claimer, &prepared.function_name, u).await?),
        None => None,
    };
    sqlx::query(statements::MARK_WORKER_STOPPED)
        .bind(worker_id)
        .execute(&pool)
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
        released,
    };
    tracing::info!(%worker_id, queue = %claimer.queue, reason = ?report.stop_reason, completed = report.completed,
        failed = report.failed, stale = report.stale, released = report.released, "pgflow worker stopped");
    Ok(report)
}

fn spawn_background(
    pool: &PgPool,
    worker_id: Uuid,
    config: &WorkerConfig,
    stop: &CancellationToken,
    reason: &Arc<Mutex<Option<StopReason>>>,
    done: &CancellationToken,
) -> Vec<JoinHandle<()>> {
    let mut handles = Vec::new();
    {
        let (pool, stop, reason, done) =
            (pool.clone(), stop.clone(), Arc::clone(reason), done.clone());
        let interval = config.heartbeat_interval;
        handles.push(tokio::spawn(async move {
            background::heartbeat(pool, worker_id, interval, stop, &reason, done).await;
        }));
    }
    if let Some(interval) = config.maintenance_interval {
        handles.push(tokio::spawn(background::maintain(
            pool.clone(),
            Maintenance {
                interval,
                dead_after: config.dead_worker_timeout,
                retention: config.retention,
                retention_batch: config.retention_batch,
            },
            done.clone(),
        )));
    }
    handles
}

/// Claims while there are free handler slots and room for unrecorded results; runs each task.
/// Returns the fatal claim that stopped it, if any.
#[allow(clippy::too_many_arguments)]
async fn claim_loop(
    pool: &PgPool,
    claimer: &Claimer,
    config: &WorkerConfig,
    shared: &Arc<Shared>,
    tasks: &mut JoinSet<()>,
    stop: &CancellationToken,
    reason: &Mutex<Option<StopReason>>,
    wake: &Notify,
) -> Option<Fatal> {
    let slots = Arc::new(Semaphore::new(config.max_concurrent));
    let unrecorded = Arc::new(Semaphore::new(config.max_unrecorded));
    let mut idle = Backoff::new(config.poll_interval, config.max_poll_wait);
    let mut errors = Backoff::database(config.poll_error_backoff_max);
    loop {
        while let Some(joined) = tasks.try_join_next() {
            log_join(joined);
        }
        // Wait for a handler slot and for room to record its result (backpressure from the database).
        let (first_slot, first_unrecorded) = tokio::select! {
            biased;
            _ = stop.cancelled() => return None,
            permits = async {
                let slot = Arc::clone(&slots).acquire_owned().await;
                let room = Arc::clone(&unrecorded).acquire_owned().await;
                (slot, room)
            } => (
                permits.0.expect("the slot semaphore is never closed"),
                permits.1.expect("the unrecorded semaphore is never closed"),
            ),
        };
        let qty = (slots.available_permits() + 1)
            .min(unrecorded.available_permits() + 1)
            .min(config.batch_size);
        // A claim in flight is never abandoned: it finishes (it never sleeps), and what it claimed either
        // runs or is handed back at shutdown by release_worker_tasks.
        let claimed = match claimer.claim(pool, qty).await {
            Ok(ClaimOutcome::Claimed(tasks)) => {
                errors.reset();
                tasks
            }
            Ok(ClaimOutcome::Unsupported(unsupported)) => {
                stop.cancel();
                return Some(Fatal(unsupported));
            }
            Ok(ClaimOutcome::Disabled(disabled)) => {
                tracing::warn!(worker_id = %claimer.worker_id, reason = ?disabled.reason,
                    "worker function disabled: no more claims, draining");
                reason
                    .lock()
                    .expect("stop reason lock")
                    .get_or_insert(StopReason::Disabled);
                stop.cancel();
                return None;
            }
            Err(e) => {
                let wait = errors.next_delay();
                tracing::warn!(queue = %claimer.queue, error = %e, retry_in_ms = wait.as_millis() as u64,
                    "claiming failed; backing off");
                drop((first_slot, first_unrecorded));
                tokio::select! {
                    _ = stop.cancelled() => return None,
                    _ = tokio::time::sleep(wait) => {}
                }
                continue;
            }
        };
        let n = claimed.len();
        let mut first = Some((first_slot, first_unrecorded));
        for task in claimed {
            let (slot, room) = first.take().unwrap_or_else(|| {
                (
                    Arc::clone(&slots)
                        .try_acquire_owned()
                        .expect("free slots were counted before the read"),
                    Arc::clone(&unrecorded)
                        .try_acquire_owned()
                        .expect("free room was counted before the read"),
                )
            });
            if stop.is_cancelled() {
                // Claimed while stopping: not started; release_worker_tasks hands it back.
                continue;
            }
            tasks.spawn(execute::execute(Arc::clone(shared), task, slot, room));
        }
        drop(first);
        if n == qty {
            idle.reset();
            continue;
        }
        if n > 0 {
            idle.reset();
        }
        tokio::select! {
            biased;
            _ = stop.cancelled() => return None,
            _ = wake.notified() => idle.reset(),
            _ = tokio::time::sleep(idle.peek()) => { idle.next_delay(); }
        }
    }
}

/// Lets in-flight handlers finish within the grace, then cancels them (their tokens fire) and drops the
/// ones still running after `cancel_grace`.
async fn drain(tasks: &mut JoinSet<()>, shared: &Shared, config: &WorkerConfig, worker_id: Uuid) {
    let in_flight = tasks.len();
    if in_flight > 0 {
        tracing::info!(%worker_id, in_flight, grace_s = config.shutdown_grace.as_secs_f64(), "waiting for in-flight tasks");
    }
    if tokio::time::timeout(config.shutdown_grace, join_all(tasks))
        .await
        .is_ok()
    {
        return;
    }
    tracing::warn!(%worker_id, left = tasks.len(), "shutdown grace over; cancelling handlers");
    shared.handlers.cancel();
    if tokio::time::timeout(config.cancel_grace, join_all(tasks))
        .await
        .is_err()
    {
        tasks.abort_all();
        join_all(tasks).await;
    }
}

/// Waits for the recorder until `deadline`; past it, logs every result still unrecorded (recovery runs
/// those tasks again) and stops waiting.
async fn flush_within(recorder: JoinHandle<()>, pending: &Pending, deadline: Instant) {
    let abort = recorder.abort_handle();
    if tokio::time::timeout_at(deadline, recorder).await.is_ok() {
        return;
    }
    abort.abort();
    let left: Vec<String> = pending
        .lock()
        .expect("pending lock")
        .values()
        .map(describe)
        .collect();
    tracing::warn!(unrecorded = ?left,
        "shutdown grace over with results not recorded; recovery will run these tasks again");
}

/// Hands back unfinished tasks (queued again at once, attempt not consumed); 0 when the database cannot
/// be reached in time, in which case recovery requeues them once this worker's heartbeat is missed.
async fn release(pool: &PgPool, worker_id: Uuid) -> u64 {
    let call = sqlx::query_scalar::<_, i32>(statements::RELEASE_WORKER_TASKS)
        .bind(worker_id)
        .fetch_one(pool);
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

async fn join_all(tasks: &mut JoinSet<()>) {
    while let Some(joined) = tasks.join_next().await {
        log_join(joined);
    }
}

fn log_join(joined: Result<(), tokio::task::JoinError>) {
    if let Err(e) = joined {
        if e.is_panic() {
            tracing::error!(error = %e, "a task runner panicked outside its handler");
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
    sqlx::query(statements::DISABLE_WORKER_FUNCTION)
        .bind(function_name)
        .bind(err.to_string())
        .execute(pool)
        .await
        .during("disabling the worker function")?;
    tracing::error!(error = %err, "stopping: unsupported messages");
    Ok(err)
}
