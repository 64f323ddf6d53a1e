//! The operator's read layer: what runs exist and how they went, and how the fleet serving them is doing.
//!
//! [`Admin`] answers the questions an operator asks of a pgflow database, as typed values, for the dashboard
//! (`pgflow-dashboard`) and the `pgflow` command line alike:
//!
//! - [`Admin::runs`]: runs newest first, filtered ([`RunFilter`]: flow or alias, version, status, a start-time
//!   range, an input value at a JSON path), one keyset page at a time ([`Page`], [`Cursor`]);
//!   [`Admin::run_counts`]: how many runs match per status (bounded by [`COUNT_CAP`]).
//! - [`Admin::run`]: one run in detail ([`RunDetail`]): its row, its steps with their dependencies and map
//!   progress, its tasks with their attempts (the earlier ones too: [`TaskAttempt`]), its retries and replays, its event log, and the operator actions
//!   taken on it.
//! - [`Admin::queues`], [`Admin::queue_rates`], [`Admin::uncovered_routes`], [`Admin::coverage_gaps`]: queue
//!   depth and age, claims and completions per minute, and work that no live worker can run.
//! - [`Admin::workers`], [`Admin::worker_functions`], [`Admin::flows`], [`Admin::aliases`],
//!   [`Admin::version_retirable`]: live workers with their heartbeats and routes, fenced (disabled) worker
//!   functions, compiled versions, and aliases with whether each version behind them is retirable.
//! - [`Admin::schedules`]: schedules with their next fire and the status of their last run.
//! - [`Admin::actions`] and [`Admin::record_action`]: the operator record (`pgflow.operator_actions`).
//!
//! Every read is one read-only transaction, so the parts of an answer agree with each other. With
//! [`Admin::hide_payloads`] no run input, step or task output leaves the database (the fields are `None`).
//!
//! The role needs read access to pgflow's tables and PGMQ's queue tables (the owner of the schema has it); the
//! operator record needs insert on `pgflow.operator_actions`. Under a pooler in transaction mode, pass
//! [`Admin::with_pooling`].
//!
//! ```no_run
//! # async fn example(pool: sqlx::PgPool) -> Result<(), pgflow_runtime::admin::AdminError> {
//! use pgflow_runtime::admin::{Admin, RunFilter};
//! use pgflow_runtime::client::RunStatus;
//!
//! let admin = Admin::new(pool).hide_payloads(true);
//! let failed = admin.runs(&RunFilter::new().flow("community").status(RunStatus::Failed)).await?;
//! for run in &failed.items {
//!     let detail = admin.run(run.run_id).await?.expect("the run exists");
//!     println!("{} {:?}", run.run_id, detail.failed_tasks().map(|t| &t.error_message).collect::<Vec<_>>());
//! }
//! # Ok(()) }
//! ```

mod attempts;
mod audit;
mod deployments;
mod fleet;
mod run;
mod runs;
mod schedules;

use sqlx::{PgPool, Postgres, Transaction};

use crate::pooling::Pooling;

pub use crate::decode::TaskStatus;
pub use crate::decode::{QueueMode, StepType};
pub use crate::worker::GapReason;
pub use attempts::{Attempt, AttemptEnd, AttemptOutcome, TaskAttempt, ATTEMPTS_PER_TASK};
pub use audit::{ActionKind, NewAction, OperatorAction};
pub use deployments::{AliasInfo, Blocker, FlowInfo, VersionInfo, VersionQueue};
pub use fleet::{
    CoverageGap, MinuteCounts, QueueInfo, QueueRates, Route, UncoveredRoute, WorkerFunction,
    WorkerInfo,
};
pub use run::{RetryRecord, RunDetail, RunEvent, RunInfo, StepDetail, TaskDetail};
pub use runs::{Cursor, Page, RunFilter, RunSummary, StatusCount, COUNT_CAP, MAX_PAGE};
pub use schedules::ScheduleInfo;

/// An error of the read layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdminError {
    /// The database refused or failed a query.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// A page cursor that this layer did not write (or that was cut short).
    #[error("bad page cursor `{0}`: expected `<microseconds since 1970>_<run uuid>` as a page's `next` gives it")]
    BadCursor(String),
}

/// The operator's read layer over a pool (see the [module documentation](self)). Cheap to clone.
#[derive(Debug, Clone)]
pub struct Admin {
    pool: PgPool,
    hide_payloads: bool,
    pooling: Pooling,
}

impl Admin {
    /// Reads through `pool`, with payloads shown and direct connections.
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            hide_payloads: false,
            pooling: Pooling::default(),
        }
    }

    /// With `true`, no run input, step output or task output is read: those fields are `None` in every answer.
    #[must_use]
    pub fn hide_payloads(mut self, hide: bool) -> Self {
        self.hide_payloads = hide;
        self
    }

    /// Whether payloads are hidden ([`Admin::hide_payloads`]).
    pub fn payloads_hidden(&self) -> bool {
        self.hide_payloads
    }

    /// How the pool reaches Postgres: [`Pooling::transaction`] behind PgBouncer in transaction mode (statements
    /// are then not prepared by name).
    #[must_use]
    pub fn with_pooling(mut self, pooling: Pooling) -> Self {
        self.pooling = pooling;
        self
    }

    /// The pool this layer reads through.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Whether statements may be prepared by name (not behind a pooler in transaction mode).
    fn persistent(&self) -> bool {
        !self.pooling.is_transaction()
    }

    /// A read-only transaction: every query of one answer sees the same snapshot.
    async fn read(&self) -> Result<Transaction<'static, Postgres>, AdminError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("set transaction isolation level repeatable read, read only")
            .persistent(self.persistent())
            .execute(&mut *tx)
            .await?;
        Ok(tx)
    }
}
