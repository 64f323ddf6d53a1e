//! `schedules`: the schedules table as it stands, and pause / resume through the runtime's
//! `pgflow_runtime::schedules` (`pgflow.pause_schedule` / `resume_schedule`), each written to the operator
//! record.

use chrono::{DateTime, Utc};
use serde_json::{json, Value};
use sqlx::PgPool;
use uuid::Uuid;

use crate::cli::ScheduleAction;
use pgflow_runtime::admin::{ActionKind, NewAction};

use crate::db::{self, explain, About};
use crate::output::{self, Out};

/// One row of `pgflow.schedules`.
type Row = (
    String,
    String,
    String,
    String,
    Value,
    String,
    String,
    bool,
    Option<DateTime<Utc>>,
    Option<DateTime<Utc>>,
    Option<Uuid>,
    Option<String>,
);

const LIST: &str = "select schedule_name, flow_slug, cron, time_zone, input, missed, overlap, paused, \
     next_fire_at, last_fire_at, last_run_id, last_error from pgflow.schedules order by schedule_name";

/// `schedules [list | pause NAME | resume NAME]`.
pub(crate) async fn schedules(
    pool: &PgPool,
    out: Out,
    action: Option<ScheduleAction>,
) -> anyhow::Result<()> {
    match action.unwrap_or(ScheduleAction::List) {
        ScheduleAction::List => list(pool, out).await,
        ScheduleAction::Pause { name } => {
            let result = pgflow_runtime::schedules::pause(pool, &name).await;
            recorded(pool, ActionKind::PauseSchedule, &name, result).await?;
            done(out, &name, true)
        }
        ScheduleAction::Resume { name } => {
            let result = pgflow_runtime::schedules::resume(pool, &name).await;
            recorded(pool, ActionKind::ResumeSchedule, &name, result).await?;
            done(out, &name, false)
        }
    }
}

/// Writes a pause or resume to the operator record, and turns its error into a message.
async fn recorded(
    pool: &PgPool,
    kind: ActionKind,
    name: &str,
    result: Result<(), sqlx::Error>,
) -> anyhow::Result<()> {
    let action = NewAction::on_schedule(db::actor(pool).await, "cli", kind, name);
    match result {
        Ok(()) => {
            db::record(pool, action).await;
            Ok(())
        }
        Err(e) => {
            let e = unknown(e, name);
            db::record(pool, action.outcome(Err(format!("{e:#}")))).await;
            Err(e)
        }
    }
}

/// An error of pause / resume; an unknown schedule says how to list them.
fn unknown(e: sqlx::Error, name: &str) -> anyhow::Error {
    let undefined = e
        .as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == "42704");
    if undefined {
        anyhow::anyhow!("no schedule is named `{name}`: list them with `pgflow schedules`")
    } else {
        explain(e, About::Nothing)
    }
}

fn done(out: Out, name: &str, paused: bool) -> anyhow::Result<()> {
    if out.json {
        return out.json(&json!({ "schedule_name": name, "paused": paused }));
    }
    output::line(&if paused {
        format!("schedule `{name}` is paused; resume it with `pgflow schedules resume {name}`")
    } else {
        format!("schedule `{name}` is resumed; its next fire is computed by the next worker tick")
    })
}

async fn list(pool: &PgPool, out: Out) -> anyhow::Result<()> {
    let rows: Vec<Row> = sqlx::query_as(LIST)
        .fetch_all(pool)
        .await
        .map_err(|e| explain(e, About::Nothing))?;
    if out.json {
        return out.json(
            &rows
                .iter()
                .map(|r| {
                    json!({
                        "schedule_name": r.0,
                        "flow_slug": r.1,
                        "cron": r.2,
                        "time_zone": r.3,
                        "input": r.4,
                        "missed": r.5,
                        "overlap": r.6,
                        "paused": r.7,
                        "next_fire_at": r.8,
                        "last_fire_at": r.9,
                        "last_run_id": r.10,
                        "last_error": r.11,
                    })
                })
                .collect::<Vec<_>>(),
        );
    }
    let mut table = output::table([
        "NAME", "FLOW", "CRON", "ZONE", "STATE", "NEXT", "LAST", "LAST RUN",
    ]);
    for r in &rows {
        let state = match (&r.11, r.7) {
            (Some(error), true) => format!("paused: {error}"),
            (None, true) => "paused".to_owned(),
            _ => "active".to_owned(),
        };
        table.add_row([
            r.0.clone(),
            r.1.clone(),
            r.2.clone(),
            r.3.clone(),
            state,
            output::time(r.8),
            output::time(r.9),
            r.10.map_or_else(|| "-".to_owned(), |id| id.to_string()),
        ]);
    }
    output::print_table(&table, "no schedules")
}
