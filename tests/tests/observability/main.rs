//! Observability of workers and clients against real PostgreSQL and real PGMQ: metrics scraped from a real
//! Prometheus exporter, and OpenTelemetry traces collected by the SDK's in-memory exporter.
//!
//! Both install process-wide state (the metrics recorder, the tracer provider) once; every assertion names
//! its own flow slug or run, so the tests hold when a runner shares one process between them.

mod metrics;
mod otel;

use std::time::Duration;

use pgflow_runtime::worker::{WorkerBuilder, WorkerHandle};
use tokio_util::sync::CancellationToken;

pub(crate) use pgflow_tests::LIMIT;

/// A worker with fast settings.
pub(crate) async fn spawn<K>(builder: WorkerBuilder<K>) -> WorkerHandle {
    builder
        .poll_interval(Duration::from_millis(10))
        .max_poll_wait(Duration::from_millis(50))
        .heartbeat_interval(Duration::from_millis(100))
        .shutdown_grace(Duration::from_secs(5))
        .cancel_grace(Duration::from_millis(500))
        .build()
        .expect("valid config")
        .spawn(CancellationToken::new())
        .await
        .expect("worker starts")
}

/// Stops a worker (bounded).
pub(crate) async fn stop(worker: WorkerHandle) {
    tokio::time::timeout(LIMIT, worker.stop())
        .await
        .expect("worker stops in time")
        .expect("worker result");
}

mod failures;
