//! Flow-control and schedule scenarios (`--only control`), short by default; the figures go in
//! BENCHMARKS.md.
//!
//! - tenant B's wait (queued → started, p50 and p99) while tenant A has a backlog of `--control-backlog`
//!   tasks (10,000 for the figure; 2000 by default), under a per-key limit of 4, one worker of 16
//!   handlers;
//! - schedule fire lateness (the run's start after its fire time, p50 and p99) of an every-second schedule
//!   fired by one worker for `--control-seconds` seconds.

use std::time::Duration;

use chrono::{DateTime, Utc};
use pgflow_runtime::schedules::Schedule;
use pgflow_runtime::{flow_control, Worker};
use tokio_util::sync::CancellationToken;

use crate::db::BenchDb;
use crate::flows::tenant::Tenant;
use crate::BenchError;

/// One measured figure: what, value, unit, detail.
pub(crate) struct Figure {
    pub(crate) what: String,
    pub(crate) value: f64,
    pub(crate) unit: &'static str,
    pub(crate) extra: String,
}

/// The `p` quantile (0..=1) of sorted values; NaN for none.
pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn invalid(e: impl std::fmt::Display) -> BenchError {
    BenchError::Invalid(e.to_string())
}

/// Runs both scenarios.
pub(crate) async fn run(
    db: &BenchDb,
    backlog: usize,
    seconds: u64,
) -> Result<Vec<Figure>, BenchError> {
    let pool = &db.pool;
    let stop = CancellationToken::new();
    let worker = Worker::<Tenant>::builder(pool.clone())
        .max_concurrent(16)
        .schedule(Schedule::for_flow::<Tenant>(
            "bench-every-second",
            "* * * * * *",
            &crate::flows::TenantJob { tenant: "s".into() },
        ))
        .schedule_interval(Some(Duration::from_millis(100)))
        .build()
        .map_err(invalid)?
        .spawn(stop.clone())
        .await
        .map_err(invalid)?;
    // The schedule fires while the tenants drain (its runs are tenant "s", not counted there).
    flow_control::set_key_limit(pool, "benchTenant", "work", &["tenant"], 4).await?;

    let a: Vec<serde_json::Value> = (0..backlog)
        .map(|_| serde_json::json!({"tenant": "a"}))
        .collect();
    for chunk in a.chunks(200) {
        sqlx::query("select pgflow.start_flows('benchTenant', $1)")
            .bind(chunk)
            .execute(pool)
            .await?;
    }
    let b: Vec<serde_json::Value> = (0..20)
        .map(|_| serde_json::json!({"tenant": "b"}))
        .collect();
    sqlx::query("select pgflow.start_flows('benchTenant', $1)")
        .bind(&b)
        .execute(pool)
        .await?;

    let deadline = std::time::Instant::now() + Duration::from_secs(seconds.max(1) + 600);
    loop {
        let left: i64 = sqlx::query_scalar(
            "select count(*) from pgflow.runs where flow_slug = 'benchTenant' and status = 'started' \
             and input ->> 'tenant' in ('a', 'b')",
        )
        .fetch_one(pool)
        .await?;
        if left == 0 {
            break;
        }
        if std::time::Instant::now() > deadline {
            stop.cancel();
            return Err(invalid(format!("tenants: {left} runs did not complete")));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut waits: Vec<f64> = sqlx::query_scalar(
        "select extract(epoch from t.started_at - t.queued_at)::float8 * 1000 \
         from pgflow.step_tasks t join pgflow.runs r using (run_id) \
         where t.flow_slug = 'benchTenant' and r.input ->> 'tenant' = 'b'",
    )
    .fetch_all(pool)
    .await?;
    waits.sort_by(f64::total_cmp);

    // Let the schedule fire for the rest of `seconds`, then read its lateness.
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let fires: Vec<(DateTime<Utc>, DateTime<Utc>)> = sqlx::query_as(
        "select f.fire_at, r.started_at from pgflow.schedule_fires f join pgflow.runs r using (run_id) \
         where f.schedule_name = 'bench-every-second'",
    )
    .fetch_all(pool)
    .await?;
    stop.cancel();
    worker.join().await.map_err(invalid)?;
    let mut late: Vec<f64> = fires
        .iter()
        .map(|(at, started)| (*started - *at).num_microseconds().unwrap_or(0) as f64 / 1000.0)
        .collect();
    late.sort_by(f64::total_cmp);
    flow_control::clear_key_limit(pool, "benchTenant", "work").await?;

    Ok(vec![
        Figure {
            what: format!(
                "tenant B's wait behind a {backlog}-task backlog of tenant A (key limit 4)"
            ),
            value: percentile(&waits, 0.99),
            unit: "ms p99",
            extra: format!(
                "p50 {:.0} ms over {} tasks of B",
                percentile(&waits, 0.5),
                waits.len()
            ),
        },
        Figure {
            what: "schedule fire lateness, every-second schedule, one worker (tick 100 ms)"
                .to_owned(),
            value: percentile(&late, 0.99),
            unit: "ms p99",
            extra: format!(
                "p50 {:.0} ms over {} fires",
                percentile(&late, 0.5),
                late.len()
            ),
        },
    ])
}
