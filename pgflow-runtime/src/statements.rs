//! Every SQL statement the runtime sends, in one place; `pgflow.*` functions are called with named arguments.
//!
//! The runtime touches no table directly except those a worker or client role is granted read access to
//! (`pgflow.runs`, `pgflow.step_states`, `pgflow.queue_coverage`, `pgflow.schema_migrations`); everything
//! else goes through the SQL core's functions.

/// `ensure_flow_compiled` → `{status, differences}`, plus `alias: {.., activated}` when an alias is given.
pub(crate) const ENSURE_FLOW_COMPILED: &str = "select pgflow.ensure_flow_compiled(\
     flow_slug => $1, shape => $2, allow_data_loss => $3, queue_mode => $4, routes => $5, alias => $6)";

/// Points an alias at a compiled version → `{alias, flow_slug, previous_flow_slug, activated_at, activated}`.
/// The event log names the cause `worker_startup` (the transaction-local setting `pgflow.cause`, set before
/// the call: `left(.., 0)` adds nothing to the alias).
pub(crate) const ACTIVATE_ALIAS: &str = "select pgflow.activate_alias(\
     alias => $1 || left(set_config('pgflow.cause', 'worker_startup', true), 0), flow_slug => $2)";

/// Tracks the worker function → `{enabled, disabled_reason, ...}`: the fence, checked before activation.
pub(crate) const TRACK_WORKER_FUNCTION: &str =
    "select pgflow.track_worker_function(function_name => $1)";

/// The persisted route map of a flow: `(step_slug, queue_name)` in step order.
pub(crate) const FLOW_ROUTES: &str =
    "select step_slug, queue_name from pgflow.flow_routes(flow_slug => $1) \
     order by step_index";

/// The (flow, step) pairs queue `$1` can carry that the given pairs lack, with reason, count, examples and
/// repair (`pgflow.queue_coverage_gaps`).
pub(crate) const QUEUE_COVERAGE_GAPS: &str = "select g.flow_slug, g.step_slug, g.reason, \
     g.count, g.examples, g.repair \
     from pgflow.queue_coverage_gaps(queue_name => $1, flow_slugs => $2, step_slugs => $3) g";

/// Registers this worker for its queue and the exact (flow, step) pairs it runs → `{enabled, ...}`.
pub(crate) const REGISTER_WORKER: &str = "select pgflow.register_worker(worker_id => $1, \
     function_name => $2, queue_name => $3, flow_slugs => $4, step_slugs => $5)";

/// Disables a worker function persistently, with the reason (until an operator enables it again).
/// The event log names the cause `worker` (see [`ACTIVATE_ALIAS`]).
pub(crate) const DISABLE_WORKER_FUNCTION: &str = "select pgflow.disable_worker_function(\
     function_name => $1 || left(set_config('pgflow.cause', 'worker', true), 0), reason => $2)";

/// Heartbeat → `{enabled, deprecated, revived, ...}`, or NULL for an unknown worker.
pub(crate) const HEARTBEAT: &str = "select pgflow.worker_heartbeat(worker_id => $1)";

/// Routes of a flow with queued work and no live worker (`pgflow.queue_coverage`).
pub(crate) const UNCOVERED_ROUTES: &str = "select step_slug, queue_name, queued_tasks \
     from pgflow.queue_coverage where flow_slug = $1 and uncovered order by step_index";

/// Records finished outputs and claims the next tasks in one transaction (see `pgflow.exchange`) → the
/// completions' rows (`applied` / `stale`, with `status`), then the claim's rows; each row also names the
/// backend, so the worker can tell its own queue signals from others'.
pub(crate) const EXCHANGE: &str = "select outcome, msg_id, flow_slug, run_id, step_slug, \
     task_index, input, flow_input, attempts_count, timeout, report, status, pg_backend_pid() as backend_pid \
     from pgflow.exchange(queue_name => $1, worker_id => $2, flow_slugs => $3, step_slugs => $4, \
     qty => $5, vt => $6, run_ids => $7, done_step_slugs => $8, task_indexes => $9, outputs => $10, \
     attempts => $11)";

/// Records a batch of outputs, fenced to each task's attempt and this worker → one outcome row per task.
pub(crate) const COMPLETE_TASKS: &str = "select run_id, step_slug, task_index, outcome, status, attempts_count \
     from pgflow.complete_tasks(run_ids => $1, step_slugs => $2, task_indexes => $3, outputs => $4, \
     attempts => $5, worker_id => $6)";

/// Records a failure, fenced → `(outcome, status, attempts_count)`; `status` is `queued` when it will be retried.
pub(crate) const FAIL_TASK: &str = "select outcome, status, attempts_count from pgflow.fail_task(\
     run_id => $1, step_slug => $2, task_index => $3, error_message => $4, attempt => $5, \
     worker_id => $6, retry_delay_seconds => $7, terminal => $8)";

/// The tasks in flight that are no longer current (their run cancelled or failed, or the task ended).
pub(crate) const CANCELLED_TASKS: &str = "select run_id, step_slug, task_index, attempt, run_status, reason \
     from pgflow.cancelled_tasks(run_ids => $1, step_slugs => $2, task_indexes => $3, attempts => $4)";

/// Hands back what a stopping worker could not finish.
pub(crate) const RELEASE_WORKER_TASKS: &str = "select pgflow.release_worker_tasks(worker_id => $1)";

