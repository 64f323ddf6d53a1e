//! Why a worker refused to start or stopped with an error.

use pgflow_sql::SqlState;

use crate::config::ConfigError;
use crate::decode::text_enum;

/// A worker startup or fatal runtime error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// A declared schedule is invalid or was refused by the database (nothing of it was stored).
    #[error("{0}")]
    Schedule(#[from] crate::schedules::ScheduleError),
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
        /// The SQLSTATE ([`SqlState::RoutingChanged`], [`SqlState::RouteMapDisagrees`],
        /// [`SqlState::QueueNotPrivate`], [`SqlState::SubscriptionInvalid`], ...).
        code: SqlState,
        /// The SQL MESSAGE.
        message: String,
        /// The SQL DETAIL.
        detail: Option<String>,
        /// The SQL HINT.
        hint: Option<String>,
    },
    /// The worker was given no deployment to run.
    #[error("the worker for queue `{queue}` serves no deployment; give it at least one (`serve::<D>()`)")]
    EmptyRegistry {
        /// The queue.
        queue: String,
    },
    /// Two deployments of the worker's registry are the same concrete flow.
    #[error("the worker for queue `{queue}` serves concrete flow `{flow_slug}` twice; serve each version once (one deployment per concrete flow slug)")]
    DuplicateFlow {
        /// The queue.
        queue: String,
        /// The concrete flow slug given twice.
        flow_slug: String,
    },
    /// A deployment of the registry routes no step to the worker's queue.
    #[error("deployment of flow `{flow_slug}` routes no step to queue `{queue}`, so a worker of that queue cannot serve it; serve it from the worker of a queue it uses")]
    NotRoutedHere {
        /// The queue.
        queue: String,
        /// The concrete flow slug.
        flow_slug: String,
    },
    /// The queue can carry tasks this worker cannot run (`pgflow.queue_coverage_gaps`); nothing was
    /// registered.
    #[error("queue `{queue}` can carry tasks this worker cannot run, so it refuses to start and registers nothing: {}", gaps.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    CoverageGap {
        /// The queue.
        queue: String,
        /// Every missing (flow, step) pair, once per reason.
        gaps: Vec<CoverageGap>,
    },
    /// A zero-configuration worker found no `DATABASE_URL`.
    #[error("`DATABASE_URL` is not set; set it to the database's URL (postgres://user:password@host:5432/database), or build the worker with a pool (`builder(pool)`)")]
    DatabaseUrlMissing,
    /// A zero-configuration worker found a `DATABASE_URL` it cannot use (the value is not repeated: it may
    /// hold a password).
    #[error("`DATABASE_URL` is not a valid PostgreSQL URL ({reason}); set it to postgres://user:password@host:5432/database")]
    DatabaseUrlInvalid {
        /// Why it was refused.
        reason: String,
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
            let code = SqlState::from_code(pg.code());
            if code.is_pgflow() {
                return WorkerError::Routing {
                    flow_slug: flow_slug.to_owned(),
                    code,
                    message: pg.message().to_owned(),
                    detail: pg.detail().map(str::to_owned),
                    hint: pg.hint().map(str::to_owned),
                };
            }
        }
    }
    database(during, source)
}

/// A failed database call: [`WorkerError::UnexpectedResult`] when it ran but its answer cannot be decoded,
/// else [`WorkerError::Database`].
fn database(during: &'static str, source: sqlx::Error) -> WorkerError {
    match source {
        sqlx::Error::ColumnDecode { .. } | sqlx::Error::Decode(_) => {
            WorkerError::UnexpectedResult {
                during,
                result: source.to_string(),
            }
        }
        source => WorkerError::Database { during, source },
    }
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

text_enum! {
    /// Why a queue must be able to run a (flow, step) pair (`pgflow.queue_coverage_gaps`'s `reason`).
    #[non_exhaustive]
    pub enum GapReason {
        /// An alias points at the version, which routes the step to the queue: new runs create its tasks
        /// here.
        ActiveAlias = "active_alias",
        /// A started run has the step unfinished and may still create its task here.
        StartedRun = "started_run",
        /// A task of the step waits or runs in the queue.
        TaskSnapshot = "task_snapshot",
    }
}

/// One (flow, step) pair a queue can carry that a worker cannot run, with why (see
/// [`WorkerError::CoverageGap`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("flow `{flow_slug}` step `{step_slug}` ({reason}: {count}, e.g. {}): {repair}", examples.join(", "))]
#[non_exhaustive]
pub struct CoverageGap {
    /// The concrete flow slug.
    pub flow_slug: String,
    /// The step slug.
    pub step_slug: String,
    /// Why the queue needs it.
    pub reason: GapReason,
    /// How many aliases, runs or tasks make it needed.
    pub count: i64,
    /// Up to three of them: alias names, run ids, or `{"run_id", "msg_id"}` of tasks.
    pub examples: Vec<String>,
    /// How to repair the gap.
    pub repair: String,
}

pub(crate) trait Context<T> {
    fn during(self, during: &'static str) -> Result<T, WorkerError>;
}

impl<T> Context<T> for Result<T, sqlx::Error> {
    fn during(self, during: &'static str) -> Result<T, WorkerError> {
        self.map_err(|source| database(during, source))
    }
}
