//! Every SQL statement the runtime sends, in one place; `pgflow.*` functions are called with named arguments.

/// `ensure_flow_compiled` → `{status, differences}`.
pub(crate) const ENSURE_FLOW_COMPILED: &str = "select pgflow.ensure_flow_compiled(\
     flow_slug => $1, shape => $2, allow_data_loss => $3, queue_mode => $4, routes => $5)";

/// The persisted steps of a flow with their queue and effective timeout (seconds), in step order.
pub(crate) const FLOW_STEPS: &str = "select s.step_slug, s.queue_name, \
     coalesce(s.opt_timeout, f.opt_timeout)::int as timeout \
     from pgflow.steps s join pgflow.flows f on f.flow_slug = s.flow_slug \
     where s.flow_slug = $1 order by s.step_index";

/// Registers this worker with its exact subscription → `{enabled, disabled_reason, ...}`.
pub(crate) const REGISTER_WORKER: &str = "select pgflow.register_worker(worker_id => $1, \
     function_name => $2, queue_name => $3, flow_slug => $4, step_slug => $5)";

/// Disables a worker function persistently, with the reason (until an operator enables it again).
pub(crate) const DISABLE_WORKER_FUNCTION: &str =
    "select pgflow.disable_worker_function(function_name => $1, reason => $2)";

/// Heartbeat: `(deprecated, enabled)`.
pub(crate) const HEARTBEAT: &str = "update pgflow.workers w set last_heartbeat_at = clock_timestamp() \
     where w.worker_id = $1 \
     returning w.deprecated_at is not null, \
     coalesce((select wf.enabled from pgflow.worker_functions wf where wf.function_name = w.function_name), true)";

/// Routes of a flow with queued work and no live worker (`pgflow.queue_coverage`).
pub(crate) const UNCOVERED_ROUTES: &str = "select step_slug, queue_name, queued_tasks \
     from pgflow.queue_coverage where flow_slug = $1 and uncovered order by step_index";

/// Read and classifying claim for one exact subscription (a step, or every step of a plain flow), in one round trip.
pub(crate) const READ_AND_CLAIM_TASKS: &str =
    "select pgflow.read_and_claim_tasks(queue_name => $1, \
     flow_slug => $2, step_slug => $3, qty => $4, vt => $5, worker_id => $6)";

/// Records a batch of outputs.
pub(crate) const COMPLETE_TASKS: &str = "select pgflow.complete_tasks(\
     run_ids => $1, step_slugs => $2, task_indexes => $3, outputs => $4)";

/// Records one output (fallback when a batch fails).
pub(crate) const COMPLETE_TASK: &str = "select 1 from pgflow.complete_task(\
     run_id => $1, step_slug => $2, task_index => $3, output => $4)";

/// Records a failure → the task's status afterwards (`queued` when it will be retried).
pub(crate) const FAIL_TASK: &str = "select status from pgflow.fail_task(\
     run_id => $1, step_slug => $2, task_index => $3, error_message => $4, \
     retry_delay_seconds => $5, terminal => $6)";

/// Hands back what a stopping worker could not finish.
pub(crate) const RELEASE_WORKER_TASKS: &str = "select pgflow.release_worker_tasks(worker_id => $1)";

/// Marks the worker stopped.
pub(crate) const MARK_WORKER_STOPPED: &str = "select pgflow.mark_worker_stopped(worker_id => $1)";

/// Stalled-task recovery, at most one caller at a time (the lock is released at the end of the statement).
pub(crate) const REQUEUE_STALLED_TASKS: &str = "select case when pg_try_advisory_xact_lock($1) \
     then pgflow.requeue_stalled_tasks() end";

/// Advisory lock key of stalled-task recovery (`"pgflow-rq"`).
pub(crate) const REQUEUE_LOCK_KEY: i64 = 0x7067_666c_6f77_7271;

/// Starts a run → its id.
pub(crate) const START_FLOW: &str =
    "select run_id from pgflow.start_flow(flow_slug => $1, input => $2, run_id => $3)";

/// A run with its step states.
pub(crate) const GET_RUN_WITH_STATES: &str = "select pgflow.get_run_with_states(run_id => $1)";

/// The run's status and output, and the first failed step (for waiting).
pub(crate) const RUN_OUTCOME: &str = "select r.status, r.output, \
     (select ss.step_slug from pgflow.step_states ss where ss.run_id = r.run_id and ss.status = 'failed' \
       order by ss.failed_at limit 1), \
     coalesce((select ss.error_message from pgflow.step_states ss where ss.run_id = r.run_id \
       and ss.status = 'failed' order by ss.failed_at limit 1), \
       (select t.error_message from pgflow.step_tasks t where t.run_id = r.run_id and t.status = 'failed' \
       order by t.failed_at limit 1)) \
     from pgflow.runs r where r.run_id = $1";

/// The notification channel of a run.
pub(crate) fn run_channel(run_id: uuid::Uuid) -> String {
    format!("pgflow_run_{}", run_id.simple())
}
