//! Deployed flows: one concrete version of a flow, its stable alias, and where its steps run.
//!
//! A [`Flow`] is the DAG and its handlers. A [`Deployment`] adds what a deployment needs and the flow's own
//! definition never carries: an optional stable alias (the name producers start, switched from version to
//! version) and an immutable [`Routing`] of the flow's steps to queues. Three kinds exist:
//!
//! * every `#[flow]` type is its own default deployment: no alias, every step on the flow's single queue;
//! * [`StepQueued<F>`](crate::StepQueued) deploys a flow with one generated private queue per step;
//! * `#[deployment]` declares a named deployment: an alias and a route map from the flow's steps to
//!   declared [`Queue`]s, which several steps, flows and versions may share.
//!
//! A queue worker (`QueueWorker<Q>`) polls one declared queue and runs every deployment it is given that
//! routes at least one step to that queue ([`RoutesTo<Q>`]).

use crate::flow::Flow;

/// A named, shared PGMQ queue, declared once with `#[queue("name")]` on a unit struct.
///
/// The name is checked while the attribute expands: a lowercase identifier of 1 to 47 characters
/// (`pgflow_runtime::queue_names::check_queue_name`), which PGMQ accepts too.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a declared queue",
    label = "not a queue",
    note = "declare a queue once: `#[pgflow_runtime::queue(\"classify_threads\")] pub struct ClassifyThreads;`"
)]
pub trait Queue: Send + Sync + 'static {
    /// The queue name, as PGMQ and `pgflow.steps.queue_name` spell it.
    const NAME: &'static str;
}

/// Where the steps of one concrete version run. Immutable: a different routing is a new concrete version.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Routing<S: 'static> {
    /// Every step on the flow's single queue, `lower(flow_slug)` (queue mode `flow`).
    FlowQueue,
    /// Every step on its own private queue, as `#[flow(..., step_queues)]` resolved them (queue mode `step`).
    StepQueues(&'static [(S, &'static str)]),
    /// Every step on a named, shared queue (queue mode `named`): the route map, total over the step enum.
    Named(fn(S) -> &'static str),
}

/// One deployable concrete version: the exact flow type, an optional stable alias and its routing.
///
/// Implemented by `#[flow]` for every flow type (the default deployment), by
/// [`StepQueued<F>`](crate::StepQueued), and by `#[deployment]` for named deployments. Workers compile or
/// verify each deployment at startup: `pgflow.ensure_flow_compiled` with the flow's shape, the routing, and
/// the alias, which is activated once the version is persisted.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a deployment",
    label = "not a deployment",
    note = "a `#[flow]` type is its own default deployment, `StepQueued<F>` deploys per-step queues, and `#[pgflow_runtime::deployment(alias = \"...\")]` declares one with named queues"
)]
pub trait Deployment: Send + Sync + 'static {
    /// The concrete flow (one version) this deploys.
    type Flow: Flow;

    /// The stable alias producers start (`start_flow(alias, ..)` resolves it to this version once
    /// activated); `None` leaves aliases alone (the concrete slug is the only name).
    const ALIAS: Option<&'static str>;

    /// Where each step runs.
    fn routing() -> Routing<<Self::Flow as Flow>::Step>;
}

/// A deployment that routes at least one step to queue `Q`: a queue worker for `Q` accepts only these.
///
/// `#[deployment]` implements it for every queue its route map names.
#[diagnostic::on_unimplemented(
    message = "deployment `{Self}` routes no step to queue `{Q}`",
    label = "routes nothing to `{Q}`",
    note = "a queue worker runs only deployments with a step on its queue: route a step of `{Self}` to `{Q}` in its `#[deployment]`, or serve `{Self}` from the worker of a queue it uses"
)]
pub trait RoutesTo<Q: Queue>: Deployment {}
