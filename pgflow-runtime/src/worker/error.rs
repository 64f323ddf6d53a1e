//! Why a worker refused to start or stopped with an error.

use crate::config::ConfigError;

/// A worker startup or fatal runtime error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// An invalid setting.
    #[error("invalid worker configuration: {0}")]
    Config(#[from] ConfigError),
    /// The `pgflow` schema is not installed.
    #[error("the pgflow schema is not installed (this build needs migration {required}); install it with `pgflow_sql::install` or enable `auto_install`")]
    SchemaMissing {
        /// The newest migration this build knows.
        required: String,
    },
    /// The installed schema is older than this build needs.
    #[error("the pgflow schema is at migration {installed}, this build needs {required}; upgrade with `pgflow_sql::install` or enable `auto_install`")]
    SchemaOutdated {
        /// The newest installed migration.
        installed: String,
        /// The newest migration this build knows.
        required: String,
    },
    /// Installing the schema failed.
    #[error("cannot install the pgflow schema: {0}")]
    Install(#[from] pgflow_sql::InstallError),
    /// The stored flow differs from this build's flow, and data loss is not allowed.
    #[error("flow `{flow_slug}` in the database differs from this build's definition: {}; deploy the change under a new flow slug, or start with `Compilation::AllowDataLoss` (deletes its runs)", differences.join("; "))]
    ShapeMismatch {
        /// The flow slug.
        flow_slug: String,
        /// Every difference `ensure_flow_compiled` reported.
        differences: Vec<String>,
    },
    /// The flow is not in the database (with `Compilation::Skip`).
    #[error("flow `{flow_slug}` is not in the database")]
    FlowMissing {
        /// The flow slug.
        flow_slug: String,
    },
    /// The database's flow lacks a step this build has.
    #[error("flow `{flow_slug}` in the database has no step `{step_slug}`")]
    StepMissing {
        /// The flow slug.
        flow_slug: String,
        /// The step slug.
        step_slug: String,
    },
    /// A plain worker found a flow whose steps use several queues.
    #[error("flow `{flow_slug}` sends its tasks to several queues ({}); run one step worker per step (`StepQueued::worker`)", queues.join(", "))]
    SeveralQueues {
        /// The flow slug.
        flow_slug: String,
        /// The persisted queues.
        queues: Vec<String>,
    },
    /// The step's persisted queue is not the route this build computed.
    #[error("step `{step_slug}` of flow `{flow_slug}` uses queue `{persisted_queue}` in the database, but this build routes it to `{expected_queue}`")]
    QueueMismatch {
        /// The flow slug.
        flow_slug: String,
        /// The step slug.
        step_slug: String,
        /// The macro's route.
        expected_queue: String,
        /// `pgflow.steps.queue_name`.
        persisted_queue: String,
    },
    /// The worker function is disabled (`pgflow.worker_functions.enabled = false`).
    #[error("worker function `{function_name}` is disabled; enable it (`update pgflow.worker_functions set enabled = true ...`) before starting its workers")]
    FunctionDisabled {
        /// The worker function name.
        function_name: String,
    },
    /// A step worker read messages it must not run; it claimed none of them and disabled its function.
    #[error("queue `{queue}` holds messages {msg_ids:?} that are not tasks of flow `{flow_slug}` step `{step_slug}`; claimed none, disabled worker function `{function_name}` and stopped")]
    Unsupported {
        /// The queue.
        queue: String,
        /// The message ids of the batch.
        msg_ids: Vec<i64>,
        /// The worker's flow.
        flow_slug: String,
        /// The worker's step.
        step_slug: String,
        /// The disabled worker function.
        function_name: String,
    },
    /// A database call at startup or shutdown failed.
    #[error("database error while {during}: {source}")]
    Database {
        /// What the worker was doing.
        during: &'static str,
        /// The cause.
        #[source]
        source: sqlx::Error,
    },
}

pub(crate) trait Context<T> {
    fn during(self, during: &'static str) -> Result<T, WorkerError>;
}

impl<T> Context<T> for Result<T, sqlx::Error> {
    fn during(self, during: &'static str) -> Result<T, WorkerError> {
        self.map_err(|source| WorkerError::Database { during, source })
    }
}
