-- Tables, the record types, indexes and the queue-identity triggers.
--
-- Owns: every table of schema pgflow (definitions, workers, runtime state, deployments, signals and watchers),
-- its indexes, and the triggers that keep a task's queue name an immutable snapshot of its step's queue.
-- Tables, columns, defaults and constraint names follow upstream pgflow exactly. Additions:
--   * steps.queue_name       canonical lowercase PGMQ queue that receives the step's tasks;
--   * step_tasks.queue_name  immutable snapshot of that queue, taken when the task is created;
--   * task statuses `skipped` and `cancelled`;
--   * unique (queue_name, message_id) on step_tasks, and a case-insensitive unique flow slug;
--   * flow_aliases, shared_queues and worker_routes (deployments), queue_signals and run_watchers;
--   * run control (13_run_control.sql): run status `cancelled` with its reason and time, replay_of and
--     retry_count on runs, attempts_base on step_tasks, run_retries and idempotency_keys.
--   * runs.trace_context (the W3C trace context a run was started in) and the event log pgflow.events.
--
-- The bookkeeping table pgflow.schema_migrations is created by the installer before anything here.

------------------------------------------------------------------------------------------------------------
-- Definitions
------------------------------------------------------------------------------------------------------------

create table pgflow.flows (
  flow_slug text primary key,
  opt_max_attempts int not null default 3,
  opt_base_delay int not null default 1,
  opt_timeout int not null default 60,
  created_at timestamptz not null default now(),
  -- Deployment metadata, persisted and compared separately from the shape: 'flow' (every step on the
  -- flow's default queue, upstream's behaviour), 'step' (every step on its own private queue) or 'named'
  -- (steps routed to named, shared queues by a deployment).
  queue_mode text not null default 'flow',
  constraint slug_is_valid check (pgflow.is_valid_slug(flow_slug)),
  constraint opt_max_attempts_is_nonnegative check (opt_max_attempts >= 0),
  constraint opt_base_delay_is_nonnegative check (opt_base_delay >= 0),
  constraint opt_timeout_is_positive check (opt_timeout > 0),
  constraint queue_mode_is_valid check (queue_mode in ('flow', 'step', 'named'))
);

-- Two slugs that differ only in case would share one PGMQ queue (PGMQ lower-cases table names).
create unique index flows_flow_slug_lower_key on pgflow.flows (lower(flow_slug));

create table pgflow.steps (
  flow_slug text not null references pgflow.flows (flow_slug),
  step_slug text not null check (pgflow.is_valid_slug(step_slug)),
  step_type text not null default 'single' check (step_type in ('single', 'map')),
  step_index int not null default 0,
  deps_count int not null default 0 check (deps_count >= 0),
  opt_max_attempts int,
  opt_base_delay int,
  opt_timeout int,
  opt_start_delay int,
  required_input_pattern jsonb,
  forbidden_input_pattern jsonb,
  when_unmet text not null default 'skip',
  when_exhausted text not null default 'fail',
  created_at timestamptz not null default now(),
  -- Canonical physical queue of the step's future tasks. Plain flows: lower(flow_slug).
  queue_name text not null,
  primary key (flow_slug, step_slug),
  unique (flow_slug, step_index),
  constraint opt_max_attempts_is_nonnegative check (opt_max_attempts is null or opt_max_attempts >= 0),
  constraint opt_base_delay_is_nonnegative check (opt_base_delay is null or opt_base_delay >= 0),
  constraint opt_timeout_is_positive check (opt_timeout is null or opt_timeout > 0),
  constraint opt_start_delay_is_nonnegative check (opt_start_delay is null or opt_start_delay >= 0),
  constraint required_input_pattern_is_object check (
    required_input_pattern is null or jsonb_typeof(required_input_pattern) = 'object'),
  constraint forbidden_input_pattern_is_object check (
    forbidden_input_pattern is null or jsonb_typeof(forbidden_input_pattern) = 'object'),
  constraint when_unmet_is_valid check (when_unmet in ('fail', 'skip', 'skip-cascade')),
  constraint when_exhausted_is_valid check (when_exhausted in ('fail', 'skip', 'skip-cascade')),
  constraint queue_name_is_lowercase check (queue_name = lower(queue_name))
);

