//! `schedules`: the schedules as the runtime's read layer reports them (`Admin::schedules`), and pause /
//! resume through `pgflow_runtime::schedules` (`pgflow.pause_schedule` / `resume_schedule`), each written to
//! the operator record.

use pgflow_runtime::admin::{ActionKind, Admin, NewAction};
use serde_json::json;
use sqlx::PgPool;

use crate::cli::ScheduleAction;
use crate::db::{self, explain, explain_admin, About};
use crate::output::{self, Out};

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
    let schedules = Admin::new(pool.clone())
        .schedules()
        .await
        .map_err(|e| explain_admin(e, About::Nothing))?;
    if out.json {
        return out.json(
            &schedules
                .iter()
                .map(|s| {
                    json!({
                        "schedule_name": s.schedule_name,
                        "flow_slug": s.flow_slug,
                        "cron": s.cron,
                        "time_zone": s.time_zone,
                        "missed": s.missed.as_str(),
                        "catch_up_max": s.missed.catch_up_max(),
                        "overlap": s.overlap,
                        "paused": s.paused,
                        "next_fire_at": s.next_fire_at,
                        "last_fire_at": s.last_fire_at,
                        "last_run_id": s.last_run_id,
                        "last_run_status": s.last_run_status.map(|r| r.as_str()),
                        "last_error": s.last_error,
                    })
                })
                .collect::<Vec<_>>(),
        );
    }
    let mut table = output::table([
        "NAME", "FLOW", "CRON", "ZONE", "STATE", "NEXT", "LAST", "LAST RUN",
    ]);
    for s in &schedules {
        let state = match (&s.last_error, s.paused) {
            (Some(error), true) => format!("paused: {error}"),
            (None, true) => "paused".to_owned(),
            _ => "active".to_owned(),
        };
        let last_run = match (s.last_run_id, s.last_run_status) {
            (Some(id), Some(status)) => format!("{id} ({})", status.as_str()),
            (Some(id), None) => id.to_string(),
            _ => "-".to_owned(),
        };
        table.add_row([
            s.schedule_name.clone(),
            s.flow_slug.clone(),
            s.cron.clone(),
            s.time_zone.clone(),
            state,
            output::time(s.next_fire_at),
            output::time(s.last_fire_at),
            last_run,
        ]);
    }
    output::print_table(&table, "no schedules")
}
