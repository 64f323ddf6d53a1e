//! The command line: global options and one subcommand per operation.

use clap::{Args, Parser, Subcommand};
use pgflow_runtime::admin::Cursor;
use pgflow_runtime::client::RunStatus;
use uuid::Uuid;

use crate::filters::{InputEq, When};

/// Operate pgflow: install it, inspect queues, workers and runs, control runs and rollouts.
#[derive(Debug, Parser)]
#[command(name = "pgflow", version, about, propagate_version = true)]
pub(crate) struct Cli {
    /// The database, as a PostgreSQL URL (`postgres://user:password@host:5432/db`).
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    pub(crate) database_url: Option<String>,

    /// Print JSON instead of tables (every command; errors still go to stderr).
    #[arg(long, global = true)]
    pub(crate) json: bool,

    /// The operation.
    #[command(subcommand)]
    pub(crate) command: Command,
}

/// One operation.
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Install or upgrade PGMQ (when missing) and pgflow in the database.
    Install,
    /// Print the pgflow install script (PGMQ excluded) for your own migration tool.
    Sql,
    /// Queues (depth, oldest message, live workers), uncovered routes, coverage gaps and fenced functions.
    Status,
    /// List runs, newest first, filtered by flow or alias, status, start time and input.
    Runs(RunsArgs),
    /// One run: its DAG, steps, tasks, attempts, errors and outputs.
    Run {
        /// The run id.
        id: Uuid,
    },
    /// Cancel one run by id, or every started run matching filters.
    Cancel(CancelArgs),
    /// Retry a failed or cancelled run in place (completed tasks keep their outputs).
    Retry {
        /// The run id.
        id: Uuid,
    },
    /// Start a new run from a step of an earlier run, copying the outputs of the steps before it.
    Replay {
        /// The run to replay.
        id: Uuid,
        /// The step to run again (with every step downstream of it).
        #[arg(long = "from", value_name = "STEP")]
        from_step: String,
    },
    /// List aliases with their current and previous versions and whether each is retirable.
    Aliases,
    /// Point an alias at a compiled version (a rollout, or a rollback to the previous version).
    Activate {
        /// The alias producers start.
        alias: String,
        /// The concrete flow slug of the version.
        #[arg(value_name = "VERSION")]
        flow_slug: String,
    },
    /// Disable a worker function: its workers claim nothing and stop at their next heartbeat.
    Fence {
        /// The worker function (deployment unit) name.
        function: String,
        /// Why, recorded with the fence (the first reason is kept until it is lifted).
        #[arg(long)]
        reason: String,
    },
    /// Lift the fence of a worker function.
    Unfence {
        /// The worker function name.
        function: String,
    },
    /// Whether a version can be removed from the workers of each of its queues.
    Retirable {
        /// The concrete flow slug of the version.
        #[arg(value_name = "VERSION")]
        flow_slug: String,
        /// Only this queue (default: every queue the version uses).
        #[arg(long)]
        queue: Option<String>,
    },
    /// Delete finished runs (and their tasks and messages) older than a period, in bounded batches.
    Prune(PruneArgs),
    /// Serve the web dashboard (runs, a run's DAG, queues, workers) until interrupted.
    Dashboard(DashboardArgs),
    /// List schedules (cron, next and last fire, paused), or pause or resume one.
    Schedules {
        /// What to do (default: list).
        #[command(subcommand)]
        action: Option<ScheduleAction>,
    },
}

/// `dashboard`.
#[derive(Debug, Args)]
pub(crate) struct DashboardArgs {
    /// The address to listen on (keep it on localhost, or behind your own proxy and authentication).
    #[arg(long, default_value = "127.0.0.1:8080", value_name = "ADDR:PORT")]
    pub(crate) listen: std::net::SocketAddr,
    /// The environment variable holding the token that enables write actions (cancel, retry, replay,
    /// schedule pause and resume); without it the dashboard is read-only.
    #[arg(long, value_name = "VAR")]
    pub(crate) write_token_env: Option<String>,
    /// Never read or show run inputs and outputs.
    #[arg(long)]
    pub(crate) hide_payloads: bool,
}