-- Ownership checks (is a queue name already routed by some flow?) and coverage look steps up by queue.
create index idx_steps_queue_name on pgflow.steps (queue_name);

create table pgflow.deps (
  flow_slug text not null references pgflow.flows (flow_slug),
  dep_slug text not null,
  step_slug text not null,
  created_at timestamptz not null default now(),
  primary key (flow_slug, dep_slug, step_slug),
  foreign key (flow_slug, dep_slug) references pgflow.steps (flow_slug, step_slug),
  foreign key (flow_slug, step_slug) references pgflow.steps (flow_slug, step_slug),
  check (dep_slug <> step_slug)
);

create index idx_deps_by_flow_step on pgflow.deps (flow_slug, step_slug);
create index idx_deps_by_flow_dep on pgflow.deps (flow_slug, dep_slug);

------------------------------------------------------------------------------------------------------------
-- Workers
------------------------------------------------------------------------------------------------------------

-- One row per worker process. The (flow, step) pairs it serves are in worker_routes.
create table pgflow.workers (
  worker_id uuid primary key,
  queue_name text not null,
  function_name text not null,
  started_at timestamptz not null default now(),
  deprecated_at timestamptz,
  stopped_at timestamptz,
  last_heartbeat_at timestamptz not null default now()
);

create index idx_workers_queue_name on pgflow.workers (queue_name);
create index idx_workers_heartbeat on pgflow.workers (last_heartbeat_at);

create table pgflow.worker_functions (
  function_name text primary key,
  enabled boolean not null default true,
  debounce interval not null default '6 seconds' check (debounce >= '1 second'),
  last_invoked_at timestamptz,
  created_at timestamptz not null default now(),
  updated_at timestamptz not null default now(),
  -- The fence: why and when pgflow.disable_worker_function() disabled the function.
  disabled_reason text,
  disabled_at timestamptz
);


-- The exact (flow, step) pairs a registered worker runs from its queue (pgflow.workers.queue_name). A worker
-- with no rows registered the upstream way (track_worker_function) and is taken to serve its whole queue.
create table pgflow.worker_routes (
  worker_id uuid not null references pgflow.workers (worker_id) on delete cascade,
  flow_slug text not null,
  step_slug text not null,
  primary key (worker_id, flow_slug, step_slug),
  foreign key (flow_slug, step_slug) references pgflow.steps (flow_slug, step_slug) on delete cascade
);
create index idx_worker_routes_flow_step on pgflow.worker_routes (flow_slug, step_slug);

------------------------------------------------------------------------------------------------------------
-- Deployments
------------------------------------------------------------------------------------------------------------

-- A stable name for the concrete version new runs start. Activated by ensure_flow_compiled(alias => ...)
-- after the version's complete shape and routing are persisted.
create table pgflow.flow_aliases (
  alias text primary key,
  flow_slug text not null references pgflow.flows (flow_slug),
  activated_at timestamptz not null default now(),
  -- The concrete slug this alias pointed at before its last activation (NULL for a new alias).
  previous_flow_slug text,
  constraint alias_is_valid check (pgflow.is_valid_slug(alias))
);
create unique index flow_aliases_alias_lower_key on pgflow.flow_aliases (lower(alias));
create index idx_flow_aliases_flow_slug on pgflow.flow_aliases (flow_slug);

-- Queues shared by named routes: created by pgflow for a named route, or adopted (an existing PGMQ queue,
-- named with adopt_queues => true). Never dropped by pgflow.
create table pgflow.shared_queues (
  queue_name text primary key,
  adopted boolean not null default false,
  created_at timestamptz not null default now(),
  constraint queue_name_is_lowercase check (queue_name = lower(queue_name))
);

