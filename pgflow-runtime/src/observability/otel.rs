//! One OpenTelemetry trace per run (feature `otel`).
//!
//! [`Client`](crate::Client) takes the W3C trace context of the caller's current `tracing` span (through
//! `tracing-opentelemetry`) when it starts a run, or starts a new root span `pgflow.run` when there is none,
//! and stores it with the run. Every task attempt, on whichever worker, is a span `pgflow.task` in that
//! trace, a child of the run's context, carrying `pgflow.flow`, `pgflow.step`, `pgflow.task_index`,
//! `pgflow.attempt` and `pgflow.worker_id`. The spans are built with the global tracer provider (name
//! `pgflow`); the handler's own `tracing` spans nest under the attempt through `tracing-opentelemetry`.
//!
//! Retry links: attempt *n* > 1 links to attempt *n − 1* when the provider generates ids with [`AttemptIds`]
//! (`SdkTracerProvider::builder().with_id_generator(AttemptIds::default())`). It gives attempt spans an id
//! derived from (run, step, task index, attempt), so a retry on another worker knows its predecessor's id
//! without asking the database; every other id is random. With another generator the retry has no link
//! (its `pgflow.attempt` attribute still says which attempt it is).

use std::cell::Cell;

use opentelemetry::trace::{
    Span, SpanContext, SpanId, SpanKind, TraceContextExt, TraceFlags, TraceId, TraceState, Tracer,
};
use opentelemetry::{global, Context, KeyValue};
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator};
use serde_json::Value;
use sha2::{Digest, Sha256};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use uuid::Uuid;

use crate::worker::claim::Claimed;

/// The instrumentation scope of pgflow's spans.
pub const TRACER_NAME: &str = "pgflow";

/// The trace context to store with a run started now: the current `tracing` span's OpenTelemetry context
/// when it has a valid one, otherwise a new root span `pgflow.run` (ended at once) for `flow_slug`. Returns
/// the JSON object the database stores (`{"traceparent": ..., "tracestate": ...}`); `None` when no tracer
/// provider is installed (the run then has no trace context).
pub fn start_context(flow_slug: &str) -> Option<Value> {
    let current = OpenTelemetrySpanExt::context(&tracing::Span::current());
    let sc = current.span().span_context().clone();
    let sc = if sc.is_valid() {
        sc
    } else {
        let tracer = global::tracer(TRACER_NAME);
        let mut span = tracer
            .span_builder("pgflow.run")
            .with_kind(SpanKind::Producer)
            .with_attributes([KeyValue::new("pgflow.flow", flow_slug.to_owned())])
            .start_with_context(&tracer, &Context::new());
        let sc = span.span_context().clone();
        span.end();
        sc
    };
    sc.is_valid().then(|| to_json(&sc))
}

/// The text the client binds for the setting `pgflow.trace_context` (empty: none).
pub(crate) fn start_setting(flow_slug: &str) -> String {
    start_context(flow_slug).map_or_else(String::new, |v| v.to_string())
}

/// `{"traceparent", "tracestate"}` of a span context.
pub fn to_json(sc: &SpanContext) -> Value {
    let traceparent = format!(
        "00-{}-{}-{:02x}",
        sc.trace_id(),
        sc.span_id(),
        sc.trace_flags().to_u8()
    );
    let state = sc.trace_state().header();
    if state.is_empty() {
        serde_json::json!({ "traceparent": traceparent })
    } else {
        serde_json::json!({ "traceparent": traceparent, "tracestate": state })
    }
}

/// The span context a stored trace context names; `None` when it is not a valid W3C traceparent.
pub fn from_json(v: &Value) -> Option<SpanContext> {
    let tp = v.get("traceparent")?.as_str()?;
    let mut parts = tp.split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if version != "00" || parts.next().is_some() {
        return None;
    }
    let trace_id = TraceId::from_hex(trace).ok()?;
    let span_id = SpanId::from_hex(span).ok()?;
    let flags = u8::from_str_radix(flags, 16).ok()?;
    let state = v
        .get("tracestate")
        .and_then(Value::as_str)
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();
    let sc = SpanContext::new(trace_id, span_id, TraceFlags::new(flags), true, state);
    sc.is_valid().then_some(sc)
}

/// The span id of attempt `attempt` of a task: the same on every worker.
pub fn attempt_span_id(run_id: Uuid, step_slug: &str, task_index: i32, attempt: i32) -> SpanId {
    let mut h = Sha256::new();
    h.update(run_id.as_bytes());
    h.update(step_slug.as_bytes());
    h.update(task_index.to_be_bytes());
    h.update(attempt.to_be_bytes());
    let d = h.finalize();
    let mut id = [0u8; 8];
    id.copy_from_slice(&d[..8]);
    if id == [0; 8] {
        id[7] = 1;
    }
    SpanId::from_bytes(id)
}

thread_local! {
    /// The id [`AttemptIds`] gives the next span started on this thread (set just before an attempt span).
    static NEXT_SPAN_ID: Cell<Option<SpanId>> = const { Cell::new(None) };
}

/// An [`IdGenerator`] that gives task attempt spans their derived id ([`attempt_span_id`]) and everything else
/// random ids, so that retries can link to the attempt before them.
#[derive(Debug, Default, Clone)]
pub struct AttemptIds(RandomIdGenerator);

impl IdGenerator for AttemptIds {
    fn new_trace_id(&self) -> TraceId {
        self.0.new_trace_id()
    }

    fn new_span_id(&self) -> SpanId {
        NEXT_SPAN_ID
            .with(Cell::take)
            .unwrap_or_else(|| self.0.new_span_id())
    }
}

/// Starts the attempt span of a claimed task (a child of its run's context) and returns a context that
/// holds it; `None` when the run has no trace context. The span ends when the context is dropped.
pub(crate) fn attempt_context(task: &Claimed, worker_id: Uuid) -> Option<Context> {
    let parent = from_json(task.trace_context.as_ref()?)?;
    let tracer = global::tracer(TRACER_NAME);
    let id = attempt_span_id(task.run_id, &task.step_slug, task.task_index, task.attempt);
    let builder = tracer
        .span_builder("pgflow.task")
        .with_kind(SpanKind::Consumer)
        .with_attributes([
            KeyValue::new("pgflow.flow", task.flow_slug.clone()),
            KeyValue::new("pgflow.step", task.step_slug.clone()),
            KeyValue::new("pgflow.run_id", task.run_id.to_string()),
            KeyValue::new("pgflow.task_index", i64::from(task.task_index)),
            KeyValue::new("pgflow.attempt", i64::from(task.attempt)),
            KeyValue::new("pgflow.worker_id", worker_id.to_string()),
        ]);
    let parent_cx = Context::new().with_remote_span_context(parent.clone());
    NEXT_SPAN_ID.with(|next| next.set(Some(id)));
    let mut span = builder.start_with_context(&tracer, &parent_cx);
    NEXT_SPAN_ID.with(|next| next.set(None));
    // The derived id took: AttemptIds is installed, so the attempt before has its derived id too.
    if task.attempt > 1 && span.span_context().span_id() == id {
        let previous = SpanContext::new(
            parent.trace_id(),
            attempt_span_id(
                task.run_id,
                &task.step_slug,
                task.task_index,
                task.attempt - 1,
            ),
            parent.trace_flags(),
            true,
            TraceState::default(),
        );
        span.add_link(previous, Vec::new());
    }
    Some(parent_cx.with_span(span))
}