/// `schedules pause|resume NAME`.
#[derive(Debug, Subcommand)]
pub(crate) enum ScheduleAction {
    /// List every schedule (the default).
    List,
    /// Stop firing a schedule until it is resumed.
    Pause {
        /// The schedule name.
        name: String,
    },
    /// Fire a paused schedule again (fires missed while paused are not caught up).
    Resume {
        /// The schedule name.
        name: String,
    },
}

/// A run status, for `runs --status`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub(crate) enum StatusArg {
    /// Running.
    Started,
    /// Every step finished.
    Completed,
    /// A step failed the run.
    Failed,
    /// Cancelled.
    Cancelled,
}

impl From<StatusArg> for RunStatus {
    fn from(s: StatusArg) -> Self {
        match s {
            StatusArg::Started => RunStatus::Started,
            StatusArg::Completed => RunStatus::Completed,
            StatusArg::Failed => RunStatus::Failed,
            StatusArg::Cancelled => RunStatus::Cancelled,
        }
    }
}

/// `runs`: filters and paging.
#[derive(Debug, Args)]
pub(crate) struct RunsArgs {
    /// Runs of this flow slug or alias (an alias: its current and previous version).
    #[arg(long)]
    pub(crate) flow: Option<String>,
    /// Runs in this status.
    #[arg(long, value_enum)]
    pub(crate) status: Option<StatusArg>,
    /// Runs started at or after this time: a duration ago (`2h`) or an RFC 3339 time.
    #[arg(long, value_name = "WHEN")]
    pub(crate) since: Option<When>,
    /// Runs started before this time: a duration ago (`2h`) or an RFC 3339 time.
    #[arg(long, value_name = "WHEN")]
    pub(crate) before: Option<When>,
    /// Runs whose input at a dotted path equals a JSON value (`tenant.id=42`).
    #[arg(long, value_name = "PATH=VALUE")]
    pub(crate) input_eq: Option<InputEq>,
    /// Runs per page (at most 500).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=500))]
    pub(crate) limit: u32,
    /// The page after this cursor (printed under a full page, and as `next` in `--json`).
    #[arg(long, value_name = "CURSOR")]
    pub(crate) after: Option<Cursor>,
}

/// `cancel`: one run, or started runs by filter.
#[derive(Debug, Args)]
pub(crate) struct CancelArgs {
    /// The run to cancel (leave out to cancel by filter).
    #[arg(conflicts_with_all = ["flow", "before", "input_eq", "all"])]
    pub(crate) id: Option<Uuid>,
    /// Cancel the started runs of this flow slug or alias.
    #[arg(long)]
    pub(crate) flow: Option<String>,
    /// Cancel runs started before this time: a duration ago (`2h`) or an RFC 3339 time.
    #[arg(long, value_name = "WHEN")]
    pub(crate) before: Option<When>,
    /// Cancel runs whose input at a dotted path equals a JSON value (`tenant.id=42`).
    #[arg(long, value_name = "PATH=VALUE")]
    pub(crate) input_eq: Option<InputEq>,
    /// Cancel every started run (required when no other filter narrows the set).
    #[arg(long)]
    pub(crate) all: bool,
    /// Recorded on each cancelled run.
    #[arg(long)]
    pub(crate) reason: Option<String>,
    /// Do not ask for confirmation before a bulk cancel.
    #[arg(long, short = 'y')]
    pub(crate) yes: bool,
}

/// `prune`.
#[derive(Debug, Args)]
pub(crate) struct PruneArgs {
    /// Delete runs that finished longer ago than this (`30d`, `12h`).
    #[arg(long, value_parser = humantime::parse_duration, value_name = "DURATION")]
    pub(crate) older_than: std::time::Duration,
    /// Runs deleted per transaction.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) batch: u32,
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_well_formed() {
        super::Cli::command().debug_assert();
    }
}