------------------------------------------------------------------------------------------------------------
-- Runtime state
------------------------------------------------------------------------------------------------------------

create table pgflow.runs (
  run_id uuid primary key default gen_random_uuid(),
  flow_slug text not null references pgflow.flows (flow_slug),
  status text not null default 'started',
  input jsonb not null,
  output jsonb,
  remaining_steps int not null default 0 check (remaining_steps >= 0),
  started_at timestamptz not null default now(),
  completed_at timestamptz,
  failed_at timestamptz,
  -- Run control: a cancelled run's time and reason; the run a replay copied its outputs from; how many times
  -- retry_run sent the run back to `started` (each try is a row of run_retries).
  cancelled_at timestamptz,
  cancel_reason text,
  replay_of uuid,
  retry_count int not null default 0,
  -- The W3C trace context the run was started in ({"traceparent": ..., "tracestate": ...}), taken from the
  -- transaction-local setting pgflow.trace_context by a trigger (14_observability.sql); NULL without one.
  trace_context jsonb,
  -- The run's priority (18_priorities.sql): higher is claimed first on a queue with priorities enabled.
  priority int not null default 0,
  constraint status_is_valid check (status in ('started', 'failed', 'completed', 'cancelled')),
  constraint completed_at_or_failed_at check (not (completed_at is not null and failed_at is not null)),
  constraint completed_at_is_after_started_at check (completed_at is null or completed_at >= started_at),
  constraint failed_at_is_after_started_at check (failed_at is null or failed_at >= started_at),
  constraint cancelled_at_matches_status check ((status = 'cancelled') = (cancelled_at is not null)),
  constraint retry_count_nonnegative check (retry_count >= 0)
) with (fillfactor = 85);

-- The operator's run list (pgflow_runtime::admin) pages newest first on (started_at, run_id), over every run, the
-- runs of a flow or the runs in a status; each index also serves lookups by its leading column alone.
create index idx_runs_started on pgflow.runs (started_at, run_id);
create index idx_runs_flow_slug_started on pgflow.runs (flow_slug, started_at, run_id);
create index idx_runs_status_started on pgflow.runs (status, started_at, run_id);
-- The run list's input filter (a value at a JSON path) as containment: the runs whose input holds it, however
-- far back they are, without reading the history in between.
create index idx_runs_input on pgflow.runs using gin (input jsonb_path_ops);
-- Retention finds the oldest finished runs without reading the started ones or the whole history.
create index idx_runs_finished_at on pgflow.runs ((coalesce(completed_at, failed_at, cancelled_at)))
  where status <> 'started';
-- The replays of a run.
create index idx_runs_replay_of on pgflow.runs (replay_of) where replay_of is not null;

create table pgflow.step_states (
  flow_slug text not null references pgflow.flows (flow_slug),
  run_id uuid not null references pgflow.runs (run_id),
  step_slug text not null,
  status text not null default 'created',
  remaining_tasks int,
  initial_tasks int check (initial_tasks is null or initial_tasks >= 0),
  remaining_deps int not null default 0 check (remaining_deps >= 0),
  output jsonb,
  error_message text,
  skip_reason text,
  created_at timestamptz not null default now(),
  started_at timestamptz,
  completed_at timestamptz,
  failed_at timestamptz,
  skipped_at timestamptz,
  primary key (run_id, step_slug),
  foreign key (flow_slug, step_slug) references pgflow.steps (flow_slug, step_slug),
  constraint status_is_valid check (status in ('created', 'started', 'completed', 'failed', 'skipped')),
  constraint status_and_remaining_tasks_match check (status <> 'completed' or remaining_tasks = 0),
  constraint remaining_tasks_state_consistency check (
    remaining_tasks is null or status not in ('created', 'skipped')),
  constraint initial_tasks_known_when_started check (status <> 'started' or initial_tasks is not null),
  constraint output_only_for_completed_or_null check (output is null or status = 'completed'),
  constraint skip_reason_matches_status check (
    (status = 'skipped' and skip_reason is not null) or (status <> 'skipped' and skip_reason is null)),
  constraint completed_at_or_failed_at_or_skipped_at check (
    (completed_at is not null)::int + (failed_at is not null)::int + (skipped_at is not null)::int <= 1),
  constraint started_at_is_after_created_at check (started_at is null or started_at >= created_at),
  constraint completed_at_is_after_started_at check (
    completed_at is null or started_at is null or completed_at >= started_at),
  constraint failed_at_is_after_started_at check (
    failed_at is null or started_at is null or failed_at >= started_at),
  constraint skipped_at_is_after_created_at check (skipped_at is null or skipped_at >= created_at)
) with (fillfactor = 85);