/// Marks the worker stopped.
pub(crate) const MARK_WORKER_STOPPED: &str = "select pgflow.mark_worker_stopped(worker_id => $1)";

/// One maintenance sweep (stalled and dead-worker recovery, retention), one caller at a time.
pub(crate) const RUN_MAINTENANCE: &str = "select pgflow.run_maintenance(dead_after => $1, \
     retain_for => $2, prune_batch => $3)";

/// Starts a run of a concrete slug or an alias → its id and the concrete slug it resolved to.
#[cfg_attr(feature = "otel", allow(dead_code))]
pub(crate) const START_FLOW: &str =
    "select run_id, flow_slug from pgflow.start_flow(flow_slug => $1, input => $2, run_id => $3)";

/// As [`START_FLOW`], in trace context `$4` (feature `otel`): the transaction-local setting
/// `pgflow.trace_context`, which a trigger stores with the run. The lateral reference to the setting's value
/// makes the database set it before it starts the run (`left(.., 0)` adds nothing to the slug).
#[cfg(feature = "otel")]
pub(crate) const START_FLOW_TRACED: &str = "select s.run_id, s.flow_slug \
     from (select set_config('pgflow.trace_context', $4, true) as v) c \
     cross join lateral pgflow.start_flow(flow_slug => $1 || left(c.v, 0), input => $2, run_id => $3) s";

/// As [`START_FLOWS`], in trace context `$3` (see [`START_FLOW_TRACED`]).
#[cfg(feature = "otel")]
pub(crate) const START_FLOWS_TRACED: &str = "select s.run_id \
     from (select set_config('pgflow.trace_context', $3, true) as v) c \
     cross join lateral pgflow.start_flows(flow_slug => $1 || left(c.v, 0), inputs => $2) s";

/// Starts one run per input of a concrete slug or an alias, in one transaction → their ids in input order.
#[cfg_attr(feature = "otel", allow(dead_code))]
pub(crate) const START_FLOWS: &str =
    "select run_id from pgflow.start_flows(flow_slug => $1, inputs => $2)";

/// Starts runs with an idempotency key (NULL: none) and a priority per input, in input order.
#[cfg_attr(feature = "otel", allow(dead_code))]
pub(crate) const START_FLOWS_WITH_KEYS: &str = "select run_id from pgflow.start_flows_with_keys(\
     flow_slug => $1, inputs => $2, idempotency_keys => $3, run_ids => null, \
     key_ttl => case when $4::float8 is null then null else make_interval(secs => $4::float8) end, \
     priorities => $5)";

/// As [`START_FLOWS_WITH_KEYS`], in trace context `$6` (see [`START_FLOW_TRACED`]).
#[cfg(feature = "otel")]
pub(crate) const START_FLOWS_WITH_KEYS_TRACED: &str = "select s.run_id \
     from (select set_config('pgflow.trace_context', $6, true) as v) c \
     cross join lateral pgflow.start_flows_with_keys(\
     flow_slug => $1 || left(c.v, 0), inputs => $2, idempotency_keys => $3, run_ids => null, \
     key_ttl => case when $4::float8 is null then null else make_interval(secs => $4::float8) end, \
     priorities => $5) s";

/// Cancels a run.
pub(crate) const CANCEL_RUN: &str =
    "select status, changed, cancel_reason, cancelled_at from pgflow.cancel_run(run_id => $1, reason => $2)";

/// Cancels one batch of started runs by filter (`$7` false), or counts the runs it would cancel (`$7` true).
pub(crate) const CANCEL_RUNS: &str =
    "select pgflow.cancel_runs(flow_slug => $1, status => 'started', \
     started_before => $2, input_path => $3, input_value => $4, reason => $5, max_runs => $6, \
     dry_run => $7)";

/// Retries a failed or cancelled run in place.
pub(crate) const RETRY_RUN: &str = "select status from pgflow.retry_run(run_id => $1)";

/// Replays a run from a step; returns the new run's id.
pub(crate) const REPLAY_RUN: &str = "select pgflow.replay_run(run_id => $1, from_step => $2)";

/// A run with its step states.
pub(crate) const GET_RUN_WITH_STATES: &str = "select pgflow.get_run_with_states(run_id => $1)";

/// The run's status and output, and the first failed step with its error (for waiting).
pub(crate) const RUN_OUTCOME: &str = "select r.status, r.output, f.step_slug, \
     case when r.status = 'cancelled' then r.cancel_reason else f.error_message end \
     from pgflow.runs r \
     left join lateral (select ss.step_slug, ss.error_message from pgflow.step_states ss \
       where ss.run_id = r.run_id and ss.status = 'failed' order by ss.failed_at limit 1) f on true \
     where r.run_id = $1";

/// The input of a run (read lazily by `StepContext::flow_input`).
pub(crate) const RUN_INPUT: &str = "select input from pgflow.runs where run_id = $1";

/// Registers the session as a watcher of a run, so that its `run:*` events are sent (→ its status).
pub(crate) const WATCH_RUN: &str = "select pgflow.watch_run(run_id => $1)";

/// Removes the session's registration as a watcher of a run.
pub(crate) const UNWATCH_RUN: &str = "select pgflow.unwatch_run(run_id => $1)";

/// The notification channel of a run.
pub(crate) fn run_channel(run_id: uuid::Uuid) -> String {
    format!("pgflow_run_{}", run_id.simple())
}
