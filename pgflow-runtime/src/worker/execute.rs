//! Running one claimed task: dispatch by concrete flow and step, the step timeout, panics, and handing the
//! outcome to the worker's driver, which records it.

use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use sqlx::PgPool;
use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::claim::Claimed;
use super::record::Pending;
use super::registry::{step_deadline, Registry, TaskFacts};
use super::result::{Outcome, TaskKey, TaskResult};
use super::revoke::Revocations;
use crate::observability::worker::WorkerMetrics;

/// What running tasks share.
pub(crate) struct Shared {
    pub(crate) pool: PgPool,
    pub(crate) registry: Arc<Registry>,
    /// Parent of every handler's token; fires once the shutdown grace is over.
    pub(crate) handlers: CancellationToken,
    /// How long a timed-out handler may take to react to its token before it is dropped.
    pub(crate) timeout_cancel_wait: Duration,
    pub(crate) results: mpsc::UnboundedSender<TaskResult>,
    pub(crate) pending: Pending,
    /// Behind a transaction pooler (see [`Pooling`](crate::pooling::Pooling)).
    pub(crate) pooled: bool,
    /// The tasks in flight, checked in the background for cancellation.
    pub(crate) revocations: Revocations,
    pub(crate) metrics: Arc<WorkerMetrics>,
    /// This worker, for the attempt spans.
    #[cfg(feature = "otel")]
    pub(crate) worker_id: uuid::Uuid,
}

enum Ran {
    Done(serde_json::Value),
    Failed(crate::StepError),
    Panicked(String),
    TimedOut(Duration),
    /// The task is no longer current (its run was cancelled or failed): the handler was cancelled.
    Revoked,
}

/// Runs a claimed task and hands its outcome to the recorder. `slot` (a handler slot) is freed when the
/// handler returns; `unrecorded` travels with the result until it is recorded.
pub(crate) async fn execute(
    shared: Arc<Shared>,
    task: Claimed,
    slot: OwnedSemaphorePermit,
    unrecorded: OwnedSemaphorePermit,
) {
    // With `otel`, the attempt's span is current while the task's tracing span is created, so that span and
    // the handler's own spans nest under it; the attempt span ends when `attempt_cx` is dropped.
    #[cfg(feature = "otel")]
    let attempt_cx = crate::observability::otel::attempt_context(&task, shared.worker_id);
    #[cfg(feature = "otel")]
    let _attached = attempt_cx.as_ref().map(|cx| cx.clone().attach());
    let span = tracing::debug_span!("pgflow.task", flow = %task.flow_slug, step = %task.step_slug,
        run_id = %task.run_id, task_index = task.task_index, msg_id = task.msg_id, attempt = task.attempt);
    #[cfg(feature = "otel")]
    drop(_attached);
    async move {
        #[cfg(feature = "otel")]
        let _attempt = attempt_cx;
        let step_metrics = shared.metrics.step(&task.flow_slug, &task.step_slug);
        if let Some(m) = step_metrics {
            m.wait.record(task.claimed_at.elapsed().as_secs_f64());
        }
        shared.metrics.in_flight.increment(1.0);
        let key = TaskKey {
            run_id: task.run_id,
            flow_slug: task.flow_slug.clone(),
            step_slug: task.step_slug.clone(),
            task_index: task.task_index,
            msg_id: task.msg_id,
            attempt: task.attempt,
        };
        let started = Instant::now();
        let outcome = run(&shared, task).await;
        let ran_for = started.elapsed();
        drop(slot);
        shared.metrics.in_flight.decrement(1.0);
        if let Some(m) = step_metrics {
            m.handler.record(ran_for.as_secs_f64());
        }
        let Some(outcome) = outcome else {
            return;
        };
        shared
            .pending
            .lock()
            .expect("pending lock")
            .insert(key.msg_id, key.clone());
        let result = TaskResult {
            key,
            outcome,
            ran_for,
            first_error: None,
            _permit: unrecorded,
        };
        if let Err(lost) = shared.results.send(result) {
            // The recorder is gone (the worker is stopping): recovery runs the task again.
            shared
                .pending
                .lock()
                .expect("pending lock")
                .remove(&lost.0.key.msg_id);
        }
    }
    .instrument(span)
    .await;
}

