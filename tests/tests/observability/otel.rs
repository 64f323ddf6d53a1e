//! One trace per run: the trace context stored at start, one span per task attempt in it (on whichever
//! worker), retries linked to the attempt before, collected by the SDK's in-memory exporter.
//!
//! The two workers are two workers on separate connection pools in this process, not two OS processes: the
//! trace context travels only through the database (the run row and the claim), exactly as between
//! processes, and the in-memory exporter can only collect spans of its own process.

use std::collections::BTreeSet;
use std::sync::{LazyLock, OnceLock};
use std::time::Duration;

use opentelemetry::trace::{SpanId, TraceContextExt, TracerProvider as _};
use opentelemetry::Value as OtelValue;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use pgflow_runtime::observability::otel::{attempt_span_id, AttemptIds};
use pgflow_runtime::{flow, Client, StepContext, StepError, Worker};
use sqlx::postgres::PgPoolOptions;
use tracing::instrument::WithSubscriber;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use uuid::Uuid;

use crate::{spawn, stop, LIMIT};

/// Both map tasks wait here until the other one runs: with one task per worker at a time, they run on
/// different workers.
static BOTH_RUNNING: LazyLock<tokio::sync::Barrier> =
    LazyLock::new(|| tokio::sync::Barrier::new(2));

#[flow(slug = "tracedFlow", input = Vec<i64>, max_attempts = 3, base_delay = 0)]
mod traced {
    use super::*;

    #[step(map)]
    async fn pair(n: i64) -> Result<i64, StepError> {
        tokio::time::timeout(Duration::from_secs(20), BOTH_RUNNING.wait())
            .await
            .map_err(|_| StepError::msg("the other task never ran"))?;
        Ok(n)
    }

    /// Fails on its first attempt, asking for an immediate retry.
    #[step(depends_on = [pair])]
    async fn total(pair: Vec<i64>, ctx: &StepContext<Traced>) -> Result<i64, StepError> {
        if ctx.attempt() == 1 {
            return Err(StepError::msg("not yet").retry_after(Duration::ZERO));
        }
        Ok(pair.iter().sum())
    }
}

#[flow(slug = "callerFlow", input = i64)]
mod called {
    use super::*;

    #[step]
    async fn only(n: i64) -> Result<i64, StepError> {
        Ok(n)
    }
}

/// The in-memory exporter behind the global tracer provider, installed once per process.
fn provider() -> &'static (SdkTracerProvider, InMemorySpanExporter) {
    static P: OnceLock<(SdkTracerProvider, InMemorySpanExporter)> = OnceLock::new();
    P.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .with_id_generator(AttemptIds::default())
            .build();
        opentelemetry::global::set_tracer_provider(provider.clone());
        (provider, exporter)
    })
}

fn attr(span: &SpanData, key: &str) -> Option<OtelValue> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.clone())
}

/// The attempt spans of `run`, by (step, task index, attempt).
fn attempts(run: Uuid) -> Vec<SpanData> {
    let mut spans: Vec<SpanData> = provider()
        .1
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|s| {
            s.name == "pgflow.task" && attr(s, "pgflow.run_id") == Some(run.to_string().into())
        })
        .collect();
    spans.sort_by_key(|s| {
        (
            attr(s, "pgflow.step").map(|v| v.to_string()),
            attr(s, "pgflow.task_index").map(|v| v.to_string()),
            attr(s, "pgflow.attempt").map(|v| v.to_string()),
        )
    });
    spans
}

#[tokio::test]
async fn a_run_is_one_trace_across_two_workers_with_one_span_per_attempt_and_linked_retries() {
    provider();
    let db = pgflow_tests::test_db().await;
    let pool_a = db.pool().clone();
    let pool_b = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(db.options())
        .await
        .unwrap();
    let one_at_a_time = |b: pgflow_runtime::worker::WorkerBuilder<_>| {
        b.max_concurrent(1).batch_size(1).max_unrecorded(1)
    };
    let a = spawn(one_at_a_time(Worker::<traced::Traced>::builder(
        pool_a.clone(),
    )))
    .await;
    let b = spawn(one_at_a_time(Worker::<traced::Traced>::builder(
        pool_b.clone(),
    )))
    .await;
    let (a_id, b_id) = (a.id(), b.id());

    // No current span: the run gets a new root span `pgflow.run`.
    let run = Client::new(pool_a.clone())
        .start::<traced::Traced>(&vec![1, 2])
        .await
        .unwrap();
    assert_eq!(run.wait(LIMIT).await.unwrap().total, 3);
    stop(a).await;
    stop(b).await;

    let roots: Vec<SpanData> = provider()
        .1
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|s| s.name == "pgflow.run")
        .collect();
    let spans = attempts(run.run_id());
    // pair[0], pair[1], total attempt 1 and 2: one span each.
    assert_eq!(spans.len(), 4, "{spans:#?}");
    let trace_id = spans[0].span_context.trace_id();
    let root = roots
        .iter()
        .find(|r| r.span_context.trace_id() == trace_id)
        .expect("the run's root span");
    for s in &spans {
        assert_eq!(s.span_context.trace_id(), trace_id, "one trace per run");
        assert_eq!(
            s.parent_span_id,
            root.span_context.span_id(),
            "children of the run's context"
        );
        assert_eq!(attr(s, "pgflow.flow"), Some("tracedFlow".into()));
    }
    let workers: BTreeSet<String> = spans
        .iter()
        .filter(|s| attr(s, "pgflow.step") == Some("pair".into()))
        .map(|s| attr(s, "pgflow.worker_id").unwrap().to_string())
        .collect();
    assert_eq!(
        workers,
        BTreeSet::from([a_id.to_string(), b_id.to_string()]),
        "tasks ran on both workers"
    );

    // The retry links to the attempt before it.
    let (first, second) = (&spans[2], &spans[3]);
    assert_eq!(attr(first, "pgflow.attempt"), Some(OtelValue::I64(1)));
    assert_eq!(attr(second, "pgflow.attempt"), Some(OtelValue::I64(2)));
    assert!(first.links.is_empty());
    let linked: Vec<SpanId> = second
        .links
        .iter()
        .map(|l| l.span_context.span_id())
        .collect();
    assert_eq!(linked, [first.span_context.span_id()]);
    assert_eq!(
        first.span_context.span_id(),
        attempt_span_id(run.run_id(), "total", 0, 1)
    );
}

#[tokio::test]
async fn a_run_started_inside_a_traced_span_continues_the_callers_trace() {
    let (provider, _) = provider();
    let db = pgflow_tests::test_db().await;
    let pool = db.pool().clone();
    let worker = spawn(Worker::<called::Called>::builder(pool.clone())).await;
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("caller")));
    let client = Client::new(pool.clone());
    let (run, caller) = async {
        let span = tracing::info_span!("caller");
        let caller = span.context().span().span_context().clone();
        let run = client
            .start::<called::Called>(&5)
            .instrument(span)
            .await
            .unwrap();
        (run, caller)
    }
    .with_subscriber(subscriber)
    .await;
    assert!(caller.is_valid());
    assert_eq!(run.wait(LIMIT).await.unwrap().only, 5);
    stop(worker).await;
    let spans = attempts(run.run_id());
    assert_eq!(spans.len(), 1, "{spans:#?}");
    assert_eq!(spans[0].span_context.trace_id(), caller.trace_id());
    assert_eq!(spans[0].parent_span_id, caller.span_id());
    assert_eq!(
        attr(&spans[0], "pgflow.task_index"),
        Some(OtelValue::I64(0))
    );
}