-- Ready steps of a run (start_ready_steps, cascades).
create index idx_step_states_ready on pgflow.step_states (run_id, status, remaining_deps)
  where status = 'created' and remaining_deps = 0;
create index idx_step_states_failed on pgflow.step_states (run_id, step_slug) where status = 'failed';
-- Steps with work in flight (stalled-task recovery).
create index idx_step_states_started on pgflow.step_states (run_id, step_slug) where status = 'started';
create index idx_step_states_flow_slug on pgflow.step_states (flow_slug);

create table pgflow.step_tasks (
  flow_slug text not null references pgflow.flows (flow_slug),
  run_id uuid not null references pgflow.runs (run_id),
  step_slug text not null,
  message_id bigint,
  task_index int not null default 0,
  status text not null default 'queued',
  attempts_count int not null default 0,
  error_message text,
  output jsonb,
  queued_at timestamptz not null default now(),
  started_at timestamptz,
  completed_at timestamptz,
  failed_at timestamptz,
  last_worker_id uuid references pgflow.workers (worker_id) on delete set null,
  requeued_count int not null default 0,
  last_requeued_at timestamptz,
  permanently_stalled_at timestamptz,
  -- Immutable snapshot of the step's queue when the task was created. Every queue operation on this task
  -- uses (queue_name, message_id). Filled from steps.queue_name when an insert leaves it NULL.
  queue_name text not null,
  -- A map task's array element, copied once when the step starts (NULL for single steps), so that claiming
  -- an element never reads the whole array again: a claim costs the same for 10 elements or 20,000.
  element jsonb,
  -- The attempts used before the task's last retry_run: the attempt budget (max_attempts) counts from here,
  -- while attempts_count keeps growing so that a result of an earlier try stays stale.
  attempts_base int not null default 0,
  primary key (run_id, step_slug, task_index),
  foreign key (run_id, step_slug) references pgflow.step_states (run_id, step_slug),
  constraint valid_status check (
    status in ('queued', 'started', 'completed', 'failed', 'skipped', 'cancelled')),
  constraint output_valid_only_for_completed check (output is null or status in ('completed', 'failed')),
  constraint attempts_count_nonnegative check (attempts_count >= 0),
  constraint completed_at_or_failed_at check (not (completed_at is not null and failed_at is not null)),
  constraint completed_at_is_after_queued_at check (completed_at is null or completed_at >= queued_at),
  constraint failed_at_is_after_queued_at check (failed_at is null or failed_at >= queued_at),
  constraint started_at_is_after_queued_at check (started_at is null or started_at >= queued_at),
  constraint completed_at_is_after_started_at check (
    completed_at is null or started_at is null or completed_at >= started_at),
  constraint failed_at_is_after_started_at check (
    failed_at is null or started_at is null or failed_at >= started_at)
) with (fillfactor = 80);

-- PGMQ message identity is (queue, msg_id); one message belongs to at most one task. This index is also
-- the claim path of start_tasks.
create unique index step_tasks_queue_name_message_id_key on pgflow.step_tasks (queue_name, message_id);
-- For the workers foreign key (deleting a worker). Deliberately no index on `status` (not even partial):
-- completing or failing a task then changes no indexed column, so with the free space that fillfactor leaves
-- the update can stay on its page (HOT) without touching any index. Stalled-task recovery finds started
-- tasks through started step states (idx_step_states_started) instead.
create index idx_step_tasks_last_worker on pgflow.step_tasks (last_worker_id);