/// The handler's outcome; `None` when the task was interrupted by shutdown (the worker hands it back).
async fn run(shared: &Shared, task: Claimed) -> Option<Outcome> {
    tracing::debug!("task started");
    let started = Instant::now();
    let limit = step_deadline(task.timeout);
    let token = shared.handlers.child_token();
    let facts = TaskFacts {
        run_id: task.run_id,
        task_index: task.task_index,
        attempt: task.attempt,
        msg_id: task.msg_id,
        input: task.input,
        flow_input: task.flow_input,
        pool: shared.pool.clone(),
        pooled: shared.pooled,
        cancellation: token.clone(),
    };
    let dispatched = shared
        .registry
        .dispatch(&task.flow_slug, &task.step_slug, facts);
    let handler = match dispatched {
        Ok(handler) => handler,
        Err(message) => {
            tracing::error!(error = %message, "claimed a task this build cannot run");
            return Some(Outcome::Failure {
                message,
                retry_after: None,
                terminal: true,
            });
        }
    };
    let tracked =
        shared
            .revocations
            .track(task.run_id, &task.step_slug, task.task_index, task.attempt);
    let handler = AssertUnwindSafe(handler).catch_unwind();
    tokio::pin!(handler);
    let ran = tokio::select! {
        result = &mut handler => match result {
            Ok(Ok(output)) => Ran::Done(output),
            Ok(Err(e)) => Ran::Failed(e),
            Err(panic) => Ran::Panicked(panic_message(panic.as_ref())),
        },
        _ = tokio::time::sleep(limit) => {
            // Cancel first, give a cooperative handler a moment to stop, then drop it.
            token.cancel();
            let _ = tokio::time::timeout(shared.timeout_cancel_wait, &mut handler).await;
            Ran::TimedOut(limit)
        }
        _ = tracked.revoked.cancelled() => {
            // The run was cancelled or failed: the same, and the result (stale in the database) is dropped.
            token.cancel();
            let _ = tokio::time::timeout(shared.timeout_cancel_wait, &mut handler).await;
            Ran::Revoked
        }
    };
    drop(tracked);
    let elapsed_ms = started.elapsed().as_millis() as u64;
    // Cancelled by shutdown: the worker hands the task back; a failure now is not the handler's fault.
    if shared.handlers.is_cancelled() && !matches!(ran, Ran::Done(_)) {
        tracing::debug!(
            elapsed_ms,
            "task interrupted by shutdown; it will be handed back"
        );
        return None;
    }
    let step = &task.step_slug;
    Some(match ran {
        Ran::Done(output) => {
            tracing::debug!(elapsed_ms, "task completed");
            Outcome::Output(output)
        }
        Ran::Failed(e) => Outcome::Failure {
            message: e.chain_message(),
            retry_after: e.retry_delay(),
            terminal: e.is_terminal(),
        },
        Ran::Panicked(msg) => Outcome::Failure {
            message: format!("step `{step}` handler panicked: {msg}"),
            retry_after: None,
            terminal: false,
        },
        Ran::TimedOut(limit) => Outcome::Failure {
            message: format!(
                "step `{step}` timed out after {}s (its effective timeout)",
                limit.as_secs()
            ),
            retry_after: None,
            terminal: false,
        },
        Ran::Revoked => {
            tracing::info!(
                elapsed_ms,
                "task no longer current; its handler was cancelled and its result dropped"
            );
            return None;
        }
    })
}

fn panic_message(panic: &(dyn Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string panic payload".to_owned()
    }
}
