//! Observability: metrics through the [`metrics`] facade, queue depth from SQL, the failure channel, and
//! (feature `otel`) one OpenTelemetry trace per run. See `docs/observability.md` for every metric and label.
//!
//! Workers always record their metrics through the facade; without an installed recorder that costs a
//! no-op call per event. Install any exporter, or call `serve_prometheus` (feature `prometheus`).

use std::time::Duration;

use futures::Stream;
use serde::Deserialize;
use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

mod names;
pub(crate) mod worker;

#[cfg(feature = "otel")]
pub mod otel;

pub use names::*;

/// The channel on which the database announces every failure (see [`Failure`]).
pub const FAILURE_CHANNEL: &str = "pgflow_failures";

/// What failed: one task for good, or a whole run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    /// A task failed for good (its attempts are used up, or its failure was terminal).
    TaskFailed,
    /// A run failed.
    RunFailed,
}

/// One failure, announced once on [`FAILURE_CHANNEL`] when the transaction that failed it commits.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Failure {
    /// A task or a run.
    pub kind: FailureKind,
    /// The run.
    pub run_id: Uuid,
    /// The concrete flow slug.
    pub flow_slug: String,
    /// The failed step (for a run: the first step that failed; `None` when no step failed).
    pub step_slug: Option<String>,
    /// The task (task failures only).
    pub task_index: Option<i32>,
    /// The attempt that failed (task failures only).
    pub attempt: Option<i32>,
    /// The error message (at most 4000 characters).
    pub error: String,
}

/// Listens on [`FAILURE_CHANNEL`] and yields every failure committed from now on, each once.
///
/// The stream holds one connection of `pool` (a dedicated `LISTEN` connection) and reconnects after a
/// connection loss (failures committed while it was away are not replayed: the event log,
/// `pgflow.events`, keeps them). A payload that cannot be read is logged and skipped.
pub async fn failures(pool: &PgPool) -> Result<impl Stream<Item = Failure>, sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(FAILURE_CHANNEL).await?;
    Ok(futures::stream::unfold(
        listener,
        |mut listener| async move {
            loop {
                match listener.recv().await {
                    Ok(n) => match serde_json::from_str::<Failure>(n.payload()) {
                        Ok(f) => return Some((f, listener)),
                        Err(e) => tracing::warn!(error = %e, payload = n.payload(),
                        "cannot read a pgflow_failures notification; skipped"),
                    },
                    Err(e) => {
                        tracing::warn!(error = %e, "pgflow_failures listener lost its connection; reconnecting");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                }
            }
        },
    ))
}

/// One row of `pgflow.queue_stats()`.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct QueueStats {
    /// The PGMQ queue.
    pub queue_name: String,
    /// Messages in the queue (visible or not).
    pub depth: i64,
    /// Messages a worker could read now.
    pub visible: i64,
    /// Age in seconds of the oldest message; `None` when the queue is empty.
    pub oldest_age_seconds: Option<f64>,
}

/// Reads `pgflow.queue_stats()` (one call; one count per queue) and sets the gauges
/// [`QUEUE_DEPTH`], [`QUEUE_VISIBLE`] and [`QUEUE_OLDEST_AGE`] for each queue.
pub async fn record_queue_stats(pool: &PgPool) -> Result<Vec<QueueStats>, sqlx::Error> {
    let stats: Vec<QueueStats> = sqlx::query_as(
        "select queue_name, depth, visible, oldest_age_seconds from pgflow.queue_stats()",
    )
    .fetch_all(pool)
    .await?;
    for s in &stats {
        let queue = s.queue_name.clone();
        metrics::gauge!(QUEUE_DEPTH, "queue" => queue.clone()).set(s.depth as f64);
        metrics::gauge!(QUEUE_VISIBLE, "queue" => queue.clone()).set(s.visible as f64);
        metrics::gauge!(QUEUE_OLDEST_AGE, "queue" => queue)
            .set(s.oldest_age_seconds.unwrap_or(0.0));
    }
    Ok(stats)
}

/// Calls [`record_queue_stats`] every `every` until `stop` fires (errors are logged and retried at the next
/// tick). Spawn it beside a worker or a metrics endpoint.
pub async fn poll_queue_stats(pool: PgPool, every: Duration, stop: CancellationToken) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {
                if let Err(e) = record_queue_stats(&pool).await {
                    tracing::warn!(error = %e, "cannot read pgflow.queue_stats()");
                }
            }
        }
    }
}

/// Installs the Prometheus exporter as the global metrics recorder and serves `GET /metrics` on `addr`
/// (any path answers with the same text). Call it once, inside a Tokio runtime.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// pgflow_runtime::observability::serve_prometheus(([0, 0, 0, 0], 9464).into())?;
/// # Ok(()) }
/// ```
#[cfg(feature = "prometheus")]
pub fn serve_prometheus(
    addr: std::net::SocketAddr,
) -> Result<(), metrics_exporter_prometheus::BuildError> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets(DEFAULT_BUCKETS)?
        .install()?;
    describe();
    Ok(())
}

/// Histogram buckets `serve_prometheus` uses (seconds, or tasks for batch sizes).
pub const DEFAULT_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 300.0,
];
