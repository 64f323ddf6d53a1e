//! The connection, and database errors turned into messages that say what to do.

use anyhow::{anyhow, Context};
use pgflow_runtime::admin::{ActionKind, Admin, AdminError, NewAction};
use pgflow_runtime::client::ClientError;
use pgflow_sql::SqlState;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use uuid::Uuid;

/// Connects to `url` (from `--database-url` or `DATABASE_URL`) with a small pool.
pub(crate) async fn connect(url: Option<&str>) -> anyhow::Result<PgPool> {
    let url = url.ok_or_else(|| {
        anyhow!(
            "DATABASE_URL is not set: pass --database-url postgres://USER@HOST:5432/DB or export DATABASE_URL"
        )
    })?;
    let options: PgConnectOptions = url.parse().map_err(|e| {
        anyhow!("the database URL is not a valid PostgreSQL URL ({e}); write it as postgres://USER:PASSWORD@HOST:5432/DB")
    })?;
    let shown = format!(
        "{}@{}:{}/{}",
        options.get_username(),
        options.get_host(),
        options.get_port(),
        options.get_database().unwrap_or(options.get_username())
    );
    PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(std::time::Duration::from_secs(5))
        .connect_with(options)
        .await
        .with_context(|| {
            format!(
                "cannot connect to {shown}; check the URL, that the server runs and that it accepts this user"
            )
        })
}

/// What the command was doing, for messages about a specific run.
#[derive(Debug, Clone, Copy)]
pub(crate) enum About {
    /// Something not about one run.
    Nothing,
    /// Run `id`.
    Run(Uuid),
}

/// A database error as a message: the server's message, detail and hint, and for the SQL core's own
/// codes what to do with this command line.
pub(crate) fn explain(e: sqlx::Error, about: About) -> anyhow::Error {
    let Some(db) = e.as_database_error() else {
        return anyhow!("database error: {e}");
    };
    let code = db.code().map(|c| SqlState::from_code(&c));
    let pg = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>();
    let mut message = db.message().to_owned();
    if let Some(detail) = pg.and_then(|p| p.detail()) {
        message.push_str(&format!(" ({detail})"));
    }
    let run = match about {
        About::Run(id) => id.to_string(),
        About::Nothing => "ID".to_owned(),
    };
    let hint = match code {
        Some(SqlState::RunNotFound) => {
            return anyhow!(
                "run {run} does not exist (never started, or its history was pruned); list runs with `pgflow runs`"
            )
        }
        Some(SqlState::RunNotRetryable) if message.contains("still started") => Some(format!(
            "wait until it fails, or cancel it with `pgflow cancel {run}`, then retry it"
        )),
        Some(SqlState::RunNotRetryable) => Some(format!(
            "to run steps of a completed run again, replay it: `pgflow replay {run} --from STEP`"
        )),
        Some(SqlState::UnknownReplayStep) => Some(format!(
            "`pgflow run {run}` lists the run's steps; pass one of them to --from"
        )),
        Some(SqlState::ReplayNotPossible) => Some(format!(
            "replay from an earlier step: `pgflow run {run}` shows which steps completed"
        )),
        Some(SqlState::FlowVersionGone) => Some(
            "the version was retired and its queues dropped; start a new run of the current version".to_owned(),
        ),
        // An undefined schema, table or function of pgflow or PGMQ: not installed, or an older install.
        Some(SqlState::Other(ref c))
            if matches!(c.as_str(), "3F000" | "42P01" | "42883")
                && (message.contains("pgflow") || message.contains("pgmq")) =>
        {
            Some(
                "pgflow is not installed in this database, or is older than this command: run `pgflow install`"
                    .to_owned(),
            )
        }
        Some(SqlState::Other(ref c)) if c == "42501" => Some(
            "this role lacks a right: connect as the owner of the pgflow schema, or grant the role what \
             pgflow-sql/OPERATIONS.md lists"
                .to_owned(),
        ),
        _ => pg.and_then(|p| p.hint()).map(str::to_owned),
    };
    match hint {
        Some(hint) => anyhow!("{message}; {hint}"),
        None => anyhow!("{message}"),
    }
}

/// A read-layer error as a message (see [`explain`]).
pub(crate) fn explain_admin(e: AdminError, about: About) -> anyhow::Error {
    match e {
        AdminError::Database(e) => explain(e, about),
        other => anyhow!("{other}"),
    }
}

/// A client error as a message (see [`explain`]).
pub(crate) fn explain_client(e: ClientError, about: About) -> anyhow::Error {
    match e {
        ClientError::Database(e) => explain(e, about),
        other => anyhow!(other),
    }
}

/// Records an action taken from this command line in the operator record (`pgflow.operator_actions`, with
/// source `cli` and the database role as the actor), as the dashboard records its own. The action itself
/// already happened (or was refused): a role without insert on that table gets a warning, not an error.
pub(crate) async fn record(pool: &PgPool, action: NewAction) {
    let admin = Admin::new(pool.clone());
    if let Err(e) = admin.record_action(&action).await {
        eprintln!(
            "pgflow: warning: the action was not recorded in pgflow.operator_actions ({e}); grant this role \
             insert on that table to keep a record of operator actions"
        );
    }
}

/// The actor of recorded actions: the database role this command line connected as.
pub(crate) async fn actor(pool: &PgPool) -> String {
    sqlx::query_scalar("select session_user::text")
        .fetch_one(pool)
        .await
        .unwrap_or_else(|_| "unknown".to_owned())
}

/// An action on run `id` to record, from the command line.
pub(crate) async fn run_action(pool: &PgPool, kind: ActionKind, id: Uuid) -> NewAction {
    NewAction::on_run(actor(pool).await, "cli", kind, id)
}
