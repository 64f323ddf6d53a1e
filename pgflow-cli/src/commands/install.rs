//! `install`: PGMQ when missing, then every pgflow migration the database lacks.

use anyhow::Context;
use serde_json::json;
use sqlx::PgPool;

use crate::output::{self, Out};

/// Installs or upgrades, with a spinner naming each stage.
pub(crate) async fn install(pool: &PgPool, out: Out) -> anyhow::Result<()> {
    let spinner = output::spinner(out, "checking PGMQ");
    let pgmq = pgflow_sql::ensure_pgmq(pool).await.context(
        "installing PGMQ (pgflow's queues); the database user needs the right to create schemas",
    )?;
    spinner.set_message("reading the applied migrations");
    let applied_before = {
        let mut conn = pool.acquire().await.context("taking a connection")?;
        pgflow_sql::applied_versions(&mut conn).await?
    };
    let pending: Vec<String> = pgflow_sql::MIGRATIONS
        .iter()
        .filter(|m| !applied_before.iter().any(|v| v == m.version))
        .map(|m| m.file_name())
        .collect();
    spinner.set_message(match pending.len() {
        0 => "checking the installed schema".to_owned(),
        n => format!("applying {n} migration(s): {}", pending.join(", ")),
    });
    let report = pgflow_sql::install(pool).await;
    spinner.finish_and_clear();
    let report = report?;
    let pgmq = match pgmq {
        pgflow_sql::PgmqStatus::AlreadyPresent => "already present",
        pgflow_sql::PgmqStatus::CreatedExtension => "created the extension",
        pgflow_sql::PgmqStatus::InstalledEmbeddedSql => "installed from embedded SQL",
        _ => "present",
    };
    if out.json {
        return out.json(&json!({
            "pgmq": pgmq,
            "applied": report.applied,
            "latest": pgflow_sql::latest_version(),
        }));
    }
    output::line(&format!("PGMQ: {pgmq}"))?;
    if report.applied.is_empty() {
        output::line(&format!(
            "pgflow: already at {} (nothing to apply)",
            pgflow_sql::latest_version()
        ))
    } else {
        output::line(&format!(
            "pgflow: applied {} (now at {})",
            report.applied.join(", "),
            pgflow_sql::latest_version()
        ))
    }
}
