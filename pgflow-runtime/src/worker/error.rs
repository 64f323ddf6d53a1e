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
    /// SQL rejected the flow's queue routing or the worker's subscription (SQLSTATE `PF0xx`): a queue
    /// mode or route map that differs from the deployed one, a resolver disagreement, a queue not
    /// privately owned, or a subscription that does not match the persisted route.
    #[error("flow `{flow_slug}`: {message}{}{}", detail.as_ref().map(|d| format!(" {d}")).unwrap_or_default(), hint.as_ref().map(|h| format!(" Hint: {h}")).unwrap_or_default())]
    Routing {
        /// The flow slug.
        flow_slug: String,
        /// The SQLSTATE (`PF001`, `PF002`, `PF013`, `PF020`, ...).
        code: String,
        /// The SQL MESSAGE.
        message: String,
        /// The SQL DETAIL.
        detail: Option<String>,
        /// The SQL HINT.
        hint: Option<String>,
    },
    /// The worker function is disabled (`pgflow.worker_functions.enabled = false`).
    #[error("worker function `{function_name}` is disabled ({}); after fixing the cause, enable it with `select pgflow.enable_worker_function('{function_name}')`", reason.as_deref().unwrap_or("no reason recorded"))]
    FunctionDisabled {
        /// The worker function name.
        function_name: String,
        /// `pgflow.worker_functions.disabled_reason`.
        reason: Option<String>,
    },
    /// The worker read messages it must not run; it claimed none of them, disabled its worker
    /// function persistently and stopped.
    #[error(transparent)]
    Unsupported(Box<UnsupportedBatch>),
    /// The database answered something this build does not understand.
    #[error("unexpected database result while {during}: {result}")]
    UnexpectedResult {
        /// What the worker was doing.
        during: &'static str,
        /// What came back.
        result: String,
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

/// Turns a `PF0xx` database error into [`WorkerError::Routing`], anything else into `Database`.
pub(crate) fn routing_or_database(
    flow_slug: &str,
    during: &'static str,
    source: sqlx::Error,
) -> WorkerError {
    if let Some(db) = source.as_database_error() {
        if let Some(pg) = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
            if pg.code().starts_with("PF") {
                return WorkerError::Routing {
                    flow_slug: flow_slug.to_owned(),
                    code: pg.code().to_owned(),
                    message: pg.message().to_owned(),
                    detail: pg.detail().map(str::to_owned),
                    hint: pg.hint().map(str::to_owned),
                };
            }
        }
    }
    WorkerError::Database { during, source }
}

/// A read batch that a worker must not run (see [`WorkerError::Unsupported`]). No bodies.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("queue `{queue}` returned messages {msg_ids:?} that are not all tasks this worker runs ({}) (unsupported messages name flows {message_flows:?}, steps {message_steps:?}); claimed none, disabled worker function `{function_name}` and stopped", supported.iter().map(|(f, s)| format!("{f}/{s}")).collect::<Vec<_>>().join(", "))]
#[non_exhaustive]
pub struct UnsupportedBatch {
    /// The queue.
    pub queue: String,
    /// The message ids of the batch (all visible again).
    pub msg_ids: Vec<i64>,
    /// The (flow, step) pairs the worker runs from the queue.
    pub supported: Vec<(String, String)>,
    /// The disabled worker function.
    pub function_name: String,
    /// Flows named by the unsupported messages (from their tasks, or else their bodies).
    pub message_flows: Vec<String>,
    /// Steps named by the unsupported messages.
    pub message_steps: Vec<String>,
}

pub(crate) trait Context<T> {
    fn during(self, during: &'static str) -> Result<T, WorkerError>;
}

impl<T> Context<T> for Result<T, sqlx::Error> {
    fn during(self, during: &'static str) -> Result<T, WorkerError> {
        self.map_err(|source| WorkerError::Database { during, source })
    }
}
