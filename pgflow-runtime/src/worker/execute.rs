//! Running one claimed task: timeout, panics, and recording the outcome.

use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tracing::Instrument;

use super::claim::Claimed;
use super::complete::{Completion, RECORD_ATTEMPTS};
use super::run::Shared;
use crate::context::{StepContext, StepContextParts};
use crate::error::StepError;
use crate::flow::{task_input, Flow, FlowStep};
use crate::statements as sql;

enum Outcome {
    Done(serde_json::Value),
    Failed(StepError),
    Panicked(String),
    TimedOut(Duration),
}

/// Runs a claimed task and records its outcome. Holds `permit` until the outcome is queued or recorded.
pub(crate) async fn execute<F: Flow>(
    shared: Arc<Shared<F>>,
    task: Claimed,
    completions: mpsc::UnboundedSender<Completion>,
    permit: OwnedSemaphorePermit,
) {
    let Some(step) = F::Step::from_slug(&task.step_slug) else {
        let message = format!(
            "flow `{}` has no handler for step `{}` in this build",
            F::SLUG,
            task.step_slug
        );
        tracing::error!(flow = F::SLUG, step = %task.step_slug, run_id = %task.run_id,
            msg_id = task.msg_id, "claimed a task of a step this build does not have");
        record_failure(&shared, &task.step_slug, &task, &message, None, true).await;
        return;
    };
    let span = tracing::debug_span!("pgflow.task", flow = F::SLUG, step = step.slug(),
        run_id = %task.run_id, task_index = task.task_index, msg_id = task.msg_id, attempt = task.attempt);
    let mut task = task;
    async move {
        tracing::debug!("task started");
        let started = Instant::now();
        let token = shared.handlers.child_token();
        let ctx = StepContext::new(StepContextParts {
            run_id: task.run_id,
            step,
            task_index: task.task_index,
            attempt: task.attempt,
            msg_id: task.msg_id,
            pool: shared.pool.clone(),
            cancellation: token.clone(),
            flow_input: None,
        });
        let input = task_input(
            step,
            std::mem::take(&mut task.input),
            task.flow_input.take(),
        );
        let limit = shared.timeouts[step.index()];
        let handler = AssertUnwindSafe(F::dispatch(step, input, ctx)).catch_unwind();
        tokio::pin!(handler);
        let outcome = tokio::select! {
            result = &mut handler => match result {
                Ok(Ok(output)) => Outcome::Done(output),
                Ok(Err(e)) => Outcome::Failed(e),
                Err(panic) => Outcome::Panicked(panic_message(panic.as_ref())),
            },
            _ = tokio::time::sleep(limit) => {
                // Cancel first, give a cooperative handler a moment to stop, then drop it.
                token.cancel();
                let _ = tokio::time::timeout(shared.timeout_cancel_wait, &mut handler).await;
                Outcome::TimedOut(limit)
            }
        };
        let elapsed_ms = started.elapsed().as_millis() as u64;
        // Cancelled by shutdown: the worker hands the task back; a failure now is not the handler's fault.
        if shared.handlers.is_cancelled() && !matches!(outcome, Outcome::Done(_)) {
            tracing::debug!(
                elapsed_ms,
                "task interrupted by shutdown; it will be handed back"
            );
            return;
        }
        match outcome {
            Outcome::Done(output) => {
                tracing::debug!(elapsed_ms, "task completed");
                let _ = completions.send(Completion {
                    run_id: task.run_id,
                    step_slug: step.slug(),
                    task_index: task.task_index,
                    msg_id: task.msg_id,
                    output,
                });
            }
            Outcome::Failed(e) => {
                let message = e.chain_message();
                record_failure(
                    &shared,
                    step.slug(),
                    &task,
                    &message,
                    e.retry_delay(),
                    e.is_terminal(),
                )
                .await;
            }
            Outcome::Panicked(msg) => {
                let message = format!("step `{}` handler panicked: {msg}", step.slug());
                record_failure(&shared, step.slug(), &task, &message, None, false).await;
            }
            Outcome::TimedOut(limit) => {
                let message = format!(
                    "step `{}` timed out after {}s (its effective timeout)",
                    step.slug(),
                    limit.as_secs()
                );
                record_failure(&shared, step.slug(), &task, &message, None, false).await;
            }
        }
        drop(permit);
    }
    .instrument(span)
    .await;
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

/// `pgflow.fail_task` with the handler's choices, retried on database errors.
async fn record_failure<F: Flow>(
    shared: &Shared<F>,
    step_slug: &str,
    task: &Claimed,
    message: &str,
    retry_after: Option<Duration>,
    terminal: bool,
) {
    let delay_secs = retry_after.map(|d| i32::try_from(d.as_secs()).unwrap_or(i32::MAX));
    let mut backoff = Duration::from_millis(100);
    for attempt in 1..=RECORD_ATTEMPTS {
        let result: Result<Option<String>, sqlx::Error> = sqlx::query_scalar(sql::FAIL_TASK)
            .bind(task.run_id)
            .bind(step_slug)
            .bind(task.task_index)
            .bind(message)
            .bind(delay_secs)
            .bind(terminal)
            .fetch_optional(&shared.pool)
            .await;
        match result {
            Ok(status) => {
                shared.stats.failed.fetch_add(1, Ordering::Relaxed);
                match status.as_deref() {
                    Some("queued") => tracing::warn!(
                        error = %message, retry_in_s = ?delay_secs, "task failed; it will be retried"
                    ),
                    Some("failed") => tracing::error!(
                        error = %message, terminal, "task failed for good"
                    ),
                    other => tracing::debug!(
                        error = %message, status = ?other, "task failure recorded; the task had already moved on"
                    ),
                }
                return;
            }
            Err(e) if attempt < RECORD_ATTEMPTS => {
                tracing::warn!(error = %e, attempt, "recording a task failure failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot record a task failure; the task is left to stalled-task recovery");
            }
        }
    }
}
