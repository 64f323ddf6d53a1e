//! Workers and client for pgflow-rs: Postgres-native, compile-time typed DAG workflows.
//!
//! Define a flow with [`#[flow]`](macro@flow) on an inline module; the macro generates the flow
//! type (implementing [`Flow`]), the step enum (implementing [`FlowStep`]), the shape and the
//! dispatch code. [`StepQueued`] deploys a flow with one queue per step.

pub use pgflow_sql as sql;

pub mod context;
pub mod error;
pub mod flow;
pub mod queue_names;
pub mod step_queued;

#[doc(hidden)]
#[allow(missing_docs, unreachable_pub)]
pub mod __private;

pub use context::StepContext;
#[doc(hidden)]
pub use context::StepContextParts;
pub use error::{BoxError, FlowQueueNameError, QueueNameError, StepError, StepQueueNameError};
pub use flow::{task_input, Flow, FlowStep, StepKind, UnknownStep};
pub use pgflow_macros::{flow, step};
pub use step_queued::{StepQueueRoutes, StepQueued, StepWorkerSpec};

/// `Result<T, StepError>`, the usual handler return type.
pub type StepResult<T, E = StepError> = Result<T, E>;

/// The items a flow module usually needs: `use pgflow_runtime::prelude::*;`.
pub mod prelude {
    pub use crate::{flow, Flow, FlowStep, StepContext, StepError, StepQueued, StepResult};
}
