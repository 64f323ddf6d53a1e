//! The context a step handler may take as its last parameter.

use std::any::type_name;
use std::fmt;
use std::sync::Arc;

use sqlx::PgPool;
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::error::StepError;
use crate::flows::Flow;

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
    pooled: bool,
    cancellation: CancellationToken,
    flow_input: Arc<OnceCell<Arc<F::Input>>>,
}

impl<F: Flow> StepContext<F> {
    /// A context for running `step` of run `run_id` with `pool`: task index 0, attempt 1, message id 0, a
    /// fresh cancellation token, and a flow input fetched from the database when a handler asks for it.
    ///
    /// The worker builds every handler's context this way; calling a flow's handlers directly (through
    /// [`Flow::dispatch`], in a unit test for example) works the same. A pool
    /// that never connects (`PgPoolOptions::new().connect_lazy(..)`) is enough while no handler uses it.
    pub fn new(run_id: Uuid, step: F::Step, pool: PgPool) -> Self {
        StepContext {
            run_id,
            step,
            task_index: 0,
            attempt: 1,
            msg_id: 0,
            pool,
            pooled: false,
            cancellation: CancellationToken::new(),
            flow_input: Arc::new(OnceCell::new()),
        }
    }

    /// Sets the task index (the element position of a map task).
    #[must_use]
    pub fn with_task_index(mut self, task_index: i32) -> Self {
        self.task_index = task_index;
        self
    }

    /// Sets the attempt number (1 for the first attempt).
    #[must_use]
    pub fn with_attempt(mut self, attempt: i32) -> Self {
        self.attempt = attempt;
        self
    }

    /// Sets the PGMQ message id.
    #[must_use]
    pub fn with_msg_id(mut self, msg_id: i64) -> Self {
        self.msg_id = msg_id;
        self
    }

    /// Uses `token` as the cancellation token the handler watches.
    #[must_use]
    pub fn with_cancellation(mut self, token: CancellationToken) -> Self {
        self.cancellation = token;
        self
    }

    /// Whether `pool` goes through a transaction pooler (see [`Pooling`](crate::pooling::Pooling)): then
    /// [`StepContext::flow_input`] reads the run with an unnamed statement in a transaction of its own.
    #[must_use]
    pub fn behind_transaction_pooler(mut self, pooled: bool) -> Self {
        self.pooled = pooled;
        self
    }

    /// Provides the flow input up front, so [`StepContext::flow_input`] never queries the database.
    #[must_use]
    pub fn with_flow_input(self, input: F::Input) -> Self {
        StepContext {
            flow_input: Arc::new(OnceCell::new_with(Some(Arc::new(input)))),
            ..self
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
                let query = sqlx::query_scalar(crate::statements::RUN_INPUT).bind(self.run_id);
                let raw: serde_json::Value =
                    crate::pooling::run!(self.pooled, &self.pool, query, fetch_one).await?;
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
            pooled: self.pooled,
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
