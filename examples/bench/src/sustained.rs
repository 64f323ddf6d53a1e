//! The sustained-load scenario: does history stay bounded, and the drain rate steady, when a worker runs at
//! full load for minutes with retention at a short window?
//!
//! One pgflow-rs worker (its own maintenance and retention, as in production, with `retention` set to a few
//! seconds) drains the diamond flow while the harness keeps a backlog of started runs topped up, so the
//! worker is never idle. Every `sample` the harness counts the rows of every pgflow table and of the flow's
//! PGMQ queue and archive, and the runs finished since the last sample. History is bounded when the largest
//! count of the last third of the samples is at most 1.5 times the largest of the second third (the first
//! third is the climb to the steady state), and the rate does not decline when the last third's mean rate is
//! at least 0.9 of the second third's.

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::db::{BenchDb, BenchFlow};
use crate::{flows, BenchError, Row};

/// What the scenario runs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    /// How long the load lasts.
    pub(crate) duration: Duration,
    /// The worker's retention window.
    pub(crate) retention: Duration,
    /// The worker's `max_concurrent`.
    pub(crate) k: usize,
}

/// Started runs kept waiting for the worker: more than it finishes between two top-ups.
const BACKLOG_RUNS: i64 = 400;
/// How often the row counts are sampled.
const SAMPLE: Duration = Duration::from_secs(10);

/// The tables whose rows are counted (the flow's queue and archive are added by name).
const TABLES: &[&str] = &[
    "pgflow.runs",
    "pgflow.step_states",
    "pgflow.step_tasks",
    "pgflow.workers",
    "pgflow.run_watchers",
    "pgflow.queue_signals",
    "pgflow.events",
    "pgflow.run_retries",
    "pgflow.idempotency_keys",
];

/// One sample: seconds since the start, runs finished in the interval, and the row count of each table.
struct Sample {
    at: f64,
    finished_per_second: f64,
    rows: Vec<i64>,
}

/// Runs the scenario and returns its rows for the results table (the samples are printed as they come).
pub(crate) async fn run(db: &BenchDb, settings: Settings) -> Result<Vec<Row>, BenchError> {
    let flow = BenchFlow::Diamond;
    let slug = flow.slug();
    db.compile(slug, &flow.shape()).await?;
    let queue = slug.to_lowercase();
    let mut tables: Vec<String> = TABLES.iter().map(|t| (*t).to_owned()).collect();
    tables.push(format!("pgmq.q_{queue}"));
    tables.push(format!("pgmq.a_{queue}"));
    let count_sql = format!(
        "select array[{}]",
        tables
            .iter()
            .map(|t| format!("(select count(*) from {t})"))
            .collect::<Vec<_>>()
            .join(", ")
    );

    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect_with(db.options.clone())
        .await?;
    let stop = CancellationToken::new();
    let worker = pgflow_runtime::Worker::<flows::diamond::Diamond>::builder(pool.clone())
        .max_concurrent(settings.k)
        .retention(Some(settings.retention))
        .build()
        .map_err(|e| BenchError::Invalid(e.to_string()))?
        .spawn(stop.clone())
        .await
        .map_err(|e| BenchError::Invalid(format!("worker startup: {e}")))?;

    println!(
        "\n#### sustained load: diamond, K = {}, retention {} s, {} s\n",
        settings.k,
        settings.retention.as_secs(),
        settings.duration.as_secs()
    );
    println!("| s | runs finished/s | {} |", tables.join(" | "));
    println!("|---:|---:|{}", "---:|".repeat(tables.len()));

    let input = flow.input();
    let started = Instant::now();
    let (mut started_runs, mut finished_before) = (0_i64, 0_i64);
    let mut next_sample = SAMPLE;
    let mut samples = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    while started.elapsed() < settings.duration {
        tick.tick().await;
        let open = db.progress().await?.0;
        if open < BACKLOG_RUNS {
            let due = usize::try_from(BACKLOG_RUNS - open).unwrap_or(0);
            started_runs += db.start_runs(slug, &input, due).await?.len() as i64;
        }
        if started.elapsed() >= next_sample {
            let open = db.progress().await?.0;
            let finished = started_runs - open;
            let rows: Vec<i64> = sqlx::query_scalar(&count_sql).fetch_one(&db.pool).await?;
            let sample = Sample {
                at: started.elapsed().as_secs_f64(),
                finished_per_second: (finished - finished_before) as f64 / SAMPLE.as_secs_f64(),
                rows,
            };
            finished_before = finished;
            println!(
                "| {:.0} | {:.0} | {} |",
                sample.at,
                sample.finished_per_second,
                sample
                    .rows
                    .iter()
                    .map(i64::to_string)
                    .collect::<Vec<_>>()
                    .join(" | ")
            );
            samples.push(sample);
            next_sample += SAMPLE;
        }
    }
    stop.cancel();
    worker
        .join()
        .await
        .map_err(|e| BenchError::Invalid(format!("worker: {e}")))?;
    pool.close().await;
    verdict(&samples, &tables, settings)
}

/// The scenario's rows: the rate in the second and last thirds, and each table's largest count in them.
fn verdict(
    samples: &[Sample],
    tables: &[String],
    settings: Settings,
) -> Result<Vec<Row>, BenchError> {
    let third = samples.len() / 3;
    if third == 0 {
        return Err(BenchError::Invalid(format!(
            "sustained load: {} samples; run it for at least {} s",
            samples.len(),
            3 * SAMPLE.as_secs()
        )));
    }
    let (middle, last) = (
        &samples[third..2 * third],
        &samples[samples.len() - third..],
    );
    let mean = |s: &[Sample]| s.iter().map(|x| x.finished_per_second).sum::<f64>() / s.len() as f64;
    let (rate_middle, rate_last) = (mean(middle), mean(last));
    let mut rows = vec![Row {
        what: "sustained diamond load, runs finished/s (last ÷ middle third)".to_owned(),
        k: settings.k,
        value: rate_last / rate_middle,
        unit: "×",
        extra: format!(
            "{rate_middle:.0} then {rate_last:.0} runs/s; {} ({} s, retention {} s)",
            if rate_last >= 0.9 * rate_middle {
                "steady"
            } else {
                "DECLINING"
            },
            settings.duration.as_secs(),
            settings.retention.as_secs()
        ),
        wal: None,
    }];
    for (i, table) in tables.iter().enumerate() {
        let max = |s: &[Sample]| s.iter().map(|x| x.rows[i]).max().unwrap_or(0);
        let (max_middle, max_last) = (max(middle), max(last));
        let bounded = max_last as f64 <= 1.5 * max_middle.max(1) as f64;
        rows.push(Row {
            what: format!("sustained load, rows of {table} (largest in last ÷ middle third)"),
            k: settings.k,
            value: max_last as f64 / max_middle.max(1) as f64,
            unit: "×",
            extra: format!(
                "{max_middle} then {max_last}; {}",
                if bounded { "bounded" } else { "GROWING" }
            ),
            wal: None,
        });
    }
    Ok(rows)
}
