//! `StepQueued<F>`: a flow deployed with one private queue per step.

use std::fmt;
use std::marker::PhantomData;

use sqlx::PgPool;

use crate::deployments::{Deployment, Routing};
use crate::flows::{Flow, FlowStep};
use crate::worker::{FromEnv, WorkerBuilder, WorkerError, WorkerReport};

/// The route table (step, queue) of a flow deployed with one queue per step.
///
/// `#[flow(..., step_queues)]` implements it: the macro resolves every step's queue name while it
/// expands (readable name, else index fallback, else a compile error on the offending slug, so the
/// problem shows in `cargo check`). A flow without `step_queues` does not implement it and runs on
/// its single queue, whatever the length of its step names.
#[diagnostic::on_unimplemented(
    message = "flow `{Self}` is not deployed with per-step queues",
    label = "this flow runs every step on its single queue",
    note = "opt in with the `step_queues` flag: `#[flow(slug = \"...\", input = ..., step_queues)]`; the macro then checks every step's queue name",
    note = "or run the flow on its single queue with `Worker::<{Self}>::builder(pool)`"
)]
pub trait StepQueueRoutes: Flow {
    /// Every step with its queue name, in step order.
    const ROUTES: &'static [(Self::Step, &'static str)];
}

/// A flow deployed in per-step-queue mode: every step polls its own queue.
///
/// Zero-sized; all of its data is the route table computed by the macro. Every function requires
/// `F: StepQueueRoutes`: the flow must opt in with `step_queues` in its `#[flow(...)]`, and using
/// `StepQueued` with any other flow does not compile (the error says how to opt in).
///
/// ```
/// use pgflow_runtime::{flow, StepError, StepQueued};
///
/// #[flow(slug = "communityThreadsV1", input = String, step_queues)]
/// mod community {
///     use pgflow_runtime::StepError;
///
///     #[step]
///     async fn classify(thread: String) -> Result<String, StepError> {
///         Ok(thread)
///     }
/// }
///
/// let spec = StepQueued::<community::Community>::worker(community::Step::Classify);
/// assert_eq!(spec.queue(), "communitythreadsv1__classify");
/// ```
pub struct StepQueued<F>(PhantomData<fn() -> F>);

// The bound sits on each function rather than on the impl, so that using `StepQueued` with a
// flow that did not opt in reports one error, with `StepQueueRoutes`'s explanation.
impl<F: Flow> StepQueued<F> {
    /// Every step with its queue, in step order.
    pub fn routes() -> &'static [(F::Step, &'static str)]
    where
        F: StepQueueRoutes,
    {
        F::ROUTES
    }

    /// The queue of one step.
    pub fn queue_for(step: F::Step) -> &'static str
    where
        F: StepQueueRoutes,
    {
        F::ROUTES[step.index()].1
    }

    /// The worker for one step. Only the flow's own step enum is accepted, so an unknown step
    /// does not compile.
    pub fn worker(step: F::Step) -> StepWorkerSpec<F>
    where
        F: StepQueueRoutes,
    {
        StepWorkerSpec {
            step,
            queue: Self::queue_for(step),
        }
    }
}

impl<F: StepQueueRoutes> Deployment for StepQueued<F> {
    type Flow = F;
    const ALIAS: Option<&'static str> = None;

    fn routing() -> Routing<F::Step> {
        Routing::StepQueues(F::ROUTES)
    }
}

impl<F> fmt::Debug for StepQueued<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("StepQueued")
    }
}

/// Which step a step-queue worker runs and which queue it polls.
///
/// Returned by [`StepQueued::worker`]; configured further and run by the runtime worker.
pub struct StepWorkerSpec<F: Flow> {
    step: F::Step,
    queue: &'static str,
}

impl<F: StepQueueRoutes> StepWorkerSpec<F> {
    /// The step this worker runs.
    pub fn step(&self) -> F::Step {
        self.step
    }

    /// The queue this worker polls.
    pub fn queue(&self) -> &'static str {
        self.queue
    }

    /// The concrete flow slug.
    pub fn flow_slug(&self) -> &'static str {
        F::SLUG
    }

    /// A worker builder for this step on `pool` (caller-owned; never closed by the worker).
    ///
    /// The worker polls only this step's queue. At startup it checks that the queue persisted in
    /// `pgflow.steps` equals this build's route and refuses to start otherwise.
    ///
    /// ```no_run
    /// # use pgflow_runtime::{flow, StepError, StepQueued};
    /// # #[flow(slug = "community", input = String, step_queues)]
    /// # mod community { use pgflow_runtime::StepError;
    /// #   #[step] async fn classify(t: String) -> Result<String, StepError> { Ok(t) } }
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// use community::{Community, Step};
    /// StepQueued::<Community>::worker(Step::Classify)
    ///     .builder(pool)
    ///     .max_concurrent(4)
    ///     .build()?
    ///     .run_until_signal()
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn builder(&self, pool: PgPool) -> WorkerBuilder<F> {
        WorkerBuilder::deployment::<StepQueued<F>>(pool, self.queue)
    }

    /// Runs this step worker with zero configuration: it connects with `DATABASE_URL` (a pool of
    /// [`WorkerConfig::pool_size`](crate::worker::WorkerConfig::pool_size) connections) and runs with the default
    /// settings until SIGTERM or ctrl-c. Use [`StepWorkerSpec::builder`] for anything else.
    ///
    /// ```no_run
    /// # use pgflow_runtime::{flow, StepError, StepQueued};
    /// # #[flow(slug = "community", input = String, step_queues)]
    /// # mod community { use pgflow_runtime::StepError;
    /// #   #[step] async fn classify(t: String) -> Result<String, StepError> { Ok(t) } }
    /// # async fn demo() -> Result<(), pgflow_runtime::worker::WorkerError> {
    /// use community::{Community, Step};
    /// StepQueued::<Community>::worker(Step::Classify).run().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`WorkerError::DatabaseUrlMissing`] or [`WorkerError::DatabaseUrlInvalid`] without a usable
    /// `DATABASE_URL`, [`WorkerError::Database`] when the database cannot be reached, then as
    /// [`Worker::run`](crate::Worker::run).
    pub async fn run(self) -> Result<WorkerReport, WorkerError> {
        WorkerBuilder::<F, FromEnv>::deployment::<StepQueued<F>>(FromEnv, self.queue)
            .run()
            .await
    }
}

impl<F: Flow> Clone for StepWorkerSpec<F> {
    fn clone(&self) -> Self {
        StepWorkerSpec {
            step: self.step,
            queue: self.queue,
        }
    }
}

impl<F: Flow> fmt::Debug for StepWorkerSpec<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StepWorkerSpec")
            .field("flow", &F::SLUG)
            .field("step", &self.step)
            .field("queue", &self.queue)
            .finish()
    }
}
