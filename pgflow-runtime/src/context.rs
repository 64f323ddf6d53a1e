//! The context a step handler may take as its last parameter.

use std::any::type_name;
use std::fmt;
use std::sync::Arc;

use sqlx::PgPool;
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::error::StepError;
use crate::flow::Flow;

/// Facts about the running task, plus the pool, a cancellation token and the flow input.
///
/// A handler takes it as an optional *last* parameter, by value or by reference; the macro
/// recognises it by its type name `StepContext`:
///
/// ```ignore
/// #[step(depends_on = [classify])]
/// async fn deliver(classify: Label, ctx: &StepContext<Community>) -> Result<(), StepError> {
///     let thread = ctx.flow_input().await?;
///     tracing::info!(run_id = %ctx.run_id(), attempt = ctx.attempt(), "delivering");
///     Ok(())
/// }
/// ```
pub struct StepContext<F: Flow> {
    run_id: Uuid,
    step: F::Step,
    task_index: i32,
    attempt: i32,
    msg_id: i64,
    pool: PgPool,
    cancellation: CancellationToken,
    flow_input: Arc<OnceCell<Arc<F::Input>>>,
}

/// Everything the runtime worker needs to build a [`StepContext`].
#[doc(hidden)]
pub struct StepContextParts<F: Flow> {
    /// `pgflow.runs.run_id`.
    pub run_id: Uuid,
    /// The step being run.
    pub step: F::Step,
    /// `pgflow.step_tasks.task_index` (0 for single steps).
    pub task_index: i32,
    /// The attempt number, starting at 1 (`pgflow.step_tasks.attempts_count` after the claim).
    pub attempt: i32,
    /// The PGMQ message id.
    pub msg_id: i64,
    /// The pool the worker uses.
    pub pool: PgPool,
    /// Fires on shutdown or timeout.
    pub cancellation: CancellationToken,
    /// The flow input when the worker already has it (root single steps); `None` fetches lazily.
    pub flow_input: Option<Arc<F::Input>>,
}

impl<F: Flow> StepContext<F> {
    /// Builds a context. Used by the runtime worker and by tests.
    #[doc(hidden)]
    pub fn new(parts: StepContextParts<F>) -> Self {
        let cell = match parts.flow_input {
            Some(input) => OnceCell::new_with(Some(input)),
            None => OnceCell::new(),
        };
        StepContext {
            run_id: parts.run_id,
            step: parts.step,
            task_index: parts.task_index,
            attempt: parts.attempt,
            msg_id: parts.msg_id,
            pool: parts.pool,
            cancellation: parts.cancellation,
            flow_input: Arc::new(cell),
        }
    }

    /// The run this task belongs to.
    pub fn run_id(&self) -> Uuid {
        self.run_id
    }

    /// The step being run.
    pub fn step(&self) -> F::Step {
        self.step
    }

    /// The task index: 0 for a single step, the element position for a map step.
    pub fn task_index(&self) -> i32 {
        self.task_index
    }

    /// The attempt number, starting at 1.
    pub fn attempt(&self) -> i32 {
        self.attempt
    }

    /// The PGMQ message id of this task.
    pub fn msg_id(&self) -> i64 {
        self.msg_id
    }

    /// The worker's pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Fires when the worker shuts down or the task times out; long handlers should watch it.
    pub fn cancellation(&self) -> &CancellationToken {
        &self.cancellation
    }

    /// The run's flow input, fetched at most once (`SELECT input FROM pgflow.runs`) and cached.
    ///
    /// Root single steps get it prefilled; concurrent callers share one fetch.
    ///
    /// # Errors
    ///
    /// A retryable error when the query fails, a terminal one when the stored input does not
    /// deserialize into the flow's input type.
    pub async fn flow_input(&self) -> Result<Arc<F::Input>, StepError> {
        self.flow_input
            .get_or_try_init(|| async {
                let raw: serde_json::Value =
                    sqlx::query_scalar("SELECT input FROM pgflow.runs WHERE run_id = $1")
                        .bind(self.run_id)
                        .fetch_one(&self.pool)
                        .await?;
                serde_json::from_value::<F::Input>(raw)
                    .map(Arc::new)
                    .map_err(|e| {
                        StepError::terminal(format!(
                            "flow `{}`: cannot deserialize the run input of run {} as `{}`: {e}",
                            F::SLUG,
                            self.run_id,
                            type_name::<F::Input>()
                        ))
                    })
            })
            .await
            .cloned()
    }
}

impl<F: Flow> Clone for StepContext<F> {
    fn clone(&self) -> Self {
        StepContext {
            run_id: self.run_id,
            step: self.step,
            task_index: self.task_index,
            attempt: self.attempt,
            msg_id: self.msg_id,
            pool: self.pool.clone(),
            cancellation: self.cancellation.clone(),
            flow_input: Arc::clone(&self.flow_input),
        }
    }
}

impl<F: Flow> fmt::Debug for StepContext<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StepContext")
            .field("flow", &F::SLUG)
            .field("run_id", &self.run_id)
            .field("step", &self.step)
            .field("task_index", &self.task_index)
            .field("attempt", &self.attempt)
            .field("msg_id", &self.msg_id)
            .finish_non_exhaustive()
    }
}