-- The earlier attempts of tasks: one row per attempt that ended without being its task's last state, written
-- where the task row is about to be reset for another attempt (pgflow._record_attempts): a failure that is
-- retried, a requeue by recovery (a stall, a dead worker), a release at a worker's shutdown, a reset by
-- retry_run. A task's current or last attempt is its step_tasks row; claims and completions never write here.
-- Deleted with their run (prune_history, delete_flow_and_data). No foreign key to step_tasks: its checks
-- would run on every update of a task (the hot path) and on every task pruning deletes.
create table pgflow.task_attempts (
  attempt_id bigint generated always as identity primary key,
  run_id uuid not null,
  step_slug text not null,
  task_index int not null,
  -- The attempt's number (step_tasks.attempts_count then). An attempt given back at a worker's shutdown is
  -- numbered again by the next claim; attempt_id orders the attempts of a task.
  attempt int not null,
  -- When the attempt became queued, started, and ended (its failure, its requeue, the run's retry).
  queued_at timestamptz not null,
  started_at timestamptz,
  ended_at timestamptz not null,
  worker_id uuid,
  -- 'failed': the handler failed and the task was retried; 'stalled': no result within the timeout, requeued
  -- by recovery (or by resolve_stalled_task); 'worker_lost': its worker stopped heartbeating, requeued by
  -- recovery; 'released': its worker handed it back at shutdown; 'run_retried': the attempt of the run's
  -- earlier try (failed or cancelled) that retry_run started again.
  outcome text not null,
  error_message text,
  constraint valid_outcome check (outcome in ('failed', 'stalled', 'worker_lost', 'released', 'run_retried'))
);

create index idx_task_attempts_task on pgflow.task_attempts (run_id, step_slug, task_index);

------------------------------------------------------------------------------------------------------------
-- Run control
------------------------------------------------------------------------------------------------------------

-- One row per retry_run: who sent the run back to `started`, when, and what the earlier try left (its status,
-- cancel reason and the errors of its failed tasks).
create table pgflow.run_retries (
  run_id uuid not null references pgflow.runs (run_id) on delete cascade,
  retry_number int not null check (retry_number > 0),
  retried_at timestamptz not null default now(),
  retried_by text not null,
  previous_status text not null,
  previous_failed_at timestamptz,
  previous_cancelled_at timestamptz,
  previous_cancel_reason text,
  -- [{"step_slug", "task_index", "attempts", "error_message"}] of the tasks that failed, in step and task order.
  errors jsonb not null default '[]',
  primary key (run_id, retry_number)
);

-- Idempotency keys of starts: the run that a (flow or alias as given, key) started, until expires_at.
create table pgflow.idempotency_keys (
  flow_name text not null,
  idempotency_key text not null,
  run_id uuid not null references pgflow.runs (run_id) on delete cascade deferrable initially deferred,
  input jsonb not null,
  created_at timestamptz not null default now(),
  expires_at timestamptz not null,
  primary key (flow_name, idempotency_key),
  constraint flow_name_is_lowercase check (flow_name = lower(flow_name)),
  constraint expires_after_created check (expires_at > created_at)
);
create index idx_idempotency_keys_run_id on pgflow.idempotency_keys (run_id);
create index idx_idempotency_keys_expires_at on pgflow.idempotency_keys (expires_at);

------------------------------------------------------------------------------------------------------------
-- Signals and watchers
------------------------------------------------------------------------------------------------------------

-- When each queue was last signalled, per source ('exchange': inside pgflow.exchange's completions; 'other':
-- everywhere else). Unlogged: losing it in a crash only makes the next signal earlier.
create unlogged table pgflow.queue_signals (
  queue_name text,
  signaled_at timestamptz not null default '-infinity',
  source text not null default 'other' check (source in ('exchange', 'other')),
  primary key (queue_name, source)
);

-- Who watches which run. Unlogged: after a crash the sessions that watched are gone too.
create unlogged table pgflow.run_watchers (
  run_id uuid not null,
  backend_pid int not null,
  since timestamptz not null default now(),
  primary key (run_id, backend_pid)
);

------------------------------------------------------------------------------------------------------------
-- The event log
------------------------------------------------------------------------------------------------------------

-- The events that matter when something goes wrong, each naming what caused it (see 14_observability.sql
-- for the kinds and causes). Written by pgflow._log_event; bounded by retention (prune_history).
create table pgflow.events (
  event_id bigint generated always as identity primary key,
  occurred_at timestamptz not null default clock_timestamp(),
  kind text not null,
  -- What made it happen: 'worker_startup', 'worker', 'operator', 'claim', 'completion', 'maintenance', ...
  cause text not null,
  -- Who: a worker id, or the database role of an operator.
  actor text,
  run_id uuid,
  flow_slug text,
  step_slug text,
  task_index int,
  worker_id uuid,
  queue_name text,
  detail jsonb not null default '{}',
  constraint kind_is_valid check (kind ~ '^[a-z][a-z0-9_]*$'),
  constraint detail_is_object check (jsonb_typeof(detail) = 'object')
);

create index idx_events_occurred_at on pgflow.events (occurred_at);
create index idx_events_run_id on pgflow.events (run_id) where run_id is not null;
create index idx_events_kind on pgflow.events (kind, occurred_at);

------------------------------------------------------------------------------------------------------------
-- Queue identity triggers
------------------------------------------------------------------------------------------------------------

create function pgflow._steps_default_queue_name()
returns trigger
language plpgsql
set search_path = ''
as $$
begin
  new.queue_name := lower(new.flow_slug);
  return new;
end;
$$;

create trigger steps_default_queue_name
  before insert on pgflow.steps
  for each row when (new.queue_name is null)
  execute function pgflow._steps_default_queue_name();

create function pgflow._step_tasks_snapshot_queue_name()
returns trigger
language plpgsql
set search_path = ''
as $$
begin
  select s.queue_name into new.queue_name
  from pgflow.steps s
  where s.flow_slug = new.flow_slug and s.step_slug = new.step_slug;
  return new;
end;
$$;

create trigger step_tasks_snapshot_queue_name
  before insert on pgflow.step_tasks
  for each row when (new.queue_name is null)
  execute function pgflow._step_tasks_snapshot_queue_name();

create function pgflow._step_tasks_queue_name_is_immutable()
returns trigger
language plpgsql
set search_path = ''
as $$
begin
  raise exception 'step_tasks.queue_name is immutable: task (run_id %, step %, task_index %) belongs to queue "%"',
    old.run_id, old.step_slug, old.task_index, old.queue_name
    using errcode = 'integrity_constraint_violation',
          detail = format('An update tried to change it to "%s".', new.queue_name),
          hint = 'A task keeps the queue it was created in; send new work instead of moving tasks.';
end;
$$;

create trigger step_tasks_queue_name_is_immutable
  before update of queue_name on pgflow.step_tasks
  for each row when (old.queue_name is distinct from new.queue_name)
  execute function pgflow._step_tasks_queue_name_is_immutable();

------------------------------------------------------------------------------------------------------------
-- The record start_tasks returns
------------------------------------------------------------------------------------------------------------

create type pgflow.step_task_record as (
  flow_slug text,
  run_id uuid,
  step_slug text,
  input jsonb,
  msg_id bigint,
  task_index int,
  flow_input jsonb
);

-- The outcome of one item of a fenced batch (complete_tasks, exchange).
create type pgflow.task_outcome as (
  run_id uuid,
  step_slug text,
  task_index int,
  -- 'applied': this call recorded the result; 'stale': it changed nothing (fenced: see 08_completion.sql).
  outcome text,
  -- The task's status and attempt afterwards (NULL when there is no such task), and its last worker.
  status text,
  attempts_count int,
  last_worker_id uuid
);
