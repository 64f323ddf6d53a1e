//! What a worker runs, decided in one place: one queue, and on it the steps that a registry of deployments
//! (one concrete flow each) routes there, each flow with its type-erased handlers.

use std::marker::PhantomData;
use std::time::Duration;

use futures::future::BoxFuture;
use serde_json::{json, Value};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::context::StepContext;
use crate::decode::QueueMode;
use crate::deployments::{Deployment, Routing};
use crate::error::StepError;
use crate::flows::{task_input, Flow, FlowStep};

/// A flow's own default deployment: no alias, every step on the flow's single queue. A plain worker
/// (`Worker::<F>`) normalizes its flow to this.
pub(crate) struct DefaultDeployment<F>(PhantomData<fn() -> F>);

impl<F: Flow> Deployment for DefaultDeployment<F> {
    type Flow = F;
    const ALIAS: Option<&'static str> = None;

    fn routing() -> Routing<F::Step> {
        Routing::FlowQueue
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
    pub(crate) pooled: bool,
    pub(crate) cancellation: CancellationToken,
}

/// A handler future, or why there is none.
pub(crate) type Dispatched = Result<BoxFuture<'static, Result<Value, StepError>>, String>;

/// Runs one step of a concrete flow without knowing its Rust type.
type DispatchFn = fn(step_slug: &str, facts: TaskFacts) -> Dispatched;

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
        .with_cancellation(facts.cancellation)
        .behind_transaction_pooler(facts.pooled);
    let input = task_input(step, facts.input, facts.flow_input);
    Ok(F::dispatch(step, input, ctx))
}

/// One deployment a worker runs: a concrete flow, its alias and routing, and the steps it serves.
pub(crate) struct FlowEntry {
    pub(crate) slug: &'static str,
    pub(crate) shape: Value,
    pub(crate) alias: Option<&'static str>,
    pub(crate) mode: QueueMode,
    /// Every step with its queue, in step order.
    pub(crate) routes: Vec<(&'static str, String)>,
    /// The steps this worker runs: those routed to its queue, in step order.
    pub(crate) served: Vec<&'static str>,
    dispatch: DispatchFn,
}

impl FlowEntry {
    /// The entry of deployment `D` for a worker polling `queue`: it serves exactly the steps `D` routes there.
    pub(crate) fn of<D: Deployment>(queue: &str) -> Self {
        let slug = <D::Flow as Flow>::SLUG;
        let steps = <<D::Flow as Flow>::Step as FlowStep>::ALL;
        let (mode, routes): (QueueMode, Vec<(&'static str, String)>) = match D::routing() {
            Routing::FlowQueue => {
                let queue = pgflow_sql::names::default_queue_name(slug);
                (
                    QueueMode::Flow,
                    steps.iter().map(|s| (s.slug(), queue.clone())).collect(),
                )
            }
            Routing::StepQueues(table) => (
                QueueMode::Step,
                steps
                    .iter()
                    .map(|s| {
                        let queue = table
                            .iter()
                            .find(|(t, _)| t == s)
                            .map_or_else(String::new, |(_, q)| (*q).to_owned());
                        (s.slug(), queue)
                    })
                    .collect(),
            ),
            Routing::Named(route) => (
                QueueMode::Named,
                steps
                    .iter()
                    .map(|s| (s.slug(), route(*s).to_owned()))
                    .collect(),
            ),
        };
        let served = routes
            .iter()
            .filter(|(_, q)| q == queue)
            .map(|(s, _)| *s)
            .collect();
        FlowEntry {
            slug,
            shape: <D::Flow as Flow>::shape(),
            alias: D::ALIAS,
            mode,
            routes,
            served,
            dispatch: dispatch::<D::Flow>,
        }
    }

    /// `(queue_mode, routes)` arguments of `ensure_flow_compiled`: `routes` is `[{"step_slug", "queue_name"}]`
    /// in step order, or NULL for a flow-mode flow.
    pub(crate) fn compile_arguments(&self) -> (&'static str, Option<Value>) {
        let routes = match self.mode {
            QueueMode::Flow => None,
            QueueMode::Step | QueueMode::Named => Some(Value::Array(
                self.routes
                    .iter()
                    .map(|(step, queue)| json!({"step_slug": step, "queue_name": queue}))
                    .collect(),
            )),
        };
        (self.mode.as_str(), routes)
    }

    /// Whether this worker runs every step of the flow.
    pub(crate) fn serves_whole_flow(&self) -> bool {
        self.served.len() == self.routes.len()
    }

    /// `flow` when every step is served, else `flow/step+step`.
    fn describe(&self) -> String {
        if self.serves_whole_flow() {
            self.slug.to_owned()
        } else {
            format!("{}/{}", self.slug, self.served.join("+"))
        }
    }
}

/// One queue and the deployments a worker runs from it, keyed by concrete flow slug.
pub(crate) struct Registry {
    pub(crate) queue: String,
    pub(crate) flows: Vec<FlowEntry>,
}

impl Registry {
    /// An empty registry for `queue`.
    pub(crate) fn new(queue: impl Into<String>) -> Self {
        Registry {
            queue: queue.into(),
            flows: Vec::new(),
        }
    }

    /// Adds deployment `D`, serving the steps it routes to this registry's queue.
    pub(crate) fn add<D: Deployment>(&mut self) {
        let entry = FlowEntry::of::<D>(&self.queue);
        self.flows.push(entry);
    }

