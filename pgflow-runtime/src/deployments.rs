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
//!
//! ```
//! use pgflow_runtime::{deployment, flow, queue, Deployment, Queue, Routing};
//!
//! #[flow(slug = "communityThreadsV1", input = String)]
//! pub mod community_v1 {
//!     use pgflow_runtime::StepError;
//!
//!     #[step]
//!     async fn classify(thread: String) -> Result<String, StepError> {
//!         Ok(thread)
//!     }
//!
//!     #[step(depends_on = [classify], slug = "deliverSlack")]
//!     async fn deliver_slack(classify: String) -> Result<(), StepError> {
//!         let _ = classify;
//!         Ok(())
//!     }
//! }
//!
//! /// Classification work, shared by every version of the community flow.
//! #[queue("classify_threads")]
//! pub struct ClassifyThreads;
//!
//! /// Slack deliveries.
//! #[queue("deliver_slack_alerts")]
//! pub struct DeliverSlackAlerts;
//!
//! /// Version 1, started as `communityThreads`. `name = ..` because `CommunityV1` is the flow type.
//! #[deployment(alias = "communityThreads", name = CommunityV1Deployment)]
//! pub fn community_v1(step: community_v1::Step) {
//!     match step {
//!         community_v1::Step::Classify => ClassifyThreads,
//!         community_v1::Step::DeliverSlack => DeliverSlackAlerts,
//!     }
//! }
//!
//! fn main() {
//!     use community_v1::{CommunityV1, Step};
//!
//!     assert_eq!(ClassifyThreads::NAME, "classify_threads");
//!     assert_eq!(CommunityV1Deployment::ALIAS, Some("communityThreads"));
//!     let Routing::Named(route) = CommunityV1Deployment::routing() else { unreachable!() };
//!     assert_eq!(route(Step::Classify), "classify_threads");
//!     assert_eq!(route(Step::DeliverSlack), "deliver_slack_alerts");
//!
//!     // The flow type is its own default deployment: no alias, every step on the flow's queue.
//!     assert_eq!(CommunityV1::ALIAS, None);
//!     assert!(matches!(CommunityV1::routing(), Routing::FlowQueue));
//! }
//! ```

use crate::flows::Flow;

/// A named, shared PGMQ queue, declared once with [`#[queue("name")]`](macro@crate::queue) on a unit
/// struct.
///
/// The name is checked while the attribute expands: a lowercase identifier of 1 to 47 characters
/// ([`check_queue_name`](pgflow_sql::names::check_queue_name)), which PGMQ accepts too. Several
/// steps, flows and versions may route to one queue.
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
/// Implemented by `#[flow]` for every flow type (the default deployment: `ALIAS = None`,
/// [`Routing::FlowQueue`]), by [`StepQueued<F>`](crate::StepQueued) ([`Routing::StepQueues`]), and by
/// [`#[deployment]`](macro@crate::deployment) for named deployments ([`Routing::Named`]). Workers compile or
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
/// [`#[deployment]`](macro@crate::deployment) implements it for every queue its route map names.
#[diagnostic::on_unimplemented(
    message = "deployment `{Self}` routes no step to queue `{Q}`",
    label = "routes nothing to `{Q}`",
    note = "a queue worker runs only deployments with a step on its queue: route a step of `{Self}` to `{Q}` in its `#[deployment]`, or serve `{Self}` from the worker of a queue it uses"
)]
pub trait RoutesTo<Q: Queue>: Deployment {}
