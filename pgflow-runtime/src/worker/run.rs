//! The worker's life: startup, the claim loop, draining and shutdown.

use std::marker::PhantomData;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::{mpsc, Notify, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::claim::{ClaimOutcome, Claimer};
use super::complete::{completer, Stats};
use super::error::{Context, UnsupportedBatch, WorkerError};
use super::{background, execute, startup, Mode, StopReason, Worker, WorkerReport};
use crate::config::WorkerConfig;
use crate::flow::{Flow, FlowStep};
use crate::statements as sql;

/// What running tasks share.
pub(crate) struct Shared<F: Flow> {
    pub(crate) pool: PgPool,
    /// Effective timeout per step index.
    pub(crate) timeouts: Vec<Duration>,
    /// Parent of every handler's token; fires once the shutdown grace is over.
    pub(crate) handlers: CancellationToken,
    /// How long a timed-out handler may take to react to its token before it is dropped.
    pub(crate) timeout_cancel_wait: Duration,
    pub(crate) stats: Arc<Stats>,
    _flow: PhantomData<fn() -> F>,
}

/// A worker whose startup succeeded: compiled, registered, not yet claiming.
pub(crate) struct Ready<F: Flow> {
    pool: PgPool,
    mode: Mode<F::Step>,
    config: WorkerConfig,
    worker_id: uuid::Uuid,
    prepared: startup::Prepared,
}

/// Startup: schema, compilation, queue checks, fence, registration, banner.
pub(crate) async fn prepare<F: Flow>(worker: Worker<F>) -> Result<Ready<F>, WorkerError> {
    let Worker {
        pool,
        mode,
        config,
        worker_id,
        ..
    } = worker;
    let prepared = startup::prepare::<F>(&pool, mode, &config, worker_id).await?;
    tracing::info!(
        %worker_id,
        worker_name = %prepared.function_name,
        flow = F::SLUG,
        step = step_of(mode).unwrap_or("*"),
        queue = %prepared.queue,
        compile_status = %prepared.compile_status,
        max_concurrent = config.max_concurrent,
        batch_size = config.batch_size,
        "pgflow worker started"
    );
    if let Mode::Step { .. } = mode {
        log_uncovered_routes::<F>(&pool).await;
    }
    Ok(Ready {
        pool,
        mode,
        config,
        worker_id,
        prepared,
    })
}

/// Startup visibility of missing step workers: routes with queued work and no live worker.
async fn log_uncovered_routes<F: Flow>(pool: &PgPool) {
    let rows: Result<Vec<(String, String, i64)>, sqlx::Error> =
        sqlx::query_as(sql::UNCOVERED_ROUTES)
            .bind(F::SLUG)
            .fetch_all(pool)
            .await;
    match rows {
        Ok(rows) => {
            for (step, queue, queued) in rows {
                tracing::warn!(flow = F::SLUG, step = %step, queue = %queue, queued,
                    "step has queued work and no live worker; its tasks wait until one starts");
            }
        }
        Err(e) => tracing::debug!(error = %e, "cannot read pgflow.queue_coverage"),
    }
}

fn step_of<S: FlowStep>(mode: Mode<S>) -> Option<&'static str> {
    match mode {
        Mode::Plain => None,
        Mode::Step { step, .. } => Some(step.slug()),
    }
}