    /// Starts the handler of `step_slug` of concrete flow `flow_slug`, when this worker serves that pair.
    pub(crate) fn dispatch(
        &self,
        flow_slug: &str,
        step_slug: &str,
        facts: TaskFacts,
    ) -> Dispatched {
        let Some(flow) = self.flows.iter().find(|f| f.slug == flow_slug) else {
            return Err(format!(
                "this worker has no flow `{flow_slug}` (it serves {} on queue `{}`)",
                self.describe(),
                self.queue
            ));
        };
        if !flow.served.contains(&step_slug) {
            return Err(format!(
                "this worker does not serve step `{step_slug}` of flow `{flow_slug}` (it serves {} on queue `{}`)",
                self.describe(),
                self.queue
            ));
        }
        (flow.dispatch)(step_slug, facts)
    }

    /// The exact (flow, step) pairs this worker runs from its queue, as the coverage check, the claim and
    /// registration take them.
    pub(crate) fn pairs(&self) -> (Vec<&'static str>, Vec<&'static str>) {
        let mut flows = Vec::new();
        let mut steps = Vec::new();
        for f in &self.flows {
            for step in &f.served {
                flows.push(f.slug);
                steps.push(*step);
            }
        }
        (flows, steps)
    }

    /// `flow, flow/step` for logs.
    pub(crate) fn describe(&self) -> String {
        self.flows
            .iter()
            .map(FlowEntry::describe)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// A step timeout from the database, as a deadline a tokio timer can hold (at most a year).
pub(crate) fn step_deadline(timeout_secs: i64) -> Duration {
    const YEAR: u64 = 365 * 24 * 3600;
    Duration::from_secs(u64::try_from(timeout_secs).unwrap_or(1).clamp(1, YEAR))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deployments::Queue;

    #[crate::flow(slug = "registryFlow", input = u32, step_queues, crate = "crate")]
    mod registry_flow {
        use crate::StepError;

        #[step]
        async fn first(n: u32) -> Result<u32, StepError> {
            Ok(n)
        }

        #[step(depends_on = [first])]
        async fn second(first: u32) -> Result<u32, StepError> {
            Ok(first)
        }

        #[step(depends_on = [first])]
        async fn third(first: u32) -> Result<u32, StepError> {
            Ok(first)
        }
    }

    use registry_flow::{RegistryFlow, Step};

    #[crate::queue("shared_work", crate = "crate")]
    struct Shared;

    #[crate::queue("other_work", crate = "crate")]
    struct Other;

    #[crate::deployment(alias = "registry", crate = "crate")]
    fn named(step: Step) {
        match step {
            Step::First | Step::Third => Shared,
            Step::Second => Other,
        }
    }

    #[test]
    fn a_named_deployment_serves_exactly_the_steps_routed_to_the_queue_and_sends_every_route_in_step_order(
    ) {
        let entry = FlowEntry::of::<Named>(Shared::NAME);
        assert_eq!(entry.served, ["first", "third"]);
        assert!(!entry.serves_whole_flow());
        assert_eq!(entry.alias, Some("registry"));
        let (mode, routes) = entry.compile_arguments();
        assert_eq!(mode, "named");
        assert_eq!(
            routes.unwrap(),
            json!([
                {"step_slug": "first", "queue_name": "shared_work"},
                {"step_slug": "second", "queue_name": "other_work"},
                {"step_slug": "third", "queue_name": "shared_work"},
            ])
        );
        let mut registry = Registry::new(Shared::NAME);
        registry.add::<Named>();
        assert_eq!(
            registry.pairs(),
            (vec!["registryFlow", "registryFlow"], vec!["first", "third"])
        );
        assert_eq!(registry.describe(), "registryFlow/first+third");
    }

    #[test]
    fn a_default_deployment_serves_every_step_on_the_flow_queue_and_sends_no_route_map() {
        let entry = FlowEntry::of::<DefaultDeployment<RegistryFlow>>("registryflow");
        assert!(entry.serves_whole_flow());
        assert_eq!(entry.compile_arguments(), ("flow", None));
        assert_eq!(entry.alias, None);
        // Polled from any other queue, it serves nothing.
        assert!(
            FlowEntry::of::<DefaultDeployment<RegistryFlow>>("elsewhere")
                .served
                .is_empty()
        );
    }

    #[test]
    fn the_runtimes_default_deployment_agrees_with_the_one_flow_emits() {
        let ours = FlowEntry::of::<DefaultDeployment<RegistryFlow>>("registryflow");
        let emitted = FlowEntry::of::<RegistryFlow>("registryflow");
        assert_eq!(ours.alias, emitted.alias);
        assert_eq!(ours.mode, emitted.mode);
        assert_eq!(ours.routes, emitted.routes);
        assert_eq!(ours.served, emitted.served);
    }

    #[test]
    fn a_step_queued_deployment_serves_the_one_step_whose_private_queue_is_polled() {
        let queue = crate::StepQueued::<RegistryFlow>::queue_for(Step::Second);
        let entry = FlowEntry::of::<crate::StepQueued<RegistryFlow>>(queue);
        assert_eq!(entry.served, ["second"]);
        let (mode, routes) = entry.compile_arguments();
        assert_eq!(mode, "step");
        assert_eq!(routes.unwrap()[1]["queue_name"], queue);
    }
}
