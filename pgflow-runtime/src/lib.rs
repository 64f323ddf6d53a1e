//! Workers and client for pgflow-rs: Postgres-native, compile-time typed DAG workflows.
//!
//! Define a flow with [`#[flow]`](macro@flow) on an inline module; the macro generates the flow
//! type (implementing [`Flow`]), the step enum (implementing [`FlowStep`]), the shape and the
//! dispatch code. The flow type is also its own default [`Deployment`] (every step on the flow's
//! single queue). [`StepQueued`] deploys a flow with one queue per step; the flow opts in with
//! `step_queues` in its `#[flow(...)]`. [`#[queue]`](macro@queue) declares a named, shared queue and
//! [`#[deployment]`](macro@deployment) a stable alias with a route map onto such queues (see
//! [`deployments`](mod@deployments)). A [`QueueWorker`] runs every deployment it serves on its queue, and
//! [`Client::start_deployed`] starts runs by alias.
//!
//! ```
//! use pgflow_runtime::{flow, Flow, FlowStep, StepContext, StepError, StepQueued};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Serialize, Deserialize)]
//! pub struct Thread { pub id: i64, pub text: String }
//!
//! #[derive(Serialize, Deserialize)]
//! pub struct Classification { pub route: String }
//!
//! #[flow(slug = "communityThreadsV1", input = Thread, max_attempts = 3, timeout = 60, step_queues)]
//! pub mod community {
//!     use super::*;
//!
//!     /// Root step: takes the flow input.
//!     #[step]
//!     async fn classify(thread: Thread) -> Result<Classification, StepError> {
//!         let route = if thread.text.contains('?') { "help" } else { "chat" };
//!         Ok(Classification { route: route.into() })
//!     }
//!
//!     /// Runs only for help threads; takes its dependency by name.
//!     #[step(depends_on = [classify], slug = "deliverSlack",
//!            if = { classify: { route: "help" } }, when_unmet = skip_cascade)]
//!     async fn deliver_slack(
//!         classify: Classification,
//!         ctx: &StepContext<Community>,
//!     ) -> Result<(), StepError> {
//!         let _ = (classify.route, ctx.run_id());
//!         Ok(())
//!     }
//! }
//!
//! // The flow module must sit at module level (not inside a function) so `use super::*` sees
//! // the types; hence the explicit `main` in this example.
//! fn main() {
//!     use community::{Community, Step};
//!     assert_eq!(Community::SLUG, "communityThreadsV1");
//!     assert_eq!(Step::DeliverSlack.slug(), "deliverSlack");
//!     assert_eq!(Community::shape()["steps"][1]["whenUnmet"], "skip-cascade");
//!     let spec = StepQueued::<Community>::worker(Step::Classify);
//!     assert_eq!(spec.queue(), "communitythreadsv1__classify");
//! }
//! ```

/// The SQL core: its migrations and installer, the slug and queue-name rules ([`sql::names`]), and the
/// SQLSTATE codes it raises ([`sql::SqlState`]).
pub use pgflow_sql as sql;

pub mod admin;
pub mod client;
mod config;
mod context;
mod decode;
pub mod deployments;
mod error;
pub mod flow_control;
pub mod flows;
pub mod observability;
pub mod pooling;
pub mod schedules;
mod statements;
pub mod step_queued;
#[cfg(feature = "testing")]
pub mod testing;
mod watch;
pub mod worker;

#[doc(hidden)]
#[allow(missing_docs, unreachable_pub)]
pub mod __private;

pub use client::Client;
pub use context::StepContext;
pub use deployments::{Deployment, Queue, RoutesTo, Routing};
pub use error::{BoxError, StepError};
pub use flows::{Flow, FlowStep};
pub use pgflow_macros::{deployment, flow, queue, schedule, step};
pub use step_queued::StepQueued;
pub use worker::{QueueWorker, Worker};

/// `Result<T, StepError>`, the usual handler return type.
pub type StepResult<T, E = StepError> = Result<T, E>;

/// The items a flow module usually needs: `use pgflow_runtime::prelude::*;`.
pub mod prelude {
    pub use crate::{
        deployment, flow, queue, Client, Deployment, Flow, FlowStep, Queue, QueueWorker, RoutesTo,
        Routing, StepContext, StepError, StepQueued, StepResult, Worker,
    };
}
