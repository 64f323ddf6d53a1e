//! What a worker serves, decided in one place: one queue, and on it the steps of one or more concrete flows,
//! each with its type-erased handlers.

use std::time::Duration;

use futures::future::BoxFuture;
use serde_json::{json, Value};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::context::StepContext;
use crate::error::StepError;
use crate::flow::{task_input, Flow, FlowStep};

/// How a concrete flow is laid out on queues (sent to `ensure_flow_compiled` at startup).
#[derive(Debug, Clone)]
pub(crate) enum Routing {
    /// Every step on the flow's single default queue (`lower(flow_slug)`).
    FlowQueue,
    /// Every step on its own private queue; the route map the macro computed, in step order.
    StepQueues(Vec<(&'static str, &'static str)>),
}

impl Routing {
    /// `(queue_mode, routes)` arguments of `ensure_flow_compiled`.
    pub(crate) fn compile_arguments(&self) -> (&'static str, Option<Value>) {
        match self {
            Routing::FlowQueue => ("flow", None),
            Routing::StepQueues(routes) => (
                "step",
                Some(Value::Array(
                    routes
                        .iter()
                        .map(|(step, queue)| json!({"step_slug": step, "queue_name": queue}))
                        .collect(),
                )),
            ),
        }
    }

    /// The queue a step's tasks go to.
    pub(crate) fn queue_of(&self, flow_slug: &str, step_slug: &str) -> Option<String> {
        match self {
            Routing::FlowQueue => Some(crate::queue_names::default_queue_name(flow_slug)),
            Routing::StepQueues(routes) => routes
                .iter()
                .find(|(s, _)| *s == step_slug)
                .map(|(_, q)| (*q).to_owned()),
        }
    }
}

/// The facts a handler's context is built from.
pub(crate) struct TaskFacts {
    pub(crate) run_id: Uuid,
    pub(crate) task_index: i32,
    pub(crate) attempt: i32,
    pub(crate) msg_id: i64,
    pub(crate) input: Value,
    pub(crate) flow_input: Option<Value>,
    pub(crate) pool: PgPool,
    pub(crate) cancellation: CancellationToken,
}

/// A handler future, or why there is none.
pub(crate) type Dispatched = Result<BoxFuture<'static, Result<Value, StepError>>, String>;

/// Runs one step of a concrete flow without knowing its Rust type.
pub(crate) type DispatchFn = fn(step_slug: &str, facts: TaskFacts) -> Dispatched;

/// The one generic-to-erased bridge: decodes the step slug into `F::Step`, builds the typed context and
/// input, and calls the flow's generated dispatch.
fn dispatch<F: Flow>(step_slug: &str, facts: TaskFacts) -> Dispatched {
    let step = F::Step::from_slug(step_slug).ok_or_else(|| {
        format!(
            "flow `{}` has no handler for step `{step_slug}` in this build",
            F::SLUG
        )
    })?;
    let ctx = StepContext::<F>::new(facts.run_id, step, facts.pool)
        .with_task_index(facts.task_index)
        .with_attempt(facts.attempt)
        .with_msg_id(facts.msg_id)
        .with_cancellation(facts.cancellation);
    let input = task_input(step, facts.input, facts.flow_input);
    Ok(F::dispatch(step, input, ctx))
}

/// One concrete flow a worker can run.
pub(crate) struct FlowEntry {
    pub(crate) slug: &'static str,
    pub(crate) shape: Value,
    pub(crate) routing: Routing,
    /// Every step slug of the flow, in step order.
    pub(crate) steps: Vec<&'static str>,
    /// The steps this worker runs; `None`: every step of the flow (a plain worker).
    pub(crate) served_step: Option<&'static str>,
    pub(crate) dispatch: DispatchFn,
}

impl FlowEntry {
    /// A flow served whole on its single queue.
    pub(crate) fn plain<F: Flow>() -> Self {
        FlowEntry::new::<F>(Routing::FlowQueue, None)
    }

    /// One step of a flow deployed with per-step queues.
    pub(crate) fn step<F: Flow>(step: F::Step, routes: &[(F::Step, &'static str)]) -> Self {
        let routes = routes.iter().map(|(s, q)| (s.slug(), *q)).collect();
        FlowEntry::new::<F>(Routing::StepQueues(routes), Some(step.slug()))
    }

    fn new<F: Flow>(routing: Routing, served_step: Option<&'static str>) -> Self {
        FlowEntry {
            slug: F::SLUG,
            shape: F::shape(),
            routing,
            steps: F::Step::ALL.iter().map(|s| s.slug()).collect(),
            served_step,
            dispatch: dispatch::<F>,
        }
    }
}

/// One queue and the flows a worker runs from it.
pub(crate) struct Subscription {
    pub(crate) queue: String,
    pub(crate) flows: Vec<FlowEntry>,
}

impl Subscription {
    /// A worker for one flow entry: its queue is the served step's route, or the flow's default queue.
    pub(crate) fn single(entry: FlowEntry) -> Self {
        let step = entry
            .served_step
            .unwrap_or_else(|| entry.steps.first().copied().unwrap_or_default());
        let queue = entry
            .routing
            .queue_of(entry.slug, step)
            .unwrap_or_else(|| crate::queue_names::default_queue_name(entry.slug));
        Subscription {
            queue,
            flows: vec![entry],
        }
    }

    /// The flow that owns claimed tasks of `flow_slug`.
    pub(crate) fn flow(&self, flow_slug: &str) -> Option<&FlowEntry> {
        self.flows.iter().find(|f| f.slug == flow_slug)
    }

    /// The exact (flow, step) pairs this worker runs from its queue, as the claim and registration take them:
    /// every step of a plain worker's flow, or a step worker's one step.
    pub(crate) fn pairs(&self) -> (Vec<&'static str>, Vec<&'static str>) {
        let mut flows = Vec::new();
        let mut steps = Vec::new();
        for f in &self.flows {
            for step in &f.steps {
                if f.served_step.is_none_or(|s| s == *step) {
                    flows.push(f.slug);
                    steps.push(*step);
                }
            }
        }
        (flows, steps)
    }

    /// `"flow"` or `"flow/step"` for logs.
    pub(crate) fn describe(&self) -> String {
        self.flows
            .iter()
            .map(|f| match f.served_step {
                Some(step) => format!("{}/{step}", f.slug),
                None => f.slug.to_owned(),
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// A step timeout from the database, as a deadline a tokio timer can hold (at most a year).
pub(crate) fn step_deadline(timeout_secs: i64) -> Duration {
    const YEAR: u64 = 365 * 24 * 3600;
    Duration::from_secs(u64::try_from(timeout_secs).unwrap_or(1).clamp(1, YEAR))
}