/// The claim loop, then draining and shutdown.
pub(crate) async fn serve<F: Flow>(
    ready: Ready<F>,
    shutdown: CancellationToken,
) -> Result<WorkerReport, WorkerError> {
    let Ready {
        pool,
        mode,
        config,
        worker_id,
        prepared,
    } = ready;
    let step_slug = step_of(mode);

    let stats = Arc::new(Stats::default());
    let shared = Arc::new(Shared::<F> {
        pool: pool.clone(),
        timeouts: prepared.timeouts,
        handlers: CancellationToken::new(),
        // Within the claim visibility buffer (2 s), so the failure lands before the message reappears.
        timeout_cancel_wait: config.cancel_grace.min(Duration::from_secs(1)),
        stats: Arc::clone(&stats),
        _flow: PhantomData,
    });
    let claimer = Claimer {
        queue: prepared.queue.clone(),
        flow_slug: F::SLUG,
        step_slug,
        read_visibility_secs: i32::try_from(config.read_visibility.as_secs())
            .unwrap_or(i32::MAX)
            .max(1),
        worker_id,
        function_name: prepared.function_name.clone(),
    };

    // Claiming stops when `stop` fires: shutdown, deprecation, a disabled function, a fatal claim.
    let stop = shutdown.child_token();
    let reason: Arc<Mutex<Option<StopReason>>> = Arc::new(Mutex::new(None));
    let background_done = CancellationToken::new();
    let mut background = JoinSet::new();
    {
        let (pool, stop, reason, done) = (
            pool.clone(),
            stop.clone(),
            Arc::clone(&reason),
            background_done.clone(),
        );
        let interval = config.heartbeat_interval;
        background.spawn(async move {
            background::heartbeat(pool, worker_id, interval, stop, &reason, done).await;
        });
    }
    if let Some(interval) = config.stalled_recovery_interval {
        background.spawn(background::recover_stalled(
            pool.clone(),
            interval,
            background_done.clone(),
        ));
    }

    let wake = Arc::new(Notify::new());
    let (tx, rx) = mpsc::unbounded_channel();
    let completions = tokio::spawn(completer(
        pool.clone(),
        rx,
        config.completion_batch_size,
        config.completion_flushers,
        Arc::clone(&wake),
        Arc::clone(&stats),
    ));

    let slots = Arc::new(Semaphore::new(config.max_concurrent));
    let mut tasks = JoinSet::new();
    let mut idle_wait = config.poll_interval;
    let mut error_wait = Duration::ZERO;
    let mut fatal = None;
    loop {
        while let Some(joined) = tasks.try_join_next() {
            log_join(joined);
        }
        let first = tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            permit = Arc::clone(&slots).acquire_owned() => permit.expect("the slot semaphore is never closed"),
        };
        let qty = (slots.available_permits() + 1).min(config.batch_size);
        let outcome = tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            outcome = claimer.claim(&pool, qty) => outcome,
        };
        let claimed = match outcome {
            Ok(ClaimOutcome::Tasks(claimed)) => {
                error_wait = Duration::ZERO;
                claimed
            }
            Ok(ClaimOutcome::Unsupported {
                msg_ids,
                flows,
                steps,
            }) => {
                fatal = Some((msg_ids, flows, steps));
                stop.cancel();
                break;
            }
            Ok(ClaimOutcome::Disabled { reason: why }) => {
                tracing::warn!(%worker_id, reason = ?why, "worker function disabled: no more claims, draining");
                reason
                    .lock()
                    .expect("stop reason lock")
                    .get_or_insert(StopReason::Disabled);
                stop.cancel();
                break;
            }
            Err(e) => {
                error_wait = (error_wait * 2)
                    .max(Duration::from_millis(100))
                    .min(config.poll_error_backoff_max);
                tracing::warn!(queue = %claimer.queue, error = %e, retry_in_ms = error_wait.as_millis() as u64,
                    "claiming failed; backing off");
                drop(first);
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(error_wait) => {}
                }
                continue;
            }
        };
        let n = claimed.len();
        let mut first = Some(first);
        for task in claimed {
            let permit = match first.take() {
                Some(p) => p,
                None => Arc::clone(&slots)
                    .try_acquire_owned()
                    .expect("free slots were counted before the read"),
            };
            tasks.spawn(execute::execute(
                Arc::clone(&shared),
                task,
                tx.clone(),
                permit,
            ));
        }
        drop(first);
        if n == qty {
            idle_wait = config.poll_interval;
            continue;
        }
        if n > 0 {
            idle_wait = config.poll_interval;
        }
        tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            _ = wake.notified() => idle_wait = config.poll_interval,
            _ = tokio::time::sleep(idle_wait) => idle_wait = (idle_wait * 2).min(config.max_poll_wait),
        }
    }

    // Stop: drain in-flight work, then cancel what is left.
    let in_flight = tasks.len();
    if in_flight > 0 {
        tracing::info!(%worker_id, in_flight, grace_s = config.shutdown_grace.as_secs_f64(), "waiting for in-flight tasks");
    }
    let drained = tokio::time::timeout(config.shutdown_grace, drain(&mut tasks)).await;
    if drained.is_err() {
        tracing::warn!(%worker_id, left = tasks.len(), "shutdown grace over; cancelling handlers");
        shared.handlers.cancel();
        if tokio::time::timeout(config.cancel_grace, drain(&mut tasks))
            .await
            .is_err()
        {
            tasks.abort_all();
            drain(&mut tasks).await;
        }
    }
    drop(tx);
    let _ = completions.await;
    background_done.cancel();
    while background.join_next().await.is_some() {}

    let released: i32 = sqlx::query_scalar(sql::RELEASE_WORKER_TASKS)
        .bind(worker_id)
        .fetch_one(&pool)
        .await
        .during("handing back unfinished tasks")?;
    if released > 0 {
        tracing::warn!(%worker_id, released, "handed back unfinished tasks");
    }

    let unsupported = match fatal {
        Some((msg_ids, flows, steps)) => {
            Some(unsupported(&pool, &claimer, msg_ids, flows, steps).await?)
        }
        None => None,
    };
    sqlx::query(sql::MARK_WORKER_STOPPED)
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
        compile_status: prepared.compile_status,
        completed: stats.completed.load(Ordering::Relaxed),
        failed: stats.failed.load(Ordering::Relaxed),
        released: u64::try_from(released).unwrap_or(0),
    };
    tracing::info!(%worker_id, reason = ?report.stop_reason, completed = report.completed,
        failed = report.failed, released = report.released, "pgflow worker stopped");
    Ok(report)
}

async fn drain(tasks: &mut JoinSet<()>) {
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
    msg_ids: Vec<i64>,
    flows: Vec<String>,
    steps: Vec<String>,
) -> Result<WorkerError, WorkerError> {
    let err = WorkerError::Unsupported(Box::new(UnsupportedBatch {
        queue: claimer.queue.clone(),
        msg_ids,
        flow_slug: claimer.flow_slug.to_owned(),
        step_slug: claimer.step_slug.unwrap_or("*").to_owned(),
        function_name: claimer.function_name.clone(),
        message_flows: flows,
        message_steps: steps,
    }));
    sqlx::query(sql::DISABLE_WORKER_FUNCTION)
        .bind(&claimer.function_name)
        .bind(err.to_string())
        .execute(pool)
        .await
        .during("disabling the worker function")?;
    tracing::error!(error = %err, "stopping: unsupported messages");
    Ok(err)
}
