-- pgflow-rs SQL core: the baseline.
--
-- This file installs the whole SQL core as it stood when the readable source moved to `schema/`: it is the
-- files of `schema/` of that day, concatenated in name order. Like every applied migration it is immutable;
-- `schema/` is where the SQL is read and edited, and each later change adds a delta migration beside this one
-- (see schema/README.md). The installer upgrades a database installed by the unreleased development
-- migrations that came before it in place, since their final state is exactly this file's.

-- ==== schema/01_utilities.sql ====
-- The pgflow schema, and small pure helpers that tables and functions build on.
--
-- Owns: the schema itself; slug validation; the retry-delay formula and its cap; the timing buffers of claims,
-- stalls and recovery; the minimum interval between queue signals; the plan reset once the tables grow.
-- Upstream interface: is_valid_slug, is_local, calculate_retry_delay.

create schema if not exists pgflow;
comment on schema pgflow is 'pgflow-rs: Postgres-native DAG workflows (upstream-compatible SQL core)';

-- A slug is an identifier-like name: letter or underscore first, then letters, digits or underscores,
-- at most 128 characters, and never the reserved word `run` (step inputs use step slugs as keys).
create function pgflow.is_valid_slug(slug text)
returns boolean
language plpgsql
immutable
set search_path = ''
as $$
begin
  return slug is not null
    and slug <> ''
    and length(slug) <= 128
    and slug ~ '^[a-zA-Z_][a-zA-Z0-9_]*$'
    and slug <> 'run';
end;
$$;

-- Whether this database is a local development database, where `ensure_flow_compiled` may recompile a flow
-- destructively when its shape changed.
--
-- Two ways to say "local":
--   * the Supabase CLI's fixed local JWT secret in `app.settings.jwt_secret` (upstream's rule);
--   * outside Supabase: `ALTER DATABASE <db> SET pgflow.local = 'true'` (or `SET pgflow.local = 'true'` in a
--     session). Production databases must never set it.
create function pgflow.is_local()
returns boolean
language sql
stable parallel safe
set search_path = ''
as $$
  select coalesce(
      current_setting('app.settings.jwt_secret', true)
        = 'super-secret-jwt-token-with-at-least-32-characters-long',
      false)
    or coalesce(lower(current_setting('pgflow.local', true)) in ('true', 'on', '1', 'yes'), false);
$$;

-- The longest delay, in seconds, that a retry may wait: one day. Both the computed backoff and a
-- handler-chosen delay are capped at it.
create function pgflow._max_retry_delay_seconds()
returns integer
language sql
immutable parallel safe
as $$ select 86400 $$;

-- Exponential backoff: the delay before the next attempt, after `attempts_count` attempts so far:
-- base_delay * 2^attempts_count seconds, capped at pgflow._max_retry_delay_seconds() (one day). Computed in
-- numeric with a bounded exponent, so no attempt count or base delay overflows; negative inputs count as 0.
create function pgflow.calculate_retry_delay(base_delay numeric, attempts_count integer)
returns integer
language sql
immutable parallel safe
set search_path = ''
as $$
  select least(
    floor(greatest(coalesce(base_delay, 0), 0)
          * power(2::numeric, least(greatest(coalesce(attempts_count, 0), 0), 64))),
    pgflow._max_retry_delay_seconds())::int;
$$;

-- Timing buffers, in seconds, in one place.
--
-- A claimed task's message is kept invisible for (effective step timeout + claim buffer): the worker enforces
-- the timeout itself, and the buffer covers the round trip that reports the result.
--
-- A started task counts as stalled once it has been running for (effective step timeout + stall buffer).
-- The stall buffer is larger than the claim buffer, so a task is never requeued while its claim visibility
-- (and a late but honest result) is still pending.
--
-- "Effective step timeout" is always coalesce(steps.opt_timeout, flows.opt_timeout).
create function pgflow._claim_visibility_buffer_seconds()
returns integer
language sql
immutable parallel safe
as $$ select 2 $$;

create function pgflow._stall_buffer_seconds()
returns integer
language sql
immutable parallel safe
as $$ select 30 $$;

-- The recovery boundary of a started task: from this moment on, requeue_stalled_tasks() may requeue it
-- (started_at + effective step timeout + stall buffer). claim_tasks hides a duplicate message of a started
-- task until exactly this moment, so claim visibility and stalled recovery share one rule.
-- Computed in double precision, so a timeout near the int maximum cannot overflow.
create function pgflow._recovery_boundary(p_started_at timestamp with time zone, p_effective_timeout integer)
returns timestamp with time zone
language sql
stable parallel safe
as $$
  select p_started_at
    + make_interval(secs => p_effective_timeout::float8 + pgflow._stall_buffer_seconds())
$$;

-- The shortest time between two signals of one queue.
create function pgflow._signal_interval()
returns interval
language sql
immutable parallel safe
as $$ select interval '5 milliseconds' $$;

create function pgflow._replan_if_grown()
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_pages bigint := (pg_relation_size('pgflow.runs'::regclass) + pg_relation_size('pgflow.step_states'::regclass)
                     + pg_relation_size('pgflow.step_tasks'::regclass)) / current_setting('block_size')::int;
  v_planned bigint := nullif(current_setting('pgflow.planned_pages', true), '')::bigint;
begin
  if v_planned is not null and v_pages > 2 * v_planned + 16 then
    discard plans;
  elsif v_planned is not null and v_pages >= v_planned then
    return;
  end if;
  -- First call of the session (its plans are about to be built), a replan, or tables that shrank (plans
  -- built on larger tables stay good; growth is measured from the smaller size).
  perform set_config('pgflow.planned_pages', v_pages::text, false);
end;
$$;

-- ==== schema/02_tables.sql ====
-- Tables, the record types, indexes and the queue-identity triggers.
--
-- Owns: every table of schema pgflow (definitions, workers, runtime state, deployments, signals and watchers),
-- its indexes, and the triggers that keep a task's queue name an immutable snapshot of its step's queue.
-- Tables, columns, defaults and constraint names follow upstream pgflow exactly. Additions:
--   * steps.queue_name       canonical lowercase PGMQ queue that receives the step's tasks;
--   * step_tasks.queue_name  immutable snapshot of that queue, taken when the task is created;
--   * task statuses `skipped` and `cancelled`;
--   * unique (queue_name, message_id) on step_tasks, and a case-insensitive unique flow slug;
--   * flow_aliases, shared_queues and worker_routes (deployments), queue_signals and run_watchers.
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
  constraint status_is_valid check (status in ('started', 'failed', 'completed')),
  constraint completed_at_or_failed_at check (not (completed_at is not null and failed_at is not null)),
  constraint completed_at_is_after_started_at check (completed_at is null or completed_at >= started_at),
  constraint failed_at_is_after_started_at check (failed_at is null or failed_at >= started_at)
) with (fillfactor = 85);

create index idx_runs_flow_slug on pgflow.runs (flow_slug);
create index idx_runs_status on pgflow.runs (status);
-- Retention finds the oldest finished runs without reading the started ones or the whole history.
create index idx_runs_finished_at on pgflow.runs ((coalesce(completed_at, failed_at))) where status <> 'started';

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

-- ==== schema/03_events.sql ====
-- Run and step events, run watchers, and queue signals.
--
-- Owns: how lifecycle events leave the database (pgflow._emit: Supabase Realtime when present, pg_notify on
-- the run's channel otherwise, filtered by the `pgflow.notify` setting and by who watches the run), the
-- watcher registry, and the throttled NOTIFY that wakes the workers of a queue when it gets new tasks.
-- Event names and payloads are upstream's (`run:started`, `step:<slug>:completed`, ...).

-- The pg_notify channel carrying the events of one run when Supabase Realtime is not installed:
-- `pgflow_run_` followed by the run id as 32 lowercase hex digits (43 characters, below the 63-byte limit
-- for identifiers). A client runs `LISTEN pgflow_run_<hex>` before starting or while watching a run.
create function pgflow.run_channel(run_id uuid)
returns text
language sql
immutable parallel safe security definer
as $$ select 'pgflow_run_' || replace(run_id::text, '-', '') $$;

-- Whether step events go anywhere (Supabase Realtime, or pgflow.notify = 'all'); when they do not, the batch
-- paths skip building them.
create function pgflow._step_events_enabled()
returns boolean
language plpgsql
stable
set search_path = ''
as $$
begin
  return to_regprocedure('realtime.send(jsonb,text,text,boolean)') is not null
      or coalesce(nullif(current_setting('pgflow.notify', true), ''), 'run') = 'all';
end;
$$;

-- The one event function. `event` and `payload` are exactly what upstream broadcasts (`run:started`,
-- `step:<slug>:completed`, ...). Where it goes is decided on every call (a cheap catalog lookup):
--   * Supabase: `realtime.send(payload, event, 'pgflow:run:<run_id>', false)` when it exists, unchanged.
--   * Anywhere else: `pg_notify(pgflow.run_channel(run_id), <compact json>)` with {"event_type", "event",
--     "run_id", "step_slug" (step events), "status"} and no inputs or outputs (NOTIFY payloads are limited to
--     8000 bytes); delivered on commit, in emission order.
--   * An event with a NULL run_id (alias activation) goes to the topic `pgflow:deployments`, or else to the
--     channel `pgflow_deployments`, unless pgflow.notify is 'off'.
-- The setting `pgflow.notify` controls the pg_notify path of run events: 'watched' (the default: run events
-- of runs with a watcher, see watch_run), 'run' (run events of every run), 'all' (run and step events of every
-- run) or 'off'. A transaction that notifies takes a cluster-wide lock while it commits, so NOTIFY stays off
-- the per-task hot path unless someone asks for it.
create function pgflow._emit(event text, run_id uuid, payload jsonb)
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_mode text;
begin
  if to_regprocedure('realtime.send(jsonb,text,text,boolean)') is not null then
    perform realtime.send(payload, event,
                          case when run_id is null then 'pgflow:deployments' else 'pgflow:run:' || run_id::text end,
                          false);
    return;
  end if;

  v_mode := coalesce(nullif(current_setting('pgflow.notify', true), ''), 'watched');
  if v_mode = 'off' then
    return;
  end if;

  if run_id is null then
    perform pg_notify('pgflow_deployments', payload::text);
    return;
  end if;

  if v_mode <> 'all' and left(event, 4) <> 'run:' then
    return;
  end if;
  if v_mode not in ('run', 'all')
     and not exists (select 1 from pgflow.run_watchers w where w.run_id = _emit.run_id) then
    return;
  end if;

  perform pg_notify(
    pgflow.run_channel(run_id),
    jsonb_strip_nulls(jsonb_build_object(
      'event_type', payload ->> 'event_type',
      'event', event,
      'run_id', run_id,
      'step_slug', payload ->> 'step_slug',
      'status', payload ->> 'status'
    ))::text
  );
end;
$$;

-- step:started of a step just started.
create function pgflow._emit_step_started(p_run_id uuid, p_step_slug text, p_started_at timestamp with time zone, p_remaining_tasks integer, p_remaining_deps integer)
returns void
language plpgsql
set search_path = ''
as $$
begin
  perform pgflow._emit('step:' || p_step_slug || ':started', p_run_id, jsonb_build_object(
    'event_type', 'step:started',
    'run_id', p_run_id,
    'step_slug', p_step_slug,
    'status', 'started',
    'started_at', p_started_at,
    'remaining_tasks', p_remaining_tasks,
    'remaining_deps', p_remaining_deps
  ));
end;
$$;

-- Registers the calling session as a watcher of `run_id`; returns the run's status, NULL if there is no
-- such run yet (a caller that chooses the run id can watch before starting it, and gets run:started too).
create function pgflow.watch_run(run_id uuid)
returns text
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_status text;
begin
  select r.status into v_status from pgflow.runs r where r.run_id = watch_run.run_id for share;
  insert into pgflow.run_watchers (run_id, backend_pid)
  values (watch_run.run_id, pg_backend_pid())
  on conflict do nothing;
  return v_status;
end;
$$;

-- Removes the calling session's registration as a watcher of `run_id`, if any.
create function pgflow.unwatch_run(run_id uuid)
returns void
language sql
security definer
set search_path = ''
as $$
  delete from pgflow.run_watchers w where w.run_id = unwatch_run.run_id and w.backend_pid = pg_backend_pid();
$$;

-- Signals each of p_queues (NOTIFY pgflow_queue_signal, payload the queue name, delivered at commit; NULLs
-- and repeats ignored) unless this source signalled it less than pgflow._signal_interval() ago or another
-- transaction of this source is signalling it now (its signal covers this one). Never waits. The source is
-- 'exchange' inside pgflow.exchange's completions, 'other' everywhere else; an exchange skips the queues that
-- no other live worker serves (its own worker claims their tasks in the same round trip).
create function pgflow._signal_queues(p_queues text[])
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_source text := case when current_setting('pgflow.signal_source', true) = 'exchange' then 'exchange'
                        else 'other' end;
  v_worker uuid := case when v_source = 'exchange'
                         then nullif(current_setting('pgflow.signal_worker', true), '')::uuid end;
  v_queue text;
begin
  for v_queue in
    with wanted as (
      select distinct q.name from unnest(p_queues) as q(name)
      where q.name is not null
        -- An exchange wakes the other live workers of the queue; its own worker ignores its signals.
        and (v_source <> 'exchange'
             or exists (select 1 from pgflow.workers wk
                        where wk.queue_name = q.name
                          and wk.worker_id is distinct from v_worker
                          and wk.stopped_at is null
                          and wk.deprecated_at is null
                          and wk.last_heartbeat_at > now() - pgflow._worker_liveness_window()))
    ),
    due as (
      select s.queue_name
      from pgflow.queue_signals s
      where s.source = v_source
        and s.queue_name in (select w.name from wanted w)
        and s.signaled_at < clock_timestamp() - pgflow._signal_interval()
      order by s.queue_name
      for update skip locked
    ),
    stamped as (
      update pgflow.queue_signals s
      set signaled_at = clock_timestamp()
      from due
      where s.queue_name = due.queue_name and s.source = v_source
      returning s.queue_name
    ),
    added as (
      insert into pgflow.queue_signals (queue_name, source, signaled_at)
      select w.name, v_source, clock_timestamp()
      from wanted w
      where not exists (select 1 from pgflow.queue_signals s where s.queue_name = w.name and s.source = v_source)
      on conflict do nothing
      returning queue_name
    )
    select x.queue_name from stamped x
    union all
    select a.queue_name from added a
  loop
    perform pg_notify('pgflow_queue_signal', v_queue);
  end loop;
end;
$$;

-- ==== schema/04_queue_names.sql ====
-- Queue names, queue privacy, and the per-queue statement functions.
--
-- Owns: the PGMQ queue-name rule (at most 47 characters, lowercase: readable `flow__step`, else `flow__index`,
-- else the flow is refused; never truncated or hashed), the routes a flow persists, the checks that a flow's
-- private queues belong to nobody else, queue creation, and `pgflow._queue_ops_<queue>`: one PL/pgSQL
-- function per queue holding the statements on its PGMQ tables, planned once per session.

create function pgflow._max_queue_name_length()
returns integer
language sql
immutable parallel safe
as $$ select 47 $$;

-- The exact spelling PGMQ registered for a queue (pgmq.meta is case-sensitive, PGMQ table names are not).
-- NULL when no such queue exists.
create function pgflow._queue_meta_name(queue_name text)
returns text
language sql
stable
set search_path = ''
as $$
  select m.queue_name::text from pgmq.meta m where lower(m.queue_name) = lower(_queue_meta_name.queue_name)
  order by (m.queue_name = _queue_meta_name.queue_name) desc
  limit 1;
$$;

-- The authoritative per-step route map of a step-queued flow.
--
-- Input: the concrete flow slug and the complete ordered list of step slugs (array order = step_index).
-- Output: one row per step, in order: (step_index zero-based, step_slug as given, queue_name lowercase).
-- Raises, before returning anything (PostgreSQL MESSAGE / DETAIL / HINT):
--   PF010 MESSAGE  Flow "<flow>" cannot use per-step queues.
--         DETAIL   The shortest required queue "<lower(flow)>__0" is <n> characters; PGMQ allows at most 47.
--         HINT     Shorten the concrete flow slug or use the default single queue.
--   PF011 MESSAGE  Cannot derive a queue for step "<step>" at index <i> in flow "<flow>".
--         DETAIL   The readable name is <r> characters and the index fallback is <f>; PGMQ allows at most 47.
--         HINT     Shorten the concrete flow slug, shorten the step slug enough for the readable name, or use
--                  the default single queue.
--   PF012 two steps resolve to the same name (only possible for step slugs that differ only in letter case);
--   22023 an empty flow, or a flow or step slug that is not a valid slug.
-- Every distinct name is also passed to pgmq.validate_queue_name(). Pure otherwise: reads no table.
create function pgflow.resolve_step_queues(flow_slug text, step_slugs text[])
returns table(step_index integer, step_slug text, queue_name text)
language plpgsql
stable security definer
set search_path = ''
as $$
declare
  v_max int := pgflow._max_queue_name_length();
  v_flow text := resolve_step_queues.flow_slug;
  v_n int := coalesce(cardinality(resolve_step_queues.step_slugs), 0);
  v_lower int := coalesce(array_lower(resolve_step_queues.step_slugs, 1), 1);
  v_slugs text[] := '{}';
  v_names text[] := '{}';
  v_slug text;
  v_readable text;
  v_fallback text;
  v_first int;
  v_name text;
  i int;
begin
  if not pgflow.is_valid_slug(v_flow) then
    raise exception 'Flow slug "%" is not a valid slug.', coalesce(v_flow, 'NULL')
      using errcode = 'invalid_parameter_value',
            hint = 'A slug starts with a letter or underscore, continues with letters, digits or underscores, and has at most 128 characters.';
  end if;

  if length(lower(v_flow) || '__0') > v_max then
    raise exception 'Flow "%" cannot use per-step queues.', v_flow
      using errcode = 'PF010',
            detail = format('The shortest required queue "%s" is %s characters; PGMQ allows at most %s.',
                            lower(v_flow) || '__0', length(lower(v_flow) || '__0'), v_max),
            hint = 'Shorten the concrete flow slug or use the default single queue.';
  end if;

  if v_n = 0 then
    raise exception 'Flow "%" cannot use per-step queues.', v_flow
      using errcode = 'PF010',
            detail = 'The flow has no steps; a step-queued flow needs at least one step.',
            hint = 'Add a step to the flow or use the default single queue.';
  end if;

  for i in 0 .. v_n - 1 loop
    v_slug := resolve_step_queues.step_slugs[v_lower + i];
    if not pgflow.is_valid_slug(v_slug) then
      raise exception 'Step slug "%" at index % in flow "%" is not a valid slug.', coalesce(v_slug, 'NULL'), i, v_flow
        using errcode = 'invalid_parameter_value',
              hint = 'A slug starts with a letter or underscore, continues with letters, digits or underscores, and has at most 128 characters.';
    end if;
    v_readable := lower(v_flow || '__' || v_slug);
    v_fallback := lower(v_flow || '__' || i);
    if length(v_readable) <= v_max then
      v_name := v_readable;
    elsif length(v_fallback) <= v_max then
      v_name := v_fallback;
    else
      raise exception 'Cannot derive a queue for step "%" at index % in flow "%".', v_slug, i, v_flow
        using errcode = 'PF011',
              detail = format('The readable name is %s characters and the index fallback is %s; PGMQ allows at most %s.',
                              length(v_readable), length(v_fallback), v_max),
              hint = 'Shorten the concrete flow slug, shorten the step slug enough for the readable name, or use the default single queue.';
    end if;

    v_first := array_position(v_names, v_name);
    if v_first is not null then
      raise exception 'Steps "%" (index %) and "%" (index %) of flow "%" resolve to the same queue "%".',
          v_slugs[v_first], v_first - 1, v_slug, i, v_flow, v_name
        using errcode = 'PF012',
              detail = 'Generated queue names are lowercase, so step slugs that differ only in letter case collide.',
              hint = 'Rename one of the steps so the slugs differ by more than letter case, or use the default single queue.';
    end if;
    v_slugs := v_slugs || v_slug;
    v_names := v_names || v_name;
  end loop;

  foreach v_name in array v_names loop
    perform pgmq.validate_queue_name(v_name);
  end loop;

  return query
  select (u.ord - 1)::int, u.slug, u.name
  from unnest(v_slugs, v_names) with ordinality as u(slug, name, ord)
  order by u.ord;
end;
$$;

-- The persisted route map of a flow, in step order: what a worker subscribes to. Empty for a missing flow.
create function pgflow.flow_routes(flow_slug text)
returns table(step_index integer, step_slug text, queue_name text, queue_mode text)
language sql
stable security definer
set search_path = ''
as $$
  select s.step_index, s.step_slug, s.queue_name, f.queue_mode
  from pgflow.steps s
  join pgflow.flows f on f.flow_slug = s.flow_slug
  where s.flow_slug = flow_routes.flow_slug
  order by s.step_index;
$$;

-- Raises PF013 unless every generated queue (p_step_slugs[i] -> p_queues[i]) of flow p_flow_slug may be
-- used by it:
--   * no other flow routes a step to the name, and no other flow has it as its default queue;
--   * when p_owned_by_flow is false (the flow does not exist yet, or is being recompiled), PGMQ has no queue of
--     that name in any letter case, unless the flow itself currently routes a step to it (recompilation);
--   * when p_owned_by_flow is true (verifying an existing definition), an existing PGMQ queue must be spelled
--     exactly like the name and be routed to exactly this flow and step.
-- Reads only; runs before any mutation.
create function pgflow._assert_step_queues_private(p_flow_slug text, p_step_slugs text[], p_queues text[], p_owned_by_flow boolean)
returns void
language plpgsql
stable
set search_path = ''
as $$
declare
  v_hint text := 'Generated per-step queues are private to one concrete flow and step: drop the queue if it is a leftover nothing uses, or choose another concrete flow slug.';
  v_step text;
  v_queue text;
  v_meta text;
  v_other record;
  i int;
begin
  for i in 1 .. coalesce(cardinality(p_queues), 0) loop
    v_step := p_step_slugs[i];
    v_queue := p_queues[i];

    select f.flow_slug into v_other
    from pgflow.flows f
    where lower(f.flow_slug) = v_queue and f.flow_slug <> p_flow_slug
    limit 1;
    if found then
      raise exception 'Queue "%" for step "%" of flow "%" is already used by another flow.', v_queue, v_step, p_flow_slug
        using errcode = 'PF013',
              detail = format('It is the default queue of flow "%s".', v_other.flow_slug),
              hint = v_hint;
    end if;

    select s.flow_slug, s.step_slug into v_other
    from pgflow.steps s
    where s.queue_name = v_queue and s.flow_slug <> p_flow_slug
    limit 1;
    if found then
      raise exception 'Queue "%" for step "%" of flow "%" is already used by another flow.', v_queue, v_step, p_flow_slug
        using errcode = 'PF013',
              detail = format('It is the queue of step "%s" in flow "%s".', v_other.step_slug, v_other.flow_slug),
              hint = v_hint;
    end if;

    v_meta := pgflow._queue_meta_name(v_queue);
    if v_meta is null then
      continue;
    end if;

    if p_owned_by_flow then
      if v_meta <> v_queue then
        raise exception 'Queue "%" for step "%" of flow "%" collides with the PGMQ queue "%".', v_queue, v_step, p_flow_slug, v_meta
          using errcode = 'PF013',
                detail = 'The names differ only in letter case, and PGMQ queue tables are case-insensitive.',
                hint = v_hint;
      end if;
      if exists (select 1 from pgflow.steps s
                 where s.flow_slug = p_flow_slug and s.queue_name = v_queue and s.step_slug <> v_step) then
        raise exception 'Queue "%" for step "%" of flow "%" is routed to another step of the flow.', v_queue, v_step, p_flow_slug
          using errcode = 'PF013',
                hint = v_hint;
      end if;
    elsif not exists (select 1 from pgflow.steps s where s.flow_slug = p_flow_slug and s.queue_name = v_queue)
          and not exists (select 1 from pgflow.flows f where f.flow_slug = p_flow_slug
                          and f.queue_mode = 'flow' and lower(f.flow_slug) = v_queue) then
      if v_meta <> v_queue then
        raise exception 'Queue "%" for step "%" of flow "%" collides with the PGMQ queue "%".', v_queue, v_step, p_flow_slug, v_meta
          using errcode = 'PF013',
                detail = 'The names differ only in letter case, and PGMQ queue tables are case-insensitive.',
                hint = v_hint;
      end if;
      raise exception 'Queue "%" for step "%" of flow "%" already exists in PGMQ.', v_queue, v_step, p_flow_slug
        using errcode = 'PF013',
              detail = 'pgflow creates and owns every generated queue; an existing queue (created by an application, or left over) may hold foreign messages.',
              hint = v_hint;
    end if;
  end loop;
end;
$$;

-- The default queue of a plain flow must not be a queue another flow routes a step to (a per-step queue
-- "<flow>__<step>" and a plain flow named "<flow>__<step>" would otherwise share one queue).
create function pgflow._assert_flow_queue_private(p_flow_slug text)
returns void
language plpgsql
stable
set search_path = ''
as $$
declare
  v_other record;
begin
  select s.flow_slug, s.step_slug into v_other
  from pgflow.steps s
  where s.queue_name = lower(p_flow_slug) and lower(s.flow_slug) <> lower(p_flow_slug)
  limit 1;
  if found then
    raise exception 'Queue "%" of flow "%" is already used by another flow.', lower(p_flow_slug), p_flow_slug
      using errcode = 'PF013',
            detail = format('It is the queue of step "%s" in flow "%s".', v_other.step_slug, v_other.flow_slug),
            hint = 'Choose another concrete flow slug.';
  end if;
end;
$$;

-- Serialises every claim on the given queue names: transaction-scoped advisory locks (key space 2), taken in
-- sorted order. Two compilations that would create, adopt or route to the same queue name therefore run one
-- after the other, whatever their flow slugs, and the second one sees what the first one persisted.
create function pgflow._lock_queue_names(p_names text[])
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_name text;
begin
  for v_name in select distinct lower(n) from unnest(p_names) as n where n is not null order by 1 loop
    perform pg_advisory_xact_lock(2, hashtext(v_name));
  end loop;
end;
$$;

-- The name of queue `p_queue`'s statements function (at most 11 + 47 characters, within the 63 allowed).
-- Immutable all through (quote_ident, not the stable format()), so PostgreSQL inlines it into its callers.
create function pgflow._queue_ops_name(p_queue text)
returns text
language sql
immutable
as $$
  select 'pgflow.' || quote_ident('_queue_ops_' || lower(p_queue))
$$;

-- Creates queue `p_queue`'s statements function unless it exists. Operations (ids are message ids):
--   lock              lock p_ids' live messages, in id order; returns those locked
--   lock_skip_locked  the same, skipping messages another transaction holds
--   lock_visible      lock up to p_n visible messages, oldest first, skipping held ones (as pgmq.read);
--                     returns them, or NULL when there is none
--   visibility        set each of p_ids' vt to p_vts' matching value, add p_n to read_ct and, when p_n is 1,
--                     stamp last_read_at; returns the ids updated
--   archive           move p_ids' messages to the archive table (as pgmq.archive); returns the ids moved
--   send              insert p_msgs with vt p_vts[1] (as pgmq.send_batch); returns their ids, in p_msgs order
create function pgflow._create_queue_ops(p_queue text)
returns void
language plpgsql
set search_path = ''
as $$
begin
  if to_regproc(pgflow._queue_ops_name(p_queue)) is not null then
    return;
  end if;
  execute format($f$
    create function %1$s(p_op text, p_ids bigint[], p_vts timestamptz[], p_n int, p_msgs jsonb[])
    returns bigint[]
    language plpgsql
    volatile
    as $body$
    declare
      v_ids bigint[];
    begin
      case p_op
      when 'lock' then
        select coalesce(array_agg(x.msg_id order by x.msg_id), '{}') into v_ids
        from (select q.msg_id from pgmq.%2$I q where q.msg_id = any (p_ids) order by q.msg_id for update) x;
      when 'lock_skip_locked' then
        select coalesce(array_agg(x.msg_id order by x.msg_id), '{}') into v_ids
        from (select q.msg_id from pgmq.%2$I q where q.msg_id = any (p_ids)
              order by q.msg_id for update skip locked) x;
      when 'lock_visible' then
        select array_agg(x.msg_id order by x.msg_id) into v_ids
        from (select q.msg_id from pgmq.%2$I q where q.vt <= clock_timestamp()
              order by q.msg_id limit p_n for update skip locked) x;
      when 'visibility' then
        with updated as (
          update pgmq.%2$I q
          set vt = v.vt, read_ct = q.read_ct + p_n,
              last_read_at = case when p_n = 1 then clock_timestamp() else q.last_read_at end
          from unnest(p_ids, p_vts) as v(id, vt)
          where q.msg_id = v.id
          returning q.msg_id
        )
        select coalesce(array_agg(u.msg_id), '{}') into v_ids from updated u;
      when 'archive' then
        with archived as (
          delete from pgmq.%2$I q where q.msg_id = any (p_ids)
          returning q.msg_id, q.vt, q.read_ct, q.enqueued_at, q.last_read_at, q.message, q.headers
        ),
        moved as (
          insert into pgmq.%3$I (msg_id, vt, read_ct, enqueued_at, last_read_at, message, headers)
          select a.msg_id, a.vt, a.read_ct, a.enqueued_at, a.last_read_at, a.message, a.headers from archived a
          returning msg_id
        )
        select coalesce(array_agg(m.msg_id), '{}') into v_ids from moved m;
      when 'send' then
        with sent as (
          insert into pgmq.%2$I (vt, message)
          select p_vts[1], m.message from unnest(p_msgs) with ordinality as m(message, ord) order by m.ord
          returning msg_id
        )
        select array_agg(s.msg_id order by s.msg_id) into v_ids from sent s;
      else
        raise exception 'pgflow._queue_op(): unknown operation %%', p_op;
      end case;
      return v_ids;
    end;
    $body$
  $f$, pgflow._queue_ops_name(p_queue), pgmq.format_table_name(p_queue, 'q'),
     pgmq.format_table_name(p_queue, 'a'));
  -- Schema-level default privileges cannot take EXECUTE away from PUBLIC, so it is revoked here (0014).
  execute format('revoke execute on function %s(text, bigint[], timestamptz[], int, jsonb[]) from public',
                 pgflow._queue_ops_name(p_queue));
exception
  -- Another transaction created it first.
  when duplicate_function or unique_violation then
    null;
end;
$$;

-- Drops queue `p_queue`'s statements function, if any (its queue is being dropped).
create function pgflow._drop_queue_ops(p_queue text)
returns void
language plpgsql
set search_path = ''
as $$
begin
  execute format('drop function if exists %s(text, bigint[], timestamptz[], int, jsonb[])',
                 pgflow._queue_ops_name(p_queue));
end;
$$;

-- Runs operation `p_op` (see _create_queue_ops) on queue `p_queue`'s messages.
create function pgflow._queue_op(p_queue text, p_op text, p_ids bigint[] default NULL::bigint[], p_vts timestamp with time zone[] default NULL::timestamp with time zone[], p_n integer default NULL::integer, p_msgs jsonb[] default NULL::jsonb[])
returns bigint[]
language plpgsql
set search_path = ''
as $$
declare
  v_fn text := pgflow._queue_ops_name(p_queue);
  v_ids bigint[];
begin
  if to_regproc(v_fn) is null then
    perform pgflow._create_queue_ops(p_queue);
  end if;
  execute format('select %s($1, $2, $3, $4, $5)', v_fn) into v_ids using p_op, p_ids, p_vts, p_n, p_msgs;
  return v_ids;
end;
$$;

-- Creates the PGMQ queue `p_queue` unless it exists, with its signal row and its statements function. A new
-- queue's message ids continue after every id pgflow has recorded for that queue name: a queue that was
-- dropped and created again would otherwise restart at 1 and collide with historical tasks on unique
-- (queue_name, message_id).
create function pgflow._ensure_queue(p_queue text)
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_max bigint;
  v_seq text;
begin
  insert into pgflow.queue_signals (queue_name) values (lower(p_queue)) on conflict do nothing;
  if pgflow._queue_meta_name(p_queue) is not null then
    return;
  end if;
  perform pgmq.create(p_queue);
  perform pgflow._create_queue_ops(p_queue);
  select max(t.message_id) into v_max from pgflow.step_tasks t where t.queue_name = lower(p_queue);
  if v_max is null then
    return;
  end if;
  v_seq := pg_get_serial_sequence(format('pgmq.%I', pgmq.format_table_name(p_queue, 'q')), 'msg_id');
  if v_seq is not null then
    perform setval(v_seq, greatest(v_max, coalesce(pg_sequence_last_value(v_seq::regclass), 0)));
  end if;
end;
$$;

-- ==== schema/05_definitions.sql ====
-- Flow definitions and compilation.
--
-- Owns: creating flows and steps (upstream's create_flow and add_step), the flow shape as JSON and its
-- comparison, compilation of a shape with its routes (ensure_flow_compiled: create, verify, or recompile when
-- data loss is allowed), and deleting a flow with all of its data.

-- Creates the flow (idempotent: an existing flow is returned unchanged) and its PGMQ queue.
-- NULL options mean the defaults: max_attempts 3, base_delay 5, timeout 60.
create function pgflow.create_flow(flow_slug text, max_attempts integer default NULL::integer, base_delay integer default NULL::integer, timeout integer default NULL::integer)
returns pgflow.flows
language plpgsql
set search_path = ''
as $$
declare
  v_flow pgflow.flows;
  v_other text;
begin
  select f.* into v_flow from pgflow.flows f where f.flow_slug = create_flow.flow_slug;
  if found then
    return v_flow;
  end if;

  -- Invalid slugs fail on the flows check constraint `slug_is_valid`, as upstream.
  if pgflow.is_valid_slug(create_flow.flow_slug) then
    select f.flow_slug into v_other from pgflow.flows f where lower(f.flow_slug) = lower(create_flow.flow_slug);
    if found then
      raise exception 'flow slug "%" differs only in case from existing flow "%"', create_flow.flow_slug, v_other
        using errcode = 'unique_violation',
              detail = format('Both flows would use the PGMQ queue "%s" (queue names are case-insensitive).',
                              lower(create_flow.flow_slug)),
              hint = 'Choose a flow slug that differs by more than letter case.';
    end if;

    if length(create_flow.flow_slug) > 47 then
      raise exception 'flow "%" cannot be created: queue name is too long, maximum length is 47 characters (the slug has %)',
          create_flow.flow_slug, length(create_flow.flow_slug)
        using errcode = 'invalid_parameter_value',
              detail = 'A flow''s tasks go to a PGMQ queue named after the flow slug, and PGMQ limits queue names to 47 characters.',
              hint = 'Shorten the flow slug to 47 characters or fewer.';
    end if;
  end if;

  insert into pgflow.flows (flow_slug, opt_max_attempts, opt_base_delay, opt_timeout)
  values (create_flow.flow_slug, coalesce(max_attempts, 3), coalesce(base_delay, 5), coalesce(timeout, 60))
  on conflict on constraint flows_pkey do nothing
  returning * into v_flow;

  if v_flow.flow_slug is null then
    -- A concurrent creator won.
    select f.* into v_flow from pgflow.flows f where f.flow_slug = create_flow.flow_slug;
    return v_flow;
  end if;

  perform pgflow._lock_queue_names(array[create_flow.flow_slug]);
  perform pgflow._ensure_queue(create_flow.flow_slug);

  return v_flow;
end;
$$;

-- Adds a step (idempotent by (flow_slug, step_slug): an existing step is returned unchanged).
create function pgflow.add_step(flow_slug text, step_slug text, deps_slugs text[] default '{}'::text[], max_attempts integer default NULL::integer, base_delay integer default NULL::integer, timeout integer default NULL::integer, start_delay integer default NULL::integer, step_type text default 'single'::text, required_input_pattern jsonb default NULL::jsonb, forbidden_input_pattern jsonb default NULL::jsonb, when_unmet text default 'skip'::text, when_exhausted text default 'fail'::text)
returns pgflow.steps
language plpgsql
set search_path = ''
as $$
declare
  v_step pgflow.steps;
  v_deps_count int := coalesce(cardinality(deps_slugs), 0);
  v_dup text;
  v_stored text[];
begin
  -- A dependency listed twice would be counted twice (deps_count) but stored once, so the step would wait
  -- for a completion that never comes.
  select d into v_dup from unnest(deps_slugs) as d group by d having count(*) > 1 order by d limit 1;
  if found then
    raise exception 'Step "%" of flow "%" lists dependency "%" more than once', add_step.step_slug,
        add_step.flow_slug, v_dup
      using errcode = 'invalid_parameter_value',
            detail = format('dependencies: %s', array_to_string(deps_slugs, ', ')),
            hint = 'List each dependency once.';
  end if;

  if coalesce(add_step.step_type, 'single') = 'map' and v_deps_count > 1 then
    raise exception 'Map step "%" can have at most one dependency, but % were provided: %',
      add_step.step_slug, v_deps_count, array_to_string(deps_slugs, ', ');
  end if;

  insert into pgflow.steps (
    flow_slug, step_slug, step_type, step_index, deps_count,
    opt_max_attempts, opt_base_delay, opt_timeout, opt_start_delay,
    required_input_pattern, forbidden_input_pattern, when_unmet, when_exhausted, queue_name
  )
  select
    add_step.flow_slug, add_step.step_slug, coalesce(add_step.step_type, 'single'),
    coalesce((select max(s.step_index) + 1 from pgflow.steps s where s.flow_slug = add_step.flow_slug), 0),
    v_deps_count,
    max_attempts, base_delay, timeout, start_delay,
    add_step.required_input_pattern, add_step.forbidden_input_pattern,
    add_step.when_unmet, add_step.when_exhausted,
    lower(add_step.flow_slug)
  on conflict on constraint steps_pkey do nothing
  returning * into v_step;

  if v_step.step_slug is null then
    select s.* into v_step from pgflow.steps s
    where s.flow_slug = add_step.flow_slug and s.step_slug = add_step.step_slug;
    -- An existing step is returned unchanged; adding it again with other dependencies would store edges its
    -- deps_count does not count (a run could then wait forever, or fail a completion), so it is refused.
    select coalesce(array_agg(d.dep_slug order by d.dep_slug collate "C"), '{}') into v_stored
    from pgflow.deps d where d.flow_slug = add_step.flow_slug and d.step_slug = add_step.step_slug;
    if v_stored is distinct from coalesce(
         (select array_agg(x order by x collate "C") from unnest(deps_slugs) as x), '{}') then
      raise exception 'Step "%" of flow "%" already exists with other dependencies', add_step.step_slug,
          add_step.flow_slug
        using errcode = 'invalid_parameter_value',
              detail = format('stored: [%s]; given: [%s]', array_to_string(v_stored, ', '),
                              array_to_string(deps_slugs, ', ')),
              hint = 'A step''s dependencies cannot change: deploy the changed flow under a new flow slug.';
    end if;
    return v_step;
  end if;

  insert into pgflow.deps (flow_slug, dep_slug, step_slug)
  select add_step.flow_slug, d.dep_slug, add_step.step_slug
  from unnest(coalesce(deps_slugs, '{}')) as d(dep_slug);

  return v_step;
end;
$$;

-- The structural shape of a stored flow (options are runtime-tunable and not part of it). Dependencies are
-- sorted in byte order (collate "C"), as the Rust macro and JavaScript sort them, whatever the database's
-- default collation.
create function pgflow._get_flow_shape(p_flow_slug text)
returns jsonb
language sql
stable
set search_path = ''
as $$
  select jsonb_build_object('steps', coalesce(jsonb_agg(
    jsonb_build_object(
      'slug', s.step_slug,
      'stepType', s.step_type,
      'dependencies', coalesce(
        (select jsonb_agg(d.dep_slug order by d.dep_slug collate "C") from pgflow.deps d
         where d.flow_slug = s.flow_slug and d.step_slug = s.step_slug),
        '[]'::jsonb),
      'whenUnmet', s.when_unmet,
      'whenExhausted', s.when_exhausted,
      'requiredInputPattern', case when s.required_input_pattern is null
        then '{"defined": false}'::jsonb
        else jsonb_build_object('defined', true, 'value', s.required_input_pattern) end,
      'forbiddenInputPattern', case when s.forbidden_input_pattern is null
        then '{"defined": false}'::jsonb
        else jsonb_build_object('defined', true, 'value', s.forbidden_input_pattern) end
    ) order by s.step_index), '[]'::jsonb))
  from pgflow.steps s
  where s.flow_slug = p_flow_slug;
$$;

-- Human-readable differences between two shapes ("first" = p_local, "second" = p_db); empty when equal.
create function pgflow._compare_flow_shapes(p_local jsonb, p_db jsonb)
returns text[]
language plpgsql
stable
set search_path = ''
as $$
declare
  v_diffs text[] := '{}';
  v_local jsonb := coalesce(p_local -> 'steps', '[]');
  v_db jsonb := coalesce(p_db -> 'steps', '[]');
  v_n1 int := jsonb_array_length(v_local);
  v_n2 int := jsonb_array_length(v_db);
  v_a jsonb;
  v_b jsonb;
  v_prefix text;
  v_deps_a text;
  v_deps_b text;
  v_key text;
  i int;
begin
  if v_n1 <> v_n2 then
    v_diffs := v_diffs || format('Step count differs: %s vs %s', v_n1, v_n2);
  end if;

  for i in 0 .. greatest(v_n1, v_n2) - 1 loop
    v_a := v_local -> i;
    v_b := v_db -> i;
    v_prefix := format('Step at index %s: ', i);

    if v_a is null then
      v_diffs := v_diffs || (v_prefix || format('missing in first shape (second has ''%s'')', v_b ->> 'slug'));
      continue;
    elsif v_b is null then
      v_diffs := v_diffs || (v_prefix || format('missing in second shape (first has ''%s'')', v_a ->> 'slug'));
      continue;
    end if;

    -- Plain comparisons: a key missing on one side yields NULL and therefore no difference.
    if (v_a ->> 'slug') <> (v_b ->> 'slug') then
      v_diffs := v_diffs || (v_prefix || format('slug differs ''%s'' vs ''%s''', v_a ->> 'slug', v_b ->> 'slug'));
    end if;
    if (v_a ->> 'stepType') <> (v_b ->> 'stepType') then
      v_diffs := v_diffs || (v_prefix || format('type differs ''%s'' vs ''%s''', v_a ->> 'stepType', v_b ->> 'stepType'));
    end if;

    select coalesce(string_agg(d, ', ' order by d collate "C"), '') into v_deps_a
    from jsonb_array_elements_text(coalesce(v_a -> 'dependencies', '[]')) as d;
    select coalesce(string_agg(d, ', ' order by d collate "C"), '') into v_deps_b
    from jsonb_array_elements_text(coalesce(v_b -> 'dependencies', '[]')) as d;
    if v_deps_a <> v_deps_b then
      v_diffs := v_diffs || (v_prefix || format('dependencies differ [%s] vs [%s]', v_deps_a, v_deps_b));
    end if;

    if (v_a ->> 'whenUnmet') <> (v_b ->> 'whenUnmet') then
      v_diffs := v_diffs || (v_prefix || format('whenUnmet differs ''%s'' vs ''%s''', v_a ->> 'whenUnmet', v_b ->> 'whenUnmet'));
    end if;
    if (v_a ->> 'whenExhausted') <> (v_b ->> 'whenExhausted') then
      v_diffs := v_diffs || (v_prefix || format('whenExhausted differs ''%s'' vs ''%s''', v_a ->> 'whenExhausted', v_b ->> 'whenExhausted'));
    end if;

    foreach v_key in array array['requiredInputPattern', 'forbiddenInputPattern'] loop
      if (v_a -> v_key) is distinct from (v_b -> v_key) then
        v_diffs := v_diffs || (v_prefix || format('%s differs ''%s'' vs ''%s''', v_key,
          coalesce((v_a -> v_key)::text, ''), coalesce((v_b -> v_key)::text, '')));
      end if;
    end loop;
  end loop;

  return v_diffs;
end;
$$;

-- Differences between the persisted queue mode and route map of a flow and the requested ones; empty when
-- they match. The route map is compared step by step in step order, even when shape and mode match (it
-- catches resolver changes, migration defects and manual edits of steps.queue_name).
create function pgflow._compare_flow_routes(p_flow_slug text, p_queue_mode text, p_step_slugs text[], p_queues text[])
returns text[]
language plpgsql
stable
set search_path = ''
as $$
declare
  v_diffs text[] := '{}';
  v_mode text;
  v_steps text[];
  v_queues text[];
  i int;
begin
  select f.queue_mode into v_mode from pgflow.flows f where f.flow_slug = p_flow_slug;
  if v_mode is distinct from p_queue_mode then
    v_diffs := v_diffs || format('Queue mode differs: persisted ''%s'', requested ''%s''', v_mode, p_queue_mode);
  end if;

  select coalesce(array_agg(s.step_slug order by s.step_index), '{}'),
         coalesce(array_agg(s.queue_name order by s.step_index), '{}')
  into v_steps, v_queues
  from pgflow.steps s
  where s.flow_slug = p_flow_slug;

  for i in 1 .. greatest(cardinality(v_steps), coalesce(cardinality(p_step_slugs), 0)) loop
    if v_steps[i] is distinct from p_step_slugs[i] or v_queues[i] is distinct from p_queues[i] then
      v_diffs := v_diffs || format('Route at index %s differs: persisted %s -> ''%s'', requested %s -> ''%s''',
        i - 1, coalesce(quote_literal(v_steps[i]), 'none'), coalesce(v_queues[i], ''),
        coalesce(quote_literal(p_step_slugs[i]), 'none'), coalesce(p_queues[i], ''));
    end if;
  end loop;

  return v_diffs;
end;
$$;

-- Adds the steps of a shape JSON to an existing flow (steps in array order, so array index = step_index).
create function pgflow._add_steps_from_shape(p_flow_slug text, p_shape jsonb)
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_step jsonb;
begin
  for v_step in select e from jsonb_array_elements(coalesce(p_shape -> 'steps', '[]')) as e loop
    perform pgflow.add_step(
      flow_slug => p_flow_slug,
      step_slug => v_step ->> 'slug',
      deps_slugs => coalesce(
        (select array_agg(d order by o) from jsonb_array_elements_text(v_step -> 'dependencies')
           with ordinality as x(d, o)),
        '{}'),
      max_attempts => (v_step #>> '{options,maxAttempts}')::int,
      base_delay => (v_step #>> '{options,baseDelay}')::int,
      timeout => (v_step #>> '{options,timeout}')::int,
      start_delay => (v_step #>> '{options,startDelay}')::int,
      step_type => coalesce(v_step ->> 'stepType', 'single'),
      required_input_pattern => case when (v_step #>> '{requiredInputPattern,defined}')::boolean
                                     then v_step #> '{requiredInputPattern,value}' end,
      forbidden_input_pattern => case when (v_step #>> '{forbiddenInputPattern,defined}')::boolean
                                      then v_step #> '{forbiddenInputPattern,value}' end,
      when_unmet => coalesce(v_step ->> 'whenUnmet', 'skip'),
      when_exhausted => coalesce(v_step ->> 'whenExhausted', 'fail')
    );
  end loop;
end;
$$;

-- Creates a flow and its steps from the shape JSON that workers send (steps in array order).
create function pgflow._create_flow_from_shape(p_flow_slug text, p_shape jsonb)
returns void
language plpgsql
set search_path = ''
as $$
begin
  perform pgflow.create_flow(
    flow_slug => p_flow_slug,
    max_attempts => (p_shape #>> '{options,maxAttempts}')::int,
    base_delay => (p_shape #>> '{options,baseDelay}')::int,
    timeout => (p_shape #>> '{options,timeout}')::int
  );
  perform pgflow._add_steps_from_shape(p_flow_slug, p_shape);
end;
$$;

-- Creates a flow (with the given queue mode) and its steps from a shape, routing step i to p_queues[i].
-- Flow mode: upstream's path (create_flow creates the default queue). Step and named mode: no default queue;
-- the step queues are created (named ones are registered as shared). Callers have checked every name first.
create function pgflow._create_flow_with_routes(p_flow_slug text, p_shape jsonb, p_queue_mode text, p_step_slugs text[], p_queues text[])
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_other text;
  v_queue text;
begin
  if p_queue_mode = 'flow' then
    perform pgflow._create_flow_from_shape(p_flow_slug, p_shape);
    return;
  end if;

  select f.flow_slug into v_other from pgflow.flows f where lower(f.flow_slug) = lower(p_flow_slug);
  if found then
    raise exception 'flow slug "%" differs only in case from existing flow "%"', p_flow_slug, v_other
      using errcode = 'unique_violation',
            hint = 'Choose a flow slug that differs by more than letter case.';
  end if;

  insert into pgflow.flows (flow_slug, opt_max_attempts, opt_base_delay, opt_timeout, queue_mode)
  values (p_flow_slug,
          coalesce((p_shape #>> '{options,maxAttempts}')::int, 3),
          coalesce((p_shape #>> '{options,baseDelay}')::int, 5),
          coalesce((p_shape #>> '{options,timeout}')::int, 60),
          p_queue_mode);

  perform pgflow._add_steps_from_shape(p_flow_slug, p_shape);

  update pgflow.steps s
  set queue_name = r.queue_name
  from unnest(p_step_slugs, p_queues) as r(step_slug, queue_name)
  where s.flow_slug = p_flow_slug and s.step_slug = r.step_slug;

  if p_queue_mode = 'step' then
    foreach v_queue in array p_queues loop
      perform pgflow._ensure_queue(v_queue);
    end loop;
  end if;
end;
$$;

-- The only deployment path: workers call this at startup with their flow's complete ordered shape, its queue
-- mode and route map, and (optionally) the alias the version should serve.
--
--   flow_slug        concrete flow slug (one immutable version)
--   shape            the flow shape JSON (steps in order)
--   allow_data_loss  permit destructive recompilation outside a local database (default false)
--   queue_mode       'flow' (default), 'step' (private generated queues) or 'named' (the caller's queues)
--   routes           'step': NULL or the caller's route map, which must equal what SQL resolves (else PF002);
--                    'named': required, [{"step_slug": "...", "queue_name": "..."}, ...] routing every step
--                    exactly once (else PF015), each queue a valid name (PF014);
--                    'flow': NULL or the default queue for every step
--   alias            NULL (default: no alias is touched) or the stable name to point at this version once its
--                    complete shape and routing are persisted (PF018 when it is another flow's concrete slug)
--   adopt_queues     'named' only: adopt named queues that exist in PGMQ although pgflow did not create them
--                    (default false: PF017)
--
-- Before any mutation every name, ownership and alias check runs. Then, under the concrete-slug advisory lock:
--   flow missing                              -> create flow, steps and queues        -> {"status": "compiled"}
--   same shape, mode and route map            -> nothing (recreates a missing queue)  -> {"status": "verified"}
--   different, and local or allow_data_loss   -> delete flow, data and own queues,
--                                                recreate in the requested mode       -> {"status": "recompiled"}
--   shape differs (production)                -> nothing                              -> {"status": "mismatch"}
--   only mode or route map differs (prod.)    -> raises PF001 (routing error, MESSAGE / DETAIL / HINT)
-- When an alias is given and the version is compiled, verified or recompiled, the alias is activated in the
-- same transaction (pgflow._activate_alias: idempotent, records the previous target, emits alias:activated);
-- the result then also has "alias": {"alias", "flow_slug", "previous_flow_slug", "activated_at",
-- "activated"}. A mismatch activates nothing. Rollback is activating an older version again: its shape and
-- routing are untouched.
create function pgflow.ensure_flow_compiled(flow_slug text, shape jsonb, allow_data_loss boolean default false, queue_mode text default 'flow'::text, routes jsonb default NULL::jsonb, alias text default NULL::text, adopt_queues boolean default false)
returns jsonb
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_slug text := ensure_flow_compiled.flow_slug;
  v_mode text := coalesce(ensure_flow_compiled.queue_mode, 'flow');
  v_steps text[];
  v_queues text[];
  v_req_steps text[];
  v_req_queues text[];
  v_adopt text[] := '{}';
  v_differences text[];
  v_routing text[];
  v_status text;
  v_queue text;
  v_bad text;
  i int;
begin
  perform pg_advisory_xact_lock(1, hashtext(lower(v_slug)));

  if v_mode not in ('flow', 'step', 'named') then
    raise exception 'ensure_flow_compiled(): queue_mode must be ''flow'', ''step'' or ''named'', got %',
        quote_literal(v_mode)
      using errcode = 'invalid_parameter_value';
  end if;
  if routes is not null and jsonb_typeof(routes) <> 'array' then
    raise exception 'ensure_flow_compiled(): routes must be a JSON array of {"step_slug", "queue_name"} objects'
      using errcode = 'invalid_parameter_value';
  end if;

  select coalesce(array_agg(e ->> 'slug' order by o), '{}') into v_steps
  from jsonb_array_elements(coalesce(shape -> 'steps', '[]')) with ordinality as x(e, o);
  if routes is not null then
    select coalesce(array_agg(e ->> 'step_slug' order by o), '{}'),
           coalesce(array_agg(e ->> 'queue_name' order by o), '{}')
    into v_req_steps, v_req_queues
    from jsonb_array_elements(routes) with ordinality as x(e, o);
  end if;

  if v_mode = 'step' then
    select array_agg(r.queue_name order by r.step_index) into v_queues
    from pgflow.resolve_step_queues(v_slug, v_steps) r;
  elsif v_mode = 'named' then
    if routes is null then
      raise exception 'Flow "%" uses named queues but no route map was given.', v_slug
        using errcode = 'PF015',
              hint = 'Pass routes => [{"step_slug": "...", "queue_name": "..."}, ...] with every step exactly once.';
    end if;
    select r into v_bad from unnest(v_req_steps) as r group by r having count(*) > 1 limit 1;
    if found then
      raise exception 'The route map of flow "%" routes step "%" more than once.', v_slug, v_bad
        using errcode = 'PF015',
              hint = 'Route every step exactly once.';
    end if;
    select r into v_bad from unnest(v_req_steps) as r where r is null or r <> all (v_steps) limit 1;
    if found then
      raise exception 'The route map of flow "%" routes "%", which is not a step of the flow.', v_slug,
          coalesce(v_bad, 'NULL')
        using errcode = 'PF015',
              detail = format('The steps are: %s.', array_to_string(v_steps, ', ')),
              hint = 'Route every step exactly once, by its slug.';
    end if;
    select s into v_bad from unnest(v_steps) as s where s <> all (v_req_steps) limit 1;
    if found then
      raise exception 'The route map of flow "%" leaves step "%" without a queue.', v_slug, v_bad
        using errcode = 'PF015',
              hint = 'Route every step exactly once.';
    end if;
    -- In step order.
    select coalesce(array_agg(lower(r.queue_name) order by s.ord), '{}') into v_queues
    from unnest(v_steps) with ordinality as s(step_slug, ord)
    join unnest(v_req_steps, v_req_queues) as r(step_slug, queue_name) on r.step_slug = s.step_slug;
    for i in 1 .. cardinality(v_steps) loop
      perform pgflow._check_named_queue(v_slug, v_steps[i],
        (select r.queue_name from unnest(v_req_steps, v_req_queues) as r(step_slug, queue_name)
         where r.step_slug = v_steps[i]));
    end loop;
  else
    select coalesce(array_agg(lower(v_slug)), '{}') into v_queues from unnest(v_steps);
  end if;

  -- Every queue name this compilation may create, adopt or route to is claimed under its own lock, so two
  -- compilations of different flows that resolve to one name cannot both pass the ownership checks below.
  perform pgflow._lock_queue_names(v_queues || lower(v_slug));

  if routes is not null and v_mode <> 'named' then
    for i in 1 .. greatest(cardinality(v_req_steps), cardinality(v_steps)) loop
      if v_req_steps[i] is distinct from v_steps[i] or v_req_queues[i] is distinct from v_queues[i] then
        raise exception 'Flow "%": the requested route map differs from the one the database resolves.', v_slug
          using errcode = 'PF002',
                detail = format('Route at index %s: requested %s -> %s, resolved %s -> %s.', i - 1,
                                coalesce(quote_ident(v_req_steps[i]), 'none'), coalesce(quote_literal(v_req_queues[i]), 'none'),
                                coalesce(quote_ident(v_steps[i]), 'none'), coalesce(quote_literal(v_queues[i]), 'none')),
                hint = 'The worker''s queue-name resolver disagrees with SQL, which is authoritative: upgrade the worker and the migrations together.';
      end if;
    end loop;
  end if;

  if alias is not null then
    perform pgflow._assert_alias_allowed(alias, v_slug);
  end if;

  if not exists (select 1 from pgflow.flows f where f.flow_slug = v_slug) then
    if exists (select 1 from pgflow.flows f where lower(f.flow_slug) = lower(v_slug)) then
      raise exception 'flow slug "%" differs only in case from existing flow "%"', v_slug,
          (select f.flow_slug from pgflow.flows f where lower(f.flow_slug) = lower(v_slug) limit 1)
        using errcode = 'unique_violation',
              detail = 'PGMQ queue names are case-insensitive, so both flows would share their queues.',
              hint = 'Choose a flow slug that differs by more than letter case.';
    end if;
    perform pgflow._assert_slug_not_alias(v_slug);
    if v_mode = 'step' then
      perform pgflow._assert_not_shared(v_slug, v_queues);
      perform pgflow._assert_step_queues_private(v_slug, v_steps, v_queues, false);
    elsif v_mode = 'named' then
      v_adopt := pgflow._check_shared_queues(v_slug, v_steps, v_queues, adopt_queues);
    else
      perform pgflow._assert_not_shared(v_slug, array[lower(v_slug)]);
      perform pgflow._assert_flow_queue_private(v_slug);
      -- The flow's queue is a private pgflow resource: never adopt a queue that exists without the flow.
      if pgflow._queue_meta_name(v_slug) is not null
         and not exists (select 1 from pgflow.flows f where lower(f.flow_slug) = lower(v_slug)) then
        raise exception 'ensure_flow_compiled(): PGMQ queue "%" already exists but flow "%" does not',
            pgflow._queue_meta_name(v_slug), v_slug
          using errcode = 'duplicate_object',
                detail = 'pgflow creates and owns the queue of each flow; an existing queue may hold foreign messages.',
                hint = 'Drop the queue if it is a leftover (select pgmq.drop_queue(...)), or choose another flow slug.';
      end if;
    end if;
    perform pgflow._create_flow_with_routes(v_slug, shape, v_mode, v_steps, v_queues);
    if v_mode = 'named' then
      perform pgflow._provision_shared_queues(v_queues, v_adopt);
    end if;
    v_status := 'compiled';
    v_differences := '{}';
  else
    v_differences := pgflow._compare_flow_shapes(shape, pgflow._get_flow_shape(v_slug));
    v_routing := pgflow._compare_flow_routes(v_slug, v_mode, v_steps, v_queues);

    if cardinality(v_differences) = 0 and cardinality(v_routing) = 0 then
      if v_mode = 'step' then
        perform pgflow._assert_step_queues_private(v_slug, v_steps, v_queues, true);
        foreach v_queue in array v_queues loop
          perform pgflow._ensure_queue(v_queue);
        end loop;
      elsif v_mode = 'named' then
        v_adopt := pgflow._check_shared_queues(v_slug, v_steps, v_queues, adopt_queues);
        perform pgflow._provision_shared_queues(v_queues, v_adopt);
      end if;
      v_status := 'verified';
    elsif coalesce(allow_data_loss, false) or pgflow.is_local() then
      -- Every check before the first mutation.
      if v_mode = 'step' then
        perform pgflow._assert_not_shared(v_slug, v_queues);
        perform pgflow._assert_step_queues_private(v_slug, v_steps, v_queues, false);
      elsif v_mode = 'named' then
        v_adopt := pgflow._check_shared_queues(v_slug, v_steps, v_queues, adopt_queues);
      else
        perform pgflow._assert_not_shared(v_slug, array[lower(v_slug)]);
        perform pgflow._assert_flow_queue_private(v_slug);
      end if;
      perform pgflow.delete_flow_and_data(v_slug);
      perform pgflow._create_flow_with_routes(v_slug, shape, v_mode, v_steps, v_queues);
      if v_mode = 'named' then
        perform pgflow._provision_shared_queues(v_queues, v_adopt);
      end if;
      v_status := 'recompiled';
      v_differences := v_differences || case when cardinality(v_differences) = 0 then v_routing
                                             else array(select d from unnest(v_routing) d
                                                        where d like 'Queue mode differs%') end;
    elsif cardinality(v_differences) > 0 then
      return jsonb_build_object('status', 'mismatch',
        'differences', to_jsonb(v_differences || array(select d from unnest(v_routing) d
                                                       where d like 'Queue mode differs%')));
    else
      raise exception 'Flow "%" is deployed with a different queue routing.', v_slug
        using errcode = 'PF001',
              detail = array_to_string(v_routing, '; ') || '.',
              hint = 'A concrete flow''s queue mode and route map cannot change in production: deploy the change under a new concrete flow slug (a new version, such as "...V2"). A local database (pgflow.local) recompiles destructively.';
    end if;
  end if;

  if alias is null then
    return jsonb_build_object('status', v_status, 'differences', to_jsonb(v_differences));
  end if;
  return jsonb_build_object('status', v_status, 'differences', to_jsonb(v_differences),
                            'alias', pgflow._activate_alias(alias, v_slug));
end;
$$;

-- Destroys a flow with all its runs, tasks, aliases and its own queues (and their statements functions).
-- Local recompilation only; never used in production. Own queues: the queues its steps route to, the queues
-- recorded on its tasks, and (flow mode only) its default queue. A shared queue, or a queue another flow
-- routes a step to, is never dropped.
create function pgflow.delete_flow_and_data(p_flow_slug text)
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_queue text;
  v_meta_name text;
begin
  for v_queue in
    select distinct q from (
      select s.queue_name as q from pgflow.steps s where s.flow_slug = p_flow_slug
      union all
      select t.queue_name from pgflow.step_tasks t join pgflow.runs r on r.run_id = t.run_id
      where r.flow_slug = p_flow_slug
      union all
      select lower(f.flow_slug) from pgflow.flows f where f.flow_slug = p_flow_slug and f.queue_mode = 'flow'
    ) x
    where not exists (select 1 from pgflow.steps o where o.queue_name = x.q and o.flow_slug <> p_flow_slug)
      and not exists (select 1 from pgflow.shared_queues sq where sq.queue_name = x.q)
  loop
    v_meta_name := pgflow._queue_meta_name(v_queue);
    if v_meta_name is null then
      raise notice 'pgmq queue `%` does not exist', v_queue;
    else
      perform pgmq.drop_queue(v_meta_name);
      perform pgflow._drop_queue_ops(v_queue);
    end if;
  end loop;

  delete from pgflow.step_tasks t using pgflow.runs r
    where r.flow_slug = p_flow_slug and t.run_id = r.run_id;
  delete from pgflow.step_states ss using pgflow.runs r
    where r.flow_slug = p_flow_slug and ss.run_id = r.run_id;
  delete from pgflow.runs r where r.flow_slug = p_flow_slug;
  delete from pgflow.flow_aliases a where a.flow_slug = p_flow_slug;
  delete from pgflow.deps d where d.flow_slug = p_flow_slug;
  delete from pgflow.steps s where s.flow_slug = p_flow_slug;
  delete from pgflow.flows f where f.flow_slug = p_flow_slug;
end;
$$;

-- ==== schema/06_runs.sql ====
-- Runs: starting them, and advancing them as steps finish.
--
-- Owns: start_flow, start_flows and start_flow_with_states; step conditions and skip cascades; creating the
-- tasks of ready steps (one message per task on the step's queue); releasing dependents; completing runs.
-- The lock order these follow is written at the top of 07_claims.sql.

-- Whether a step's `if` / `ifNot` patterns hold. The evaluated document is the run input for root steps,
-- otherwise {dep_slug: output} over the step's completed dependencies ({} when none completed).
create function pgflow._condition_met(p_run_id uuid, p_run_input jsonb, p_flow_slug text, p_step_slug text, p_deps_count integer, p_required jsonb, p_forbidden jsonb)
returns boolean
language plpgsql
stable
set search_path = ''
as $$
declare
  v_doc jsonb;
begin
  if p_required is null and p_forbidden is null then
    return true;
  end if;

  if p_deps_count = 0 then
    v_doc := p_run_input;
  else
    select coalesce(jsonb_object_agg(d.dep_slug, ds.output), '{}'::jsonb) into v_doc
    from pgflow.deps d
    join pgflow.step_states ds on ds.run_id = p_run_id and ds.step_slug = d.dep_slug
    where d.flow_slug = p_flow_slug and d.step_slug = p_step_slug and ds.status = 'completed';
  end if;

  return (p_required is null or v_doc @> p_required)
     and (p_forbidden is null or not (v_doc @> p_forbidden));
end;
$$;

-- Whether a step that has become ready needs the cascade of _advance_run instead of a plain start: it has a
-- condition to evaluate, or no tasks (an empty map). Inlined into the statements that use it.
create function pgflow._needs_cascade(p_initial_tasks integer, p_required_input_pattern jsonb, p_forbidden_input_pattern jsonb)
returns boolean
language sql
immutable parallel safe
as $$
  select p_initial_tasks = 0 or p_required_input_pattern is not null or p_forbidden_input_pattern is not null
$$;

-- What a claimed task's handler receives, the one definition every claim path uses:
--   input       a map task: its array element (copied onto the task when the step started);
--               a single step: {dep_slug: output} over its completed dependencies ({} for a root step);
--   flow_input  the run input for a root single step, NULL otherwise.
-- Plain SQL without SET options, so the planner can inline it into the claim statements.
create function pgflow._task_inputs(p_run_id uuid, p_flow_slug text, p_step_slug text, p_step_type text, p_deps_count integer, p_element jsonb, p_run_input jsonb)
returns table(input jsonb, flow_input jsonb)
language sql
stable
as $$
  select
    case
      when p_step_type = 'map' then p_element
      else coalesce((
        select jsonb_object_agg(d.dep_slug, ds.output)
        from pgflow.deps d
        join pgflow.step_states ds on ds.run_id = p_run_id and ds.step_slug = d.dep_slug
        where d.flow_slug = p_flow_slug and d.step_slug = p_step_slug and ds.status = 'completed'),
        '{}'::jsonb)
    end,
    case when p_step_type = 'single' and p_deps_count = 0 then p_run_input end
$$;

-- Creates the tasks of steps just started (`p_run_ids[i]`, `p_step_slugs[i]`), sends their messages with one
-- batch per queue through the queue's statements, and signals those queues. Single steps get one task; map
-- steps one per element of their input (the run input for a root map, else the output of the step they
-- depend on). Each run's row is found by its key. The join of the batch to runs and steps could also be
-- planned from steps to every run of the flow (through idx_runs_flow_slug), and was, whenever runs had not been
-- analysed since it grew: the planner then assumes a few runs per flow, and a start read one index entry per
-- run the flow had ever had (3,000 in the test that found it). The lateral lookup (kept apart by offset 0)
-- leaves the planner no such choice.
create function pgflow._create_step_tasks(p_run_ids uuid[], p_step_slugs text[])
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_group record;
  v_queues text[];
begin
  for v_group in
    select s.queue_name, coalesce(s.opt_start_delay, 0) as delay,
           array_agg(t.run_id order by t.run_id, t.step_slug, t.task_index) as run_ids,
           array_agg(r.flow_slug order by t.run_id, t.step_slug, t.task_index) as flow_slugs,
           array_agg(t.step_slug order by t.run_id, t.step_slug, t.task_index) as step_slugs,
           array_agg(t.task_index order by t.run_id, t.step_slug, t.task_index) as task_indexes,
           array_agg(t.element order by t.run_id, t.step_slug, t.task_index) as elements
    from unnest(p_run_ids, p_step_slugs) as x(run_id, step_slug)
    cross join lateral (select r.flow_slug, r.input from pgflow.runs r where r.run_id = x.run_id offset 0) r
    join pgflow.steps s on s.flow_slug = r.flow_slug and s.step_slug = x.step_slug
    cross join lateral (
      select x.run_id, x.step_slug, 0 as task_index, null::jsonb as element
      where s.step_type = 'single'
      union all
      select x.run_id, x.step_slug, (e.ord - 1)::int, e.value
      from jsonb_array_elements(
             case when s.step_type <> 'map' then '[]'::jsonb
                  when s.deps_count = 0 then r.input
                  else (select ds.output from pgflow.deps d
                        join pgflow.step_states ds on ds.run_id = x.run_id and ds.step_slug = d.dep_slug
                        where d.flow_slug = r.flow_slug and d.step_slug = x.step_slug
                        limit 1)
             end) with ordinality as e(value, ord)
    ) t
    group by s.queue_name, coalesce(s.opt_start_delay, 0)
  loop
    insert into pgflow.step_tasks (flow_slug, run_id, step_slug, task_index, message_id, queue_name, element)
    select m.flow_slug, m.run_id, m.step_slug, m.task_index, sent.msg_id, v_group.queue_name, m.element
    from unnest(pgflow._queue_op(
           v_group.queue_name, 'send', null,
           array[clock_timestamp() + make_interval(secs => v_group.delay)], null,
           (select array_agg(jsonb_build_object(
                     'flow_slug', u.flow_slug,
                     'run_id', u.run_id,
                     'step_slug', u.step_slug,
                     'task_index', u.task_index) order by u.ord)
            from unnest(v_group.flow_slugs, v_group.run_ids, v_group.step_slugs, v_group.task_indexes)
                   with ordinality as u(flow_slug, run_id, step_slug, task_index, ord))))
           with ordinality as sent(msg_id, ord)
    join unnest(v_group.flow_slugs, v_group.run_ids, v_group.step_slugs, v_group.task_indexes, v_group.elements)
           with ordinality as m(flow_slug, run_id, step_slug, task_index, element, ord)
      on m.ord = sent.ord;
    v_queues := array_append(v_queues, v_group.queue_name);
  end loop;
  perform pgflow._signal_queues(v_queues);
end;
$$;

-- Starts every ready step that has tasks, in every started run of `p_run_ids`, creating their tasks through
-- _create_step_tasks (the only function that creates tasks).
create function pgflow._start_ready_steps(p_run_ids uuid[])
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_started record;
  v_runs uuid[];
  v_steps text[];
  v_events boolean := pgflow._step_events_enabled();
begin
  for v_started in
    with started as (
      update pgflow.step_states ss
      set status = 'started', started_at = now(), remaining_tasks = ss.initial_tasks
      from pgflow.runs r
      where ss.run_id = any (p_run_ids)
        and ss.status = 'created' and ss.remaining_deps = 0 and ss.initial_tasks > 0
        and r.run_id = ss.run_id and r.status = 'started'
      returning ss.run_id, ss.step_slug, ss.started_at, ss.remaining_tasks, ss.remaining_deps
    )
    select * from started order by run_id, step_slug
  loop
    v_runs := array_append(v_runs, v_started.run_id);
    v_steps := array_append(v_steps, v_started.step_slug);
    if v_events then
      perform pgflow._emit_step_started(v_started.run_id, v_started.step_slug, v_started.started_at,
                                        v_started.remaining_tasks, v_started.remaining_deps);
    end if;
  end loop;

  if v_runs is not null then
    perform pgflow._create_step_tasks(v_runs, v_steps);
  end if;
end;
$$;

-- Upstream's start_ready_steps(run_id): the same, for one run.
create function pgflow.start_ready_steps(run_id uuid)
returns void
language sql
set search_path = ''
as $$
  select pgflow._start_ready_steps(array[start_ready_steps.run_id]);
$$;

-- Releases the direct dependents of steps that just finished without output flowing on (skipped), or that
-- completed taskless: remaining_deps drops by the number of such parents, and a map dependent learns it
-- has nothing to iterate (initial_tasks 0).
create function pgflow._release_dependents(p_run_id uuid, p_flow_slug text, p_parents text[])
returns void
language sql
set search_path = ''
as $$
  update pgflow.step_states c
  set remaining_deps = c.remaining_deps - x.n,
      initial_tasks = case when x.step_type = 'map' then 0 else c.initial_tasks end
  from (
    select d.step_slug, s.step_type, count(*)::int as n
    from pgflow.deps d
    join pgflow.steps s on s.flow_slug = d.flow_slug and s.step_slug = d.step_slug
    where d.flow_slug = p_flow_slug and d.dep_slug = any (p_parents)
    group by d.step_slug, s.step_type
  ) x
  where c.run_id = p_run_id and c.step_slug = x.step_slug;
$$;

-- Skips a step and all its transitive dependents that are not terminal yet; their unfinished tasks become
-- `skipped` and their messages are archived. Returns the number of steps skipped.
create function pgflow._cascade_force_skip_steps(run_id uuid, step_slug text, skip_reason text)
returns integer
language plpgsql
set search_path = ''
as $$
declare
  v_flow_slug text;
  v_slugs text[];
  v_step record;
begin
  select r.flow_slug into v_flow_slug from pgflow.runs r where r.run_id = _cascade_force_skip_steps.run_id;
  if not found then
    raise exception 'Run not found: %', _cascade_force_skip_steps.run_id;
  end if;

  for v_step in
    with recursive affected (step_slug) as (
      select _cascade_force_skip_steps.step_slug
      union
      select d.step_slug
      from pgflow.deps d
      join affected a on d.dep_slug = a.step_slug
      where d.flow_slug = v_flow_slug
    ),
    skipped as (
      update pgflow.step_states ss
      set status = 'skipped',
          skipped_at = now(),
          remaining_tasks = null,
          skip_reason = case when ss.step_slug = _cascade_force_skip_steps.step_slug
                             then _cascade_force_skip_steps.skip_reason else 'dependency_skipped' end
      from affected a
      where ss.run_id = _cascade_force_skip_steps.run_id
        and ss.step_slug = a.step_slug
        and ss.status in ('created', 'started')
      returning ss.step_slug, ss.skip_reason, ss.skipped_at
    )
    select k.step_slug, k.skip_reason, k.skipped_at
    from skipped k
    join pgflow.steps s on s.flow_slug = v_flow_slug and s.step_slug = k.step_slug
    order by s.step_index
  loop
    v_slugs := array_append(v_slugs, v_step.step_slug);
    perform pgflow._emit('step:' || v_step.step_slug || ':skipped', _cascade_force_skip_steps.run_id,
      jsonb_build_object(
        'event_type', 'step:skipped',
        'run_id', _cascade_force_skip_steps.run_id,
        'flow_slug', v_flow_slug,
        'step_slug', v_step.step_slug,
        'status', 'skipped',
        'skip_reason', v_step.skip_reason,
        'skipped_at', v_step.skipped_at
      ));
  end loop;

  if v_slugs is null then
    return 0;
  end if;

  perform pgflow._terminate_tasks(_cascade_force_skip_steps.run_id, v_slugs, 'skipped');

  update pgflow.runs r
  set remaining_steps = r.remaining_steps - cardinality(v_slugs)
  where r.run_id = _cascade_force_skip_steps.run_id;

  return cardinality(v_slugs);
end;
$$;

-- Applies `if` / `ifNot` to every ready (created, no pending dependency) step that has a pattern.
-- Returns false when the run is (or became) failed, true when it may continue.
create function pgflow.cascade_resolve_conditions(run_id uuid)
returns boolean
language plpgsql
set search_path = ''
as $$
declare
  v_run pgflow.runs;
  v_iterations int := 0;
  v_fail record;
  v_skip record;
  v_skipped text[];
  v_cascade text;
begin
  select r.* into v_run from pgflow.runs r where r.run_id = cascade_resolve_conditions.run_id;
  if not found or v_run.status = 'completed' then
    return true;
  elsif v_run.status = 'failed' then
    return false;
  end if;

  -- Fast path: no ready step carries a condition.
  if not exists (
    select 1
    from pgflow.step_states ss
    join pgflow.steps s on s.flow_slug = ss.flow_slug and s.step_slug = ss.step_slug
    where ss.run_id = v_run.run_id and ss.status = 'created' and ss.remaining_deps = 0
      and (s.required_input_pattern is not null or s.forbidden_input_pattern is not null)
  ) then
    return true;
  end if;

  loop
    v_iterations := v_iterations + 1;
    if v_iterations > 50 then
      raise exception 'cascade_resolve_conditions exceeded safety limit of 50 iterations';
    end if;

    -- Fail mode: the first unmet step (by definition order) fails the run.
    select ss.step_slug into v_fail
    from pgflow.step_states ss
    join pgflow.steps s on s.flow_slug = ss.flow_slug and s.step_slug = ss.step_slug
    where ss.run_id = v_run.run_id and ss.status = 'created' and ss.remaining_deps = 0
      and s.when_unmet = 'fail'
      and (s.required_input_pattern is not null or s.forbidden_input_pattern is not null)
      and not pgflow._condition_met(v_run.run_id, v_run.input, s.flow_slug, s.step_slug, s.deps_count,
                                    s.required_input_pattern, s.forbidden_input_pattern)
    order by s.step_index
    limit 1;

    if found then
      update pgflow.step_states ss
      set status = 'failed', failed_at = now(), error_message = 'Condition not met'
      where ss.run_id = v_run.run_id and ss.step_slug = v_fail.step_slug
      returning ss.failed_at into v_skip;
      perform pgflow._emit('step:' || v_fail.step_slug || ':failed', v_run.run_id, jsonb_build_object(
        'event_type', 'step:failed',
        'run_id', v_run.run_id,
        'step_slug', v_fail.step_slug,
        'status', 'failed',
        'error_message', 'Condition not met',
        'failed_at', now()
      ));
      perform pgflow._fail_run(v_run.run_id, 'Condition not met');
      return false;
    end if;

    -- Plain skip: every unmet `skip` step; dependents continue without it.
    v_skipped := null;
    for v_skip in
      with unmet as (
        select s.step_slug, s.step_index
        from pgflow.step_states ss
        join pgflow.steps s on s.flow_slug = ss.flow_slug and s.step_slug = ss.step_slug
        where ss.run_id = v_run.run_id and ss.status = 'created' and ss.remaining_deps = 0
          and s.when_unmet = 'skip'
          and (s.required_input_pattern is not null or s.forbidden_input_pattern is not null)
          and not pgflow._condition_met(v_run.run_id, v_run.input, s.flow_slug, s.step_slug, s.deps_count,
                                        s.required_input_pattern, s.forbidden_input_pattern)
      ),
      skipped as (
        update pgflow.step_states ss
        set status = 'skipped', skip_reason = 'condition_unmet', skipped_at = now()
        from unmet u
        where ss.run_id = v_run.run_id and ss.step_slug = u.step_slug
        returning ss.step_slug, ss.skipped_at, u.step_index
      )
      select k.step_slug, k.skipped_at from skipped k order by k.step_index
    loop
      v_skipped := array_append(v_skipped, v_skip.step_slug);
      perform pgflow._emit('step:' || v_skip.step_slug || ':skipped', v_run.run_id, jsonb_build_object(
        'event_type', 'step:skipped',
        'run_id', v_run.run_id,
        'flow_slug', v_run.flow_slug,
        'step_slug', v_skip.step_slug,
        'status', 'skipped',
        'skip_reason', 'condition_unmet',
        'skipped_at', v_skip.skipped_at
      ));
    end loop;

    if v_skipped is not null then
      perform pgflow._release_dependents(v_run.run_id, v_run.flow_slug, v_skipped);
      update pgflow.runs r
      set remaining_steps = r.remaining_steps - cardinality(v_skipped)
      where r.run_id = v_run.run_id;
    end if;

    -- Skip-cascade: every unmet `skip-cascade` step, with all its dependents.
    for v_cascade in
      select s.step_slug
      from pgflow.step_states ss
      join pgflow.steps s on s.flow_slug = ss.flow_slug and s.step_slug = ss.step_slug
      where ss.run_id = v_run.run_id and ss.status = 'created' and ss.remaining_deps = 0
        and s.when_unmet = 'skip-cascade'
        and (s.required_input_pattern is not null or s.forbidden_input_pattern is not null)
        and not pgflow._condition_met(v_run.run_id, v_run.input, s.flow_slug, s.step_slug, s.deps_count,
                                      s.required_input_pattern, s.forbidden_input_pattern)
      order by s.step_index
    loop
      perform pgflow._cascade_force_skip_steps(v_run.run_id, v_cascade, 'condition_unmet');
    end loop;

    exit when v_skipped is null;
  end loop;

  return true;
end;
$$;

-- Completes, level by level, the ready steps that have nothing to do (initial_tasks = 0: empty root map,
-- or a map whose only dependency was empty or skipped). A step whose `if`/`ifNot` does not hold is left for
-- cascade_resolve_conditions. Returns the number of steps completed.
create function pgflow.cascade_complete_taskless_steps(run_id uuid)
returns integer
language plpgsql
set search_path = ''
as $$
declare
  v_run pgflow.runs;
  v_iterations int := 0;
  v_total int := 0;
  v_done text[];
  v_step record;
begin
  select r.* into v_run from pgflow.runs r where r.run_id = cascade_complete_taskless_steps.run_id;
  if not found or v_run.status <> 'started' then
    return 0;
  end if;

  loop
    v_iterations := v_iterations + 1;
    if v_iterations > 50 then
      raise exception 'Cascade loop exceeded safety limit of 50 iterations';
    end if;

    v_done := null;
    for v_step in
      with done as (
        update pgflow.step_states ss
        set status = 'completed',
            started_at = now(),
            completed_at = now(),
            remaining_tasks = 0,
            output = case when s.step_type = 'map' then '[]'::jsonb end
        from pgflow.steps s
        where ss.run_id = v_run.run_id
          and ss.status = 'created' and ss.remaining_deps = 0 and ss.initial_tasks = 0
          and s.flow_slug = ss.flow_slug and s.step_slug = ss.step_slug
          and pgflow._condition_met(v_run.run_id, v_run.input, s.flow_slug, s.step_slug, s.deps_count,
                                    s.required_input_pattern, s.forbidden_input_pattern)
        returning ss.step_slug, s.step_index, ss.output, ss.started_at, ss.completed_at
      )
      select * from done order by step_index
    loop
      v_done := array_append(v_done, v_step.step_slug);
      perform pgflow._emit('step:' || v_step.step_slug || ':completed', v_run.run_id, jsonb_build_object(
        'event_type', 'step:completed',
        'run_id', v_run.run_id,
        'step_slug', v_step.step_slug,
        'status', 'completed',
        'output', v_step.output,
        'started_at', v_step.started_at,
        'completed_at', v_step.completed_at,
        'remaining_tasks', 0,
        'remaining_deps', 0
      ));
    end loop;

    exit when v_done is null;

    perform pgflow._release_dependents(v_run.run_id, v_run.flow_slug, v_done);
    update pgflow.runs r
    set remaining_steps = r.remaining_steps - cardinality(v_done)
    where r.run_id = v_run.run_id;
    v_total := v_total + cardinality(v_done);
  end loop;

  return v_total;
end;
$$;

-- Completes every started run of `p_run_ids` whose steps are all completed or skipped. Output: {leaf_step:
-- output} over the completed leaf steps (steps nothing depends on), NULL when none completed. Emits
-- `run:completed` for each.
create function pgflow._complete_runs(p_run_ids uuid[])
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_run pgflow.runs;
begin
  for v_run in
    update pgflow.runs r
    set status = 'completed',
        completed_at = now(),
        output = (
          select jsonb_object_agg(ss.step_slug, ss.output)
          from pgflow.step_states ss
          where ss.run_id = r.run_id and ss.status = 'completed'
            and not exists (
              select 1 from pgflow.deps d where d.flow_slug = r.flow_slug and d.dep_slug = ss.step_slug)
        )
    where r.run_id = any (p_run_ids) and r.remaining_steps = 0 and r.status = 'started'
    returning r.*
  loop
    perform pgflow._emit('run:completed', v_run.run_id, jsonb_build_object(
      'event_type', 'run:completed',
      'run_id', v_run.run_id,
      'flow_slug', v_run.flow_slug,
      'status', 'completed',
      'output', v_run.output,
      'completed_at', v_run.completed_at
    ));
  end loop;
end;
$$;

-- Upstream's maybe_complete_run(run_id): the same, for one run.
create function pgflow.maybe_complete_run(run_id uuid)
returns void
language sql
set search_path = ''
as $$
  select pgflow._complete_runs(array[maybe_complete_run.run_id]);
$$;

-- Moves a run forward after something finished: conditions, taskless steps (re-checking conditions of
-- steps that became ready through an empty map), then new tasks, then run completion.
create function pgflow._advance_run(p_run_id uuid)
returns boolean
language plpgsql
set search_path = ''
as $$
begin
  loop
    if not pgflow.cascade_resolve_conditions(p_run_id) then
      return false;
    end if;
    exit when pgflow.cascade_complete_taskless_steps(p_run_id) = 0;
  end loop;
  perform pgflow._start_ready_steps(array[p_run_id]);
  perform pgflow._complete_runs(array[p_run_id]);
  return true;
end;
$$;

-- Advances the runs `p_run_ids` after their steps changed: the one place that decides how. Runs none of whose
-- ready steps needs the cascade (_needs_cascade: a condition to evaluate, or no tasks) start those steps
-- together, set-based; the others go through the full cascade of _advance_run (which completes its run when
-- it can). The fast runs whose steps are all done complete.
create function pgflow._advance_runs(p_run_ids uuid[])
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_fast uuid[];
  v_done uuid[];
  v_run uuid;
begin
  select coalesce(array_agg(x.run_id) filter (where not x.needs_cascade), '{}'),
         array_agg(x.run_id) filter (where not x.needs_cascade and x.remaining_steps = 0)
  into v_fast, v_done
  from (
    select r.run_id, r.remaining_steps, exists (
      select 1
      from pgflow.step_states ss
      join pgflow.steps s on s.flow_slug = ss.flow_slug and s.step_slug = ss.step_slug
      where ss.run_id = r.run_id and ss.status = 'created' and ss.remaining_deps = 0
        and pgflow._needs_cascade(ss.initial_tasks, s.required_input_pattern, s.forbidden_input_pattern)
    ) as needs_cascade
    from pgflow.runs r
    where r.run_id = any (p_run_ids)
  ) x;
  if cardinality(v_fast) > 0 then
    perform pgflow._start_ready_steps(v_fast);
  end if;
  foreach v_run in array coalesce(p_run_ids, '{}') loop
    if not v_run = any (v_fast) then
      perform pgflow._advance_run(v_run);
    end if;
  end loop;
  if v_done is not null then
    perform pgflow._complete_runs(v_done);
  end if;
end;
$$;

create function pgflow.start_flows(flow_slug text, inputs jsonb[], run_ids uuid[] default NULL::uuid[])
returns setof pgflow.runs
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
as $$
declare
  v_slug text := pgflow.resolve_flow_slug(start_flows.flow_slug);
  v_n int := cardinality(start_flows.inputs);
  v_steps int;
  v_root_map boolean;
  v_bad int;
  v_i int;
  v_runs uuid[];
  v_run pgflow.runs;
  v_started int;
  v_start_runs uuid[];
  v_start_steps text[];
  v_start_tasks int[];
  v_cascade uuid[];
begin
  if v_n is null then
    raise exception 'start_flows(%): inputs is NULL; pass an array with one input per run', v_slug;
  end if;
  if start_flows.run_ids is not null and cardinality(start_flows.run_ids) is distinct from v_n then
    raise exception 'start_flows(%): % run ids for % inputs; pass one run id (or NULL) per input, or no run ids',
      v_slug, coalesce(cardinality(start_flows.run_ids), 0), v_n;
  end if;
  if v_n = 0 then
    return;
  end if;

  select count(*)::int, coalesce(bool_or(s.step_type = 'map' and s.deps_count = 0), false)
  into v_steps, v_root_map
  from pgflow.steps s
  where s.flow_slug = v_slug;

  if v_root_map then
    select min(i.ord) into v_bad
    from unnest(start_flows.inputs) with ordinality as i(input, ord)
    where i.input is null or jsonb_typeof(i.input) <> 'array';
    if v_bad is not null and start_flows.inputs[v_bad] is null then
      raise exception 'Flow % has root map steps but input is NULL%', v_slug,
        case when v_n > 1 then format(' (input %s of %s)', v_bad, v_n) else '' end;
    elsif v_bad is not null then
      raise exception 'Flow % has root map steps but input is not an array (got %)%', v_slug,
        jsonb_typeof(start_flows.inputs[v_bad]),
        case when v_n > 1 then format(' (input %s of %s)', v_bad, v_n) else '' end;
    end if;
  end if;

  for v_i in 1 .. v_n loop
    v_runs[v_i] := coalesce(start_flows.run_ids[v_i], gen_random_uuid());
  end loop;

  -- One run:started per run, in input order.
  for v_run in
    insert into pgflow.runs (run_id, flow_slug, input, remaining_steps)
    select v_runs[i.ord], v_slug, i.input, v_steps
    from unnest(start_flows.inputs) with ordinality as i(input, ord)
    order by i.ord
    returning *
  loop
    perform pgflow._emit('run:started', v_run.run_id, jsonb_build_object(
      'event_type', 'run:started',
      'run_id', v_run.run_id,
      'flow_slug', v_run.flow_slug,
      'input', v_run.input,
      'status', 'started',
      'remaining_steps', v_run.remaining_steps,
      'started_at', v_run.started_at
    ));
  end loop;

  -- A run's root steps are inserted started unless one of them needs the cascade (a root condition, or an
  -- empty root map); the roots inserted started come back ordered by run and step.
  with inserted as (
    insert into pgflow.step_states (flow_slug, run_id, step_slug, remaining_deps, initial_tasks, status,
                                    started_at, remaining_tasks)
    select y.flow_slug, y.run_id, y.step_slug, y.deps_count, y.initial_tasks,
           case when y.start then 'started' else 'created' end,
           case when y.start then now() end,
           case when y.start then y.initial_tasks end
    from (
      select s.flow_slug, r.run_id, s.step_slug, s.deps_count, x.initial_tasks,
             s.deps_count = 0 and not coalesce(bool_or(s.deps_count = 0 and pgflow._needs_cascade(
               x.initial_tasks, s.required_input_pattern, s.forbidden_input_pattern))
               over (partition by r.run_id), false) as start
      from unnest(v_runs, start_flows.inputs) as r(run_id, input)
      cross join pgflow.steps s
      cross join lateral (
        select case when s.step_type = 'single' then 1
                    when s.deps_count = 0 then jsonb_array_length(r.input)
               end as initial_tasks
      ) x
      where s.flow_slug = v_slug
    ) y
    returning step_states.run_id, step_states.step_slug, step_states.status, step_states.remaining_tasks
  )
  select count(distinct i.run_id) filter (where i.status = 'started')::int,
         array_agg(i.run_id order by i.run_id, i.step_slug) filter (where i.status = 'started'),
         array_agg(i.step_slug order by i.run_id, i.step_slug) filter (where i.status = 'started'),
         array_agg(i.remaining_tasks order by i.run_id, i.step_slug) filter (where i.status = 'started')
  into v_started, v_start_runs, v_start_steps, v_start_tasks
  from inserted i;

  if v_start_runs is not null and pgflow._step_events_enabled() then
    for v_i in 1 .. cardinality(v_start_runs) loop
      perform pgflow._emit_step_started(v_start_runs[v_i], v_start_steps[v_i], now(), v_start_tasks[v_i], 0);
    end loop;
  end if;
  -- Runs with no root started here (a root needs the cascade, or the flow has no steps): _advance_runs
  -- decides.
  if v_started < v_n then
    select array_agg(r.run_id order by r.ord) into v_cascade
    from unnest(v_runs) with ordinality as r(run_id, ord)
    where r.run_id <> all (coalesce(v_start_runs, '{}'));
    perform pgflow._advance_runs(v_cascade);
  end if;
  if v_start_runs is not null then
    perform pgflow._create_step_tasks(v_start_runs, v_start_steps);
  end if;

  -- Read back by key, one lateral lookup per run (kept apart with offset 0): a join could be planned as a
  -- pass over a whole index by a session whose plan predates the table's growth.
  return query select r.* from unnest(v_runs) with ordinality as u(run_id, ord)
               cross join lateral (select * from pgflow.runs x where x.run_id = u.run_id offset 0) r
               order by u.ord;
end;
$$;

-- start_flow: one run, through start_flows.
create function pgflow.start_flow(flow_slug text, input jsonb, run_id uuid default NULL::uuid)
returns setof pgflow.runs
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
as $$
begin
  return query select * from pgflow.start_flows(start_flow.flow_slug, array[start_flow.input],
                                                array[start_flow.run_id]);
end;
$$;

create function pgflow.start_flow_with_states(flow_slug text, input jsonb, run_id uuid default NULL::uuid)
returns jsonb
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
as $$
declare
  v_run_id uuid;
begin
  select r.run_id into v_run_id
  from pgflow.start_flow(start_flow_with_states.flow_slug, start_flow_with_states.input,
                         start_flow_with_states.run_id) r;
  return pgflow.get_run_with_states(v_run_id);
end;
$$;

create function pgflow.get_run_with_states(run_id uuid)
returns jsonb
language sql
security definer
set search_path = ''
as $$
  select jsonb_build_object(
    'run', to_jsonb(r),
    'steps', coalesce(
      (select jsonb_agg(to_jsonb(ss)) from pgflow.step_states ss where ss.run_id = r.run_id),
      '[]'::jsonb)
  )
  from pgflow.runs r
  where r.run_id = get_run_with_states.run_id;
$$;

-- ==== schema/07_claims.sql ====
-- Claims: reading a queue's messages and turning them into started tasks, and the one lock order.
--
-- THE LOCK ORDER. Every function of the SQL core that takes row locks takes them in this order, and never
-- waits for an earlier kind while holding a later one:
--
--   1. advisory locks: a flow slug's compile lock, then queue-name locks in sorted order (compilation); the
--      maintenance lock (recovery and retention, try-only, never waited for);
--   2. `pgflow.runs` rows (FOR NO KEY UPDATE): every change of a run's state is serialised on its run row;
--      several runs in run_id order;
--   3. PGMQ message rows (`pgmq.q_<queue>`), per queue in msg_id order, several queues in queue-name order:
--      pgmq.read takes them for a claim; every other path locks a task's message explicitly
--      (pgflow._lock_messages) before it touches the task;
--   4. `pgflow.step_tasks` rows, in (queue_name, message_id) order;
--   5. then `pgflow.step_states` and the run's counters (under the run row of 2).
--
-- A claim (pgmq.read, then claim_tasks) starts at 3: it holds the messages it read and then locks their tasks.
-- Every other writer of a task holds that task's message first, so a claim never waits for a task row whose
-- holder waits for one of the claim's messages: the interleaving "read a message in one session, cancel its
-- task from another, claim it in the first" cannot deadlock. It ends either with the claim first (the task is
-- then cancelled with its message archived) or with the cancellation first (the claim archives the message of
-- the terminal task). Recovery paths (stalled tasks, dead workers) take messages and tasks with SKIP LOCKED,
-- so they never wait at all.
--
-- Owns: claim_tasks (the classifying claim of per-step, queue and plain workers), read_and_claim_tasks (read
-- and claim in one call), upstream's start_tasks forms, set_vt_batch and poll_for_tasks.

-- Locks the live messages `p_ids` of queue `p_queue` (FOR UPDATE, in msg_id order, through the queue's
-- statements) and returns the ids it locked. With p_skip_locked, messages another transaction holds are
-- skipped instead of waited for. Ids that are no longer live (archived or deleted), or of a queue that does
-- not exist, are not returned. This is step 3 of the lock order: a task's message is locked before the task.
create function pgflow._lock_messages(p_queue text, p_ids bigint[], p_skip_locked boolean default false)
returns bigint[]
language plpgsql
set search_path = ''
as $$
begin
  if p_ids is null or cardinality(p_ids) = 0
     or to_regclass(format('pgmq.%I', pgmq.format_table_name(p_queue, 'q'))) is null then
    return '{}';
  end if;
  return pgflow._queue_op(p_queue, case when p_skip_locked then 'lock_skip_locked' else 'lock' end, p_ids);
end;
$$;

-- The classifying claim behind claim_tasks, read_and_claim_tasks and exchange. read_vt NULL: the caller read
-- the messages in an earlier transaction, so they are locked here first. read_vt set: this transaction's
-- locking read holds them; each is counted as read (read_ct, last_read_at) and the ones not claimed, deferred
-- or released stay invisible for read_vt seconds, as after pgmq.read. Queue statements go through the
-- queue's statements function.
create function pgflow._claim_tasks(queue_name text, msg_ids bigint[], worker_id uuid, flow_slugs text[], step_slugs text[], read_vt integer)
returns table(outcome text, msg_id bigint, flow_slug text, run_id uuid, step_slug text, task_index integer, input jsonb, flow_input jsonb, attempts_count integer, timeout integer, report jsonb)
language plpgsql
set search_path = ''
as $$
declare
  v_queue text := lower(_claim_tasks.queue_name);
  v_ids bigint[];
  v_table text;
  v_claim_ids bigint[];
  v_defer_ids bigint[];
  v_defer_vts timestamptz[];
  v_archive_ids bigint[];
  v_wait_ids bigint[];
  v_unsupported_ids bigint[];
  v_run_ids uuid[];
  v_step_slugs text[];
  v_task_indexes int[];
  v_secs float8[];
  v_updated int;
  v_disabled jsonb;
  v_report jsonb;
  v_vis_ids bigint[];
  v_vis_vts timestamptz[];
  -- After a locking read, every message is counted as read once, as pgmq.read would have.
  v_read int := case when _claim_tasks.read_vt is null then 0 else 1 end;
begin
  if cardinality(_claim_tasks.flow_slugs) is distinct from cardinality(_claim_tasks.step_slugs) then
    raise exception 'claim_tasks(): flow_slugs and step_slugs differ in length (% and %)',
      cardinality(_claim_tasks.flow_slugs), cardinality(_claim_tasks.step_slugs)
      using errcode = 'invalid_parameter_value';
  end if;
  select coalesce(array_agg(distinct i order by i), '{}') into v_ids
  from unnest(_claim_tasks.msg_ids) as i where i is not null;
  if cardinality(v_ids) = 0 then
    return;
  end if;
  v_table := pgmq.format_table_name(v_queue, 'q');

  -- Lock order step 3: the batch's messages, unless this transaction's locking read holds them already.
  if _claim_tasks.read_vt is null then
    perform pgflow._lock_messages(v_queue, v_ids);
  end if;

  -- The fence: a worker of a disabled function claims nothing.
  select jsonb_build_object('function_name', wf.function_name, 'reason', wf.disabled_reason,
                            'disabled_at', wf.disabled_at)
  into v_disabled
  from pgflow.workers w
  join pgflow.worker_functions wf on wf.function_name = w.function_name
  where w.worker_id = _claim_tasks.worker_id and not wf.enabled;

  -- Lock order step 4: every task of the batch, in message order, classified in the same statement.
  with pairs as (
    select p.flow_slug, p.step_slug
    from unnest(_claim_tasks.flow_slugs, _claim_tasks.step_slugs) as p(flow_slug, step_slug)
  ),
  locked as (
    select t.message_id as id,
           t.run_id, t.step_slug, t.task_index, t.started_at,
           coalesce(s.opt_timeout, f.opt_timeout) as timeout,
           case
             when not exists (select 1 from pairs p where p.flow_slug = t.flow_slug and p.step_slug = t.step_slug)
               then 'unsupported'
             when t.status = 'queued' and r.status = 'started' and ss.status = 'started' then 'claim'
             when t.status = 'queued' then 'wait'
             when t.status = 'started' then 'defer'
             else 'archive'
           end as kind
    from pgflow.step_tasks t
    join pgflow.runs r on r.run_id = t.run_id
    join pgflow.step_states ss on ss.run_id = t.run_id and ss.step_slug = t.step_slug
    join pgflow.steps s on s.flow_slug = t.flow_slug and s.step_slug = t.step_slug
    join pgflow.flows f on f.flow_slug = t.flow_slug
    where t.queue_name = v_queue and t.message_id = any (v_ids)
    order by t.message_id
    for update of t
  ),
  classified as (
    select m.id, l.run_id, l.step_slug, l.task_index, l.started_at, l.timeout,
           coalesce(l.kind, 'unsupported') as kind
    from unnest(v_ids) as m(id)
    left join locked l on l.id = m.id
  )
  select array_agg(c.id order by c.id) filter (where c.kind = 'claim'),
         array_agg(c.run_id order by c.id) filter (where c.kind = 'claim'),
         array_agg(c.step_slug order by c.id) filter (where c.kind = 'claim'),
         array_agg(c.task_index order by c.id) filter (where c.kind = 'claim'),
         array_agg(c.timeout::float8 + pgflow._claim_visibility_buffer_seconds() order by c.id)
           filter (where c.kind = 'claim'),
         array_agg(c.id order by c.id) filter (where c.kind = 'defer'),
         array_agg(greatest(pgflow._recovery_boundary(c.started_at, c.timeout),
                            clock_timestamp() + make_interval(secs => pgflow._claim_visibility_buffer_seconds()))
                   order by c.id) filter (where c.kind = 'defer'),
         array_agg(c.id order by c.id) filter (where c.kind = 'archive'),
         array_agg(c.id order by c.id) filter (where c.kind = 'wait'),
         array_agg(c.id order by c.id) filter (where c.kind = 'unsupported')
  into v_claim_ids, v_run_ids, v_step_slugs, v_task_indexes, v_secs,
       v_defer_ids, v_defer_vts, v_archive_ids, v_wait_ids, v_unsupported_ids
  from classified c;

  if v_unsupported_ids is not null or v_disabled is not null then
    -- No mutation except making the whole batch visible again.
    perform pgflow._queue_op(v_queue, 'visibility', v_ids,
                             array(select clock_timestamp() from unnest(v_ids)), v_read);

    if v_disabled is not null then
      return query select 'disabled'::text, null::bigint, null::text, null::uuid, null::text, null::int,
                          null::jsonb, null::jsonb, null::int, null::int, v_disabled;
      return;
    end if;

    execute format($q$
      with msgs as (
        select u.id,
               t.flow_slug as t_flow, t.step_slug as t_step,
               q.message ->> 'flow_slug' as b_flow, q.message ->> 'step_slug' as b_step,
               q.message ->> 'run_id' as b_run, q.message ->> 'task_index' as b_index
        from unnest($1::bigint[]) as u(id)
        left join pgflow.step_tasks t on t.queue_name = $2 and t.message_id = u.id
        left join pgmq.%I q on q.msg_id = u.id
      ),
      reasons as (
        select m.id, coalesce(m.t_flow, m.b_flow) as flow_slug, coalesce(m.t_step, m.b_step) as step_slug,
               case
                 when m.t_flow is not null then 'unsupported_route'
                 when m.b_run ~ '^[0-9a-fA-F-]{36}$' and m.b_index ~ '^[0-9]+$' and exists (
                        select 1 from pgflow.step_tasks o
                        where o.run_id = m.b_run::uuid and o.step_slug = m.b_step
                          and o.task_index = m.b_index::int and o.queue_name <> $2) then 'wrong_queue'
                 else 'no_task'
               end as reason
        from msgs m
      )
      select jsonb_build_object(
        'queue_name', $2,
        'msg_ids', to_jsonb($3::bigint[]),
        'unsupported_msg_ids', to_jsonb($1::bigint[]),
        'flows', coalesce((select jsonb_agg(distinct r.flow_slug) from reasons r where r.flow_slug is not null), '[]'),
        'steps', coalesce((select jsonb_agg(distinct r.step_slug) from reasons r where r.step_slug is not null), '[]'),
        'messages', (select jsonb_agg(jsonb_build_object('msg_id', r.id, 'reason', r.reason,
                                      'flow_slug', r.flow_slug, 'step_slug', r.step_slug) order by r.id)
                     from reasons r),
        'supported', coalesce((select jsonb_agg(jsonb_build_array(p.flow_slug, p.step_slug))
                               from unnest($4::text[], $5::text[]) as p(flow_slug, step_slug)), '[]'))
    $q$, v_table)
    into v_report
    using v_unsupported_ids, v_queue, v_ids, _claim_tasks.flow_slugs, _claim_tasks.step_slugs;

    return query select 'unsupported'::text, null::bigint, null::text, null::uuid, null::text, null::int,
                        null::jsonb, null::jsonb, null::int, null::int, v_report;
    return;
  end if;

  -- Fully supported batch: claim, defer, archive.
  if v_claim_ids is not null then
    update pgflow.step_tasks t
    set status = 'started',
        attempts_count = t.attempts_count + 1,
        -- A claim whose transaction began before the task was queued still starts it no earlier
        -- than it was queued (started_at_is_after_queued_at).
        started_at = greatest(now(), t.queued_at),
        last_worker_id = _claim_tasks.worker_id
    from unnest(v_run_ids, v_step_slugs, v_task_indexes) as c(run_id, step_slug, task_index)
    where t.run_id = c.run_id and t.step_slug = c.step_slug and t.task_index = c.task_index
      and t.status = 'queued';
  end if;

  -- Each message's visibility, in one update: claimed ones for the step timeout plus the claim buffer,
  -- deferred ones until their recovery boundary; after a locking read, the others from now for read_vt
  -- seconds, as pgmq.read leaves them (archived ones are archived next).
  if v_claim_ids is not null or v_defer_ids is not null or _claim_tasks.read_vt is not null then
    select array_agg(v.id), array_agg(v.vt) into v_vis_ids, v_vis_vts
    from (
      select c.id, clock_timestamp() + make_interval(secs => c.secs) as vt
      from unnest(v_claim_ids, v_secs) as c(id, secs)
      union all
      select d.id, d.vt from unnest(v_defer_ids, v_defer_vts) as d(id, vt)
      union all
      select o.id, clock_timestamp() + make_interval(secs => _claim_tasks.read_vt)
      from unnest(coalesce(v_wait_ids, '{}') || coalesce(v_archive_ids, '{}')) as o(id)
      where _claim_tasks.read_vt is not null
    ) v;
    select count(*) into v_updated
    from unnest(pgflow._queue_op(v_queue, 'visibility', v_vis_ids, v_vis_vts, v_read)) as u(id)
    where u.id = any (v_claim_ids);
    if v_updated <> coalesce(cardinality(v_claim_ids), 0) then
      raise exception 'claim_tasks(): visibility updated % of % claimed messages', v_updated, cardinality(v_claim_ids)
        using detail = format('queue %s, messages %s', v_queue, v_claim_ids::text),
              hint = 'A claimed message is missing from its queue; no task was claimed.';
    end if;
  end if;

  if v_archive_ids is not null then
    perform pgflow._queue_op(v_queue, 'archive', v_archive_ids);
  end if;

  if v_claim_ids is not null then
    return query
    select 'claimed'::text, c.msg_id, t.flow_slug, t.run_id, t.step_slug, t.task_index, i.input, i.flow_input,
           t.attempts_count, coalesce(s.opt_timeout, f.opt_timeout), null::jsonb
    from unnest(v_run_ids, v_step_slugs, v_task_indexes, v_claim_ids)
           with ordinality as c(run_id, step_slug, task_index, msg_id, ord)
    join pgflow.step_tasks t on t.run_id = c.run_id and t.step_slug = c.step_slug and t.task_index = c.task_index
    join pgflow.steps s on s.flow_slug = t.flow_slug and s.step_slug = t.step_slug
    join pgflow.flows f on f.flow_slug = t.flow_slug
    join pgflow.runs r on r.run_id = t.run_id
    cross join lateral pgflow._task_inputs(t.run_id, t.flow_slug, t.step_slug, s.step_type, s.deps_count,
                                           t.element, r.input) i
    order by c.ord;
  end if;
  return query
  select x.kind, x.id, null::text, null::uuid, null::text, null::int, null::jsonb, null::jsonb, null::int,
         null::int, null::jsonb
  from (
    select 'deferred'::text as kind, d.id from unnest(v_defer_ids) as d(id)
    union all
    select 'archived', a.id from unnest(v_archive_ids) as a(id)
    union all
    select 'waiting', w.id from unnest(v_wait_ids) as w(id)
  ) x
  order by x.id;
end;
$$;

-- The claim of pgflow-rs workers: the messages `msg_ids` a worker read from `queue_name` (in an earlier
-- transaction: they are locked here first), classified against the exact (flow_slugs[i], step_slugs[i]) pairs
-- the worker runs from that queue. Tasks are matched by (queue_name, message_id) only. The batch is
-- classified first, its messages and then its task rows locked in message order:
--   claimed      task in this queue, its (flow, step) among the pairs, `queued`, run and step started
--   deferred     task `started` (a duplicate visibility, benign): no attempt consumed; the message is hidden
--                until the task's recovery boundary (at least the claim buffer from now)
--   archived     task terminal (completed, failed, skipped, cancelled): the message is archived, idempotently
--   waiting      task `queued` but its run or step is not started (not normally reachable): left untouched
--   unsupported  no task for (queue_name, msg_id) ("no_task"), a task for the message body recorded in another
--                queue ("wrong_queue"), or a task whose (flow, step) is not among the pairs ("unsupported_route")
-- If any message is unsupported, or the worker's function is disabled: nothing is claimed, deferred or
-- archived, no attempt is consumed, and every message of the batch becomes visible again (vt = now).
-- Otherwise, atomically: queued tasks become `started` (attempts_count + 1, started_at, last_worker_id) and
-- their messages get visibility = effective step timeout + claim buffer; started ones are deferred; terminal
-- ones archived.
--
-- Returns rows, so a worker decodes no document:
--   outcome 'claimed'      one row per claimed task: msg_id, flow_slug, run_id, step_slug, task_index, input,
--                          flow_input, attempts_count (the attempt this claim started: every result carries
--                          it, the fence), timeout (the effective step timeout in seconds); in msg_id order
--   outcome 'deferred' | 'archived' | 'waiting'   one row per such message (msg_id only)
--   outcome 'unsupported'  exactly one row, report = {"queue_name", "msg_ids" (the whole batch, visible again),
--                          "unsupported_msg_ids", "flows", "steps", "messages": [{"msg_id", "reason",
--                          "flow_slug", "step_slug"}], "supported": [[flow, step], ...]} without message bodies
--   outcome 'disabled'     exactly one row, report = {"function_name", "reason", "disabled_at"}
-- An empty batch returns no row.
create function pgflow.claim_tasks(queue_name text, msg_ids bigint[], worker_id uuid, flow_slugs text[], step_slugs text[])
returns table(outcome text, msg_id bigint, flow_slug text, run_id uuid, step_slug text, task_index integer, input jsonb, flow_input jsonb, attempts_count integer, timeout integer, report jsonb)
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
as $$
begin
  return query
  select * from pgflow._claim_tasks(claim_tasks.queue_name, claim_tasks.msg_ids, claim_tasks.worker_id,
                                    claim_tasks.flow_slugs, claim_tasks.step_slugs, null);
end;
$$;

-- Reads up to `qty` visible messages from `queue_name` and classifies and claims them for the worker's pairs
-- (as claim_tasks), in one call and one transaction. Never sleeps. The read locks the oldest visible messages
-- exactly as pgmq.read does (in message order, skipping those another transaction holds) but leaves their
-- visibility to the claim, which sets it once (`vt` seconds for messages not claimed). An empty read returns
-- no row.
create function pgflow.read_and_claim_tasks(queue_name text, qty integer, vt integer, worker_id uuid, flow_slugs text[], step_slugs text[])
returns table(outcome text, msg_id bigint, flow_slug text, run_id uuid, step_slug text, task_index integer, input jsonb, flow_input jsonb, attempts_count integer, timeout integer, report jsonb)
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
as $$
declare
  v_ids bigint[];
begin
  -- Lock order step 3: the messages.
  v_ids := pgflow._queue_op(read_and_claim_tasks.queue_name, 'lock_visible', null, null,
                            read_and_claim_tasks.qty);
  if v_ids is null then
    return;
  end if;
  return query
  select * from pgflow._claim_tasks(read_and_claim_tasks.queue_name, v_ids, read_and_claim_tasks.worker_id,
                                    read_and_claim_tasks.flow_slugs, read_and_claim_tasks.step_slugs,
                                    coalesce(read_and_claim_tasks.vt, 0));
end;
$$;

-- Upstream's form: the flow's one queue, then the form above (which replans when needed).
create function pgflow.start_tasks(flow_slug text, msg_ids bigint[], worker_id uuid)
returns setof pgflow.step_task_record
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
as $$
declare
  v_queues text[];
begin
  select array_agg(distinct s.queue_name) into v_queues
  from pgflow.steps s
  where s.flow_slug = start_tasks.flow_slug;

  if v_queues is null then
    return;
  elsif cardinality(v_queues) > 1 then
    raise exception 'start_tasks(): flow "%" sends its tasks to % queues (%)',
        start_tasks.flow_slug, cardinality(v_queues), array_to_string(v_queues, ', ')
      using hint = 'Call start_tasks(flow_slug, msg_ids, worker_id, queue_name) with the queue the messages were read from.';
  end if;

  return query
  select * from pgflow.start_tasks(start_tasks.flow_slug, start_tasks.msg_ids, start_tasks.worker_id, v_queues[1]);
end;
$$;

-- Claims the queued tasks behind `msg_ids` read from queue `queue_name` and returns them ready to run.
--
-- * Only tasks that are `queued`, of a started run and a started step are claimed; other messages are ignored
--   (a started task's message seen again, or a terminal task's, is not an error).
-- * The messages are locked first, then the task rows, then one guarded UPDATE claims them; rows come from its
--   RETURNING, so of two overlapping claims of one message exactly one returns the task.
-- * Before returning, every claimed message gets visibility = effective step timeout + claim buffer
--   (pgflow._claim_visibility_buffer_seconds()). If any claimed message could not be updated (it is missing
--   from its queue), the whole claim fails with `start_tasks(): visibility updated N of M claimed messages` and
--   nothing is claimed.
-- * flow_slug NULL claims tasks of any flow in that queue.
create function pgflow.start_tasks(flow_slug text, msg_ids bigint[], worker_id uuid, queue_name text)
returns setof pgflow.step_task_record
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
as $$
declare
  v_queue text := lower(start_tasks.queue_name);
  v_claimed bigint[];
  v_vts timestamptz[];
  v_updated int;
begin
  if msg_ids is null or cardinality(msg_ids) = 0 then
    return;
  end if;
  perform pgflow._replan_if_grown();

  perform pgflow._lock_messages(v_queue, start_tasks.msg_ids);

  with candidates as (
    select t.run_id, t.step_slug, t.task_index
    from pgflow.step_tasks t
    where t.queue_name = v_queue
      and t.message_id = any (start_tasks.msg_ids)
      and (start_tasks.flow_slug is null or t.flow_slug = start_tasks.flow_slug)
      and t.status = 'queued'
    order by t.message_id
    for update
  ),
  claimed as (
    update pgflow.step_tasks t
    set status = 'started',
        attempts_count = t.attempts_count + 1,
        -- A claim whose transaction began before the task was queued still starts it no earlier
        -- than it was queued (started_at_is_after_queued_at).
        started_at = greatest(now(), t.queued_at),
        last_worker_id = start_tasks.worker_id
    from candidates c, pgflow.runs r, pgflow.step_states ss
    where t.run_id = c.run_id and t.step_slug = c.step_slug and t.task_index = c.task_index
      and t.status = 'queued'
      and r.run_id = t.run_id and r.status = 'started'
      and ss.run_id = t.run_id and ss.step_slug = t.step_slug and ss.status = 'started'
    returning t.message_id, t.flow_slug, t.step_slug
  )
  select array_agg(c.message_id order by c.message_id),
         array_agg(clock_timestamp() + make_interval(secs => coalesce(s.opt_timeout, f.opt_timeout)::float8
                                                             + pgflow._claim_visibility_buffer_seconds())
                   order by c.message_id)
  into v_claimed, v_vts
  from claimed c
  join pgflow.steps s on s.flow_slug = c.flow_slug and s.step_slug = c.step_slug
  join pgflow.flows f on f.flow_slug = c.flow_slug;

  if v_claimed is null then
    return;
  end if;

  -- Visibility only: read count and last read time as they were (p_n = 0).
  v_updated := coalesce(cardinality(pgflow._queue_op(v_queue, 'visibility', v_claimed, v_vts, 0)), 0);
  if v_updated <> cardinality(v_claimed) then
    raise exception 'start_tasks(): visibility updated % of % claimed messages', v_updated, cardinality(v_claimed)
      using detail = format('queue %s, messages %s', v_queue, v_claimed::text),
            hint = 'A claimed message is missing from its queue; no task was claimed.';
  end if;

  return query
  select t.flow_slug, t.run_id, t.step_slug, i.input, t.message_id, t.task_index, i.flow_input
  from unnest(v_claimed) with ordinality as c(msg_id, ord)
  join pgflow.step_tasks t on t.queue_name = v_queue and t.message_id = c.msg_id
  join pgflow.steps s on s.flow_slug = t.flow_slug and s.step_slug = t.step_slug
  join pgflow.runs r on r.run_id = t.run_id
  cross join lateral pgflow._task_inputs(t.run_id, t.flow_slug, t.step_slug, s.step_type, s.deps_count,
                                         t.element, r.input) i
  order by c.ord;
end;
$$;

-- Batched set_vt: message msg_ids[i] becomes visible vt_offsets[i] seconds from now.
create function pgflow.set_vt_batch(queue_name text, msg_ids bigint[], vt_offsets integer[])
returns table(msg_id bigint, read_ct integer, enqueued_at timestamp with time zone, vt timestamp with time zone, message jsonb, headers jsonb)
language plpgsql
security definer
set search_path = ''
as $$
begin
  if msg_ids is null or vt_offsets is null or coalesce(array_length(msg_ids, 1), 0) = 0 then
    return;
  end if;
  if coalesce(array_length(msg_ids, 1), 0) <> coalesce(array_length(vt_offsets, 1), 0) then
    raise exception 'msg_ids length (%) must equal vt_offsets length (%)',
      coalesce(array_length(msg_ids, 1), 0), coalesce(array_length(vt_offsets, 1), 0);
  end if;

  return query execute format(
    'update pgmq.%I q set vt = clock_timestamp() + make_interval(secs => v.off)
       from unnest($1::bigint[], $2::int[]) as v(id, off)
      where q.msg_id = v.id
      returning q.msg_id, q.read_ct, q.enqueued_at, q.vt, q.message, q.headers',
    pgmq.format_table_name(set_vt_batch.queue_name, 'q'))
  using msg_ids, vt_offsets;
end;
$$;

-- Deprecated upstream since the two-phase protocol (read, then start_tasks); kept so old callers get a clear
-- notice instead of a missing function.
create function pgflow.poll_for_tasks(queue_name text, vt integer, qty integer, max_poll_seconds integer default 5, poll_interval_ms integer default 100)
returns setof pgflow.step_task_record
language plpgsql
set search_path = ''
as $$
begin
  raise notice 'pgflow.poll_for_tasks() is deprecated and returns nothing: read messages with pgmq.read() and claim them with pgflow.start_tasks()';
  return;
end;
$$;

-- ==== schema/08_completion.sql ====
-- Completion and failure: recording results, fenced to their attempt, and the exchange.
--
-- Owns: complete_task, complete_tasks, fail_task (upstream's forms and the fenced forms), the terminal paths
-- of a run (failing it, terminating its other tasks), and pgflow.exchange, which records a worker's finished
-- results and claims its next tasks in one round trip.
--
-- Fencing: a result carries the attempt it belongs to (and the worker that claimed it). It is applied only
-- when the task is still started at that attempt (by that worker); otherwise it is 'stale' and changes
-- nothing. Each item's outcome is a pgflow.task_outcome row.

create function pgflow._archive_task_message(p_run_id uuid, p_step_slug text, p_task_index integer)
returns void
language sql
set search_path = ''
as $$
  select pgmq.archive(t.queue_name, t.message_id)
  from pgflow.step_tasks t
  where t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index
    and t.message_id is not null;
$$;

-- Moves the unfinished (queued or started) tasks of some steps of a run, or of the whole run when
-- p_step_slugs is NULL, to a terminal status (`skipped` or `cancelled`) and archives their messages, each in
-- the queue recorded on the task. Returns the number of tasks changed. The caller holds the run row; the
-- messages are locked before the task rows (the lock order of 0011_claims.sql), so a concurrent claim of one
-- of these messages either finishes first (its task is then cancelled too) or waits for this transaction.
create function pgflow._terminate_tasks(p_run_id uuid, p_step_slugs text[], p_status text)
returns integer
language plpgsql
set search_path = ''
as $$
declare
  v_count int := 0;
  v_group record;
begin
  for v_group in
    select t.queue_name, array_agg(t.message_id order by t.message_id) as ids
    from pgflow.step_tasks t
    where t.run_id = p_run_id
      and (p_step_slugs is null or t.step_slug = any (p_step_slugs))
      and t.status in ('queued', 'started')
    group by t.queue_name
    order by t.queue_name
  loop
    perform pgflow._lock_messages(v_group.queue_name, array_remove(v_group.ids, null));
  end loop;

  for v_group in
    with changed as (
      update pgflow.step_tasks t
      set status = p_status
      where t.run_id = p_run_id
        and (p_step_slugs is null or t.step_slug = any (p_step_slugs))
        and t.status in ('queued', 'started')
      returning t.queue_name, t.message_id
    )
    select c.queue_name, array_agg(c.message_id) filter (where c.message_id is not null) as ids,
           count(*)::int as n
    from changed c
    group by c.queue_name
  loop
    v_count := v_count + v_group.n;
    if v_group.ids is not null then
      perform pgmq.archive(v_group.queue_name, v_group.ids);
    end if;
  end loop;
  return v_count;
end;
$$;

-- Fails a started run: status `failed`, every unfinished task `cancelled` with its message archived, and a
-- `run:failed` event (with error_message when given). No-op for a run that is not started.
create function pgflow._fail_run(p_run_id uuid, p_error_message text)
returns boolean
language plpgsql
set search_path = ''
as $$
declare
  v_run pgflow.runs;
begin
  update pgflow.runs r
  set status = 'failed', failed_at = now()
  where r.run_id = p_run_id and r.status = 'started'
  returning r.* into v_run;
  if not found then
    return false;
  end if;

  perform pgflow._terminate_tasks(p_run_id, null, 'cancelled');

  perform pgflow._emit('run:failed', p_run_id, jsonb_strip_nulls(jsonb_build_object(
    'event_type', 'run:failed',
    'run_id', v_run.run_id,
    'flow_slug', v_run.flow_slug,
    'status', 'failed',
    'error_message', p_error_message,
    'failed_at', v_run.failed_at
  )));
  return true;
end;
$$;

-- Records a started task's failure; the one implementation behind fail_task (every form) and the operator's
-- resolve_stalled_task.
--
--   p_force_exhausted   no retry: the task fails as if its attempts were used up (the step's when_exhausted
--                       applies)
--   p_attempt/p_worker_id  NULL: unfenced (upstream's fail_task); otherwise the fence of _complete_task
--   p_retry_delay       seconds before the retry instead of the exponential backoff (NULL: the backoff);
--                       capped at pgflow._max_retry_delay_seconds()
-- Retry while attempts remain: back to `queued`, the message visible again after the delay. Otherwise the step's
-- when_exhausted: fail the step and the run, or skip the step (and, with skip-cascade, its dependents).
-- Returns whether this call applied the failure, and the task row afterwards.
create function pgflow._fail_task(p_run_id uuid, p_step_slug text, p_task_index integer, p_error_message text, p_force_exhausted boolean, p_attempt integer, p_worker_id uuid, p_retry_delay integer, OUT applied boolean, OUT task pgflow.step_tasks)
returns record
language plpgsql
set search_path = ''
as $$
declare
  v_run_status text;
  v_flow_slug text;
  v_queue text;
  v_msg_id bigint;
  v_step_status text;
  v_max_attempts int;
  v_base_delay int;
  v_when_exhausted text;
  v_at timestamptz;
begin
  applied := false;

  -- 1. The run row.
  select r.status, r.flow_slug into v_run_status, v_flow_slug
  from pgflow.runs r
  where r.run_id = p_run_id
  for no key update;
  if not found then
    return;
  end if;

  -- 2. The task's message.
  select t.queue_name, t.message_id into v_queue, v_msg_id
  from pgflow.step_tasks t
  where t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index;
  if not found then
    return;
  end if;
  if v_msg_id is not null then
    perform pgflow._lock_messages(v_queue, array[v_msg_id]);
  end if;

  -- 3. Then read the task, its step and the options, after the locks.
  select t.* into task
  from pgflow.step_tasks t
  where t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index;

  if v_run_status is distinct from 'started' or task.status <> 'started'
     or (p_attempt is not null and task.attempts_count is distinct from p_attempt)
     or (p_worker_id is not null and task.last_worker_id is distinct from p_worker_id) then
    return;
  end if;

  select ss.status,
         coalesce(s.opt_max_attempts, f.opt_max_attempts),
         coalesce(s.opt_base_delay, f.opt_base_delay),
         s.when_exhausted
  into v_step_status, v_max_attempts, v_base_delay, v_when_exhausted
  from pgflow.step_states ss
  join pgflow.steps s on s.flow_slug = ss.flow_slug and s.step_slug = ss.step_slug
  join pgflow.flows f on f.flow_slug = ss.flow_slug
  where ss.run_id = p_run_id and ss.step_slug = p_step_slug;

  if v_step_status <> 'started' then
    perform pgmq.archive(task.queue_name, task.message_id);
    return;
  end if;

  applied := true;

  -- Retry: back to the queue, visible again after the backoff (or the handler's delay), never more than the cap.
  if not p_force_exhausted and task.attempts_count < v_max_attempts then
    update pgflow.step_tasks t
    set status = 'queued', started_at = null, error_message = p_error_message
    where t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index
    returning t.* into task;
    perform pgmq.set_vt(task.queue_name, task.message_id,
      case when p_retry_delay is null then pgflow.calculate_retry_delay(v_base_delay, task.attempts_count)
           else least(greatest(p_retry_delay, 0), pgflow._max_retry_delay_seconds()) end);
    return;
  end if;

  -- Exhausted.
  update pgflow.step_tasks t
  set status = 'failed', failed_at = now(), error_message = p_error_message, permanently_stalled_at = null
  where t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index
  returning t.* into task;
  perform pgmq.archive(task.queue_name, task.message_id);

  if v_when_exhausted = 'fail' then
    update pgflow.step_states ss
    set status = 'failed', failed_at = now(), error_message = p_error_message
    where ss.run_id = p_run_id and ss.step_slug = p_step_slug
    returning ss.failed_at into v_at;
    perform pgflow._emit('step:' || p_step_slug || ':failed', p_run_id, jsonb_build_object(
      'event_type', 'step:failed',
      'run_id', p_run_id,
      'step_slug', p_step_slug,
      'status', 'failed',
      'error_message', p_error_message,
      'failed_at', v_at
    ));
    perform pgflow._fail_run(p_run_id, p_error_message);
    return;
  end if;

  -- when_exhausted skip / skip-cascade: the step is skipped, its other tasks too.
  update pgflow.step_states ss
  set status = 'skipped', skip_reason = 'handler_failed', skipped_at = now(),
      error_message = p_error_message, remaining_tasks = null
  where ss.run_id = p_run_id and ss.step_slug = p_step_slug
  returning ss.skipped_at into v_at;
  perform pgflow._terminate_tasks(p_run_id, array[p_step_slug], 'skipped');
  update pgflow.runs r set remaining_steps = r.remaining_steps - 1 where r.run_id = p_run_id;

  perform pgflow._emit('step:' || p_step_slug || ':skipped', p_run_id, jsonb_build_object(
    'event_type', 'step:skipped',
    'run_id', p_run_id,
    'step_slug', p_step_slug,
    'status', 'skipped',
    'skip_reason', 'handler_failed',
    'error_message', p_error_message,
    'skipped_at', v_at
  ));

  if v_when_exhausted = 'skip-cascade' then
    perform pgflow._cascade_force_skip_steps(p_run_id, p_step_slug, 'handler_failed');
  else
    perform pgflow._release_dependents(p_run_id, v_flow_slug, array[p_step_slug]);
  end if;

  perform pgflow._advance_run(p_run_id);
end;
$$;

-- The two rare outcomes of a completion that is current (task `started` with its attempt), handled one by one:
--   * the task's step already ended (not `started`): nothing to record, the message is archived;
--   * a single step feeding a map that is not sized yet produced something other than an array: a type
--     violation, which fails the task, the step and the run.
-- The caller holds the run row and the task's message. Returns whether the output was applied.
create function pgflow._complete_task_exception(p_run_id uuid, p_step_slug text, p_task_index integer, p_output jsonb)
returns boolean
language plpgsql
set search_path = ''
as $$
declare
  v_task pgflow.step_tasks;
  v_child text;
  v_type text;
  v_error text;
begin
  select t.* into v_task
  from pgflow.step_tasks t
  where t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index;

  if not exists (select 1 from pgflow.step_states ss
                 where ss.run_id = p_run_id and ss.step_slug = p_step_slug and ss.status = 'started') then
    perform pgmq.archive(v_task.queue_name, v_task.message_id);
    return false;
  end if;

  select d.step_slug into v_child
  from pgflow.deps d
  join pgflow.steps cs on cs.flow_slug = d.flow_slug and cs.step_slug = d.step_slug
  join pgflow.step_states cst on cst.run_id = p_run_id and cst.step_slug = d.step_slug
  where d.flow_slug = v_task.flow_slug and d.dep_slug = p_step_slug
    and cs.step_type = 'map' and cst.initial_tasks is null
  order by cs.step_index
  limit 1;
  v_type := coalesce(jsonb_typeof(p_output), 'null');
  v_error := format('[TYPE_VIOLATION] Map step %s expects array input but dependency %s produced %s',
                    v_child, p_step_slug, v_type);
  update pgflow.step_tasks t
  set status = 'failed', failed_at = now(), output = p_output,
      error_message = format('[TYPE_VIOLATION] Produced %s instead of array', v_type)
  where t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index;
  perform pgmq.archive(v_task.queue_name, v_task.message_id);

  update pgflow.step_states ss
  set status = 'failed', failed_at = now(), error_message = v_error
  where ss.run_id = p_run_id and ss.step_slug = p_step_slug;

  perform pgflow._fail_run(p_run_id, null);
  perform pgflow._emit('step:' || p_step_slug || ':failed', p_run_id,
    jsonb_build_object(
      'event_type', 'step:failed',
      'run_id', p_run_id,
      'step_slug', p_step_slug,
      'status', 'failed',
      'error_message', v_error,
      'failed_at', now()
    ));
  return true;
end;
$$;

-- The one implementation of completion: records the outputs of a batch of tasks (item i = run_ids[i],
-- step_slugs[i], task_indexes[i], outputs[i], attempts[i]). An item is applied only while its task is `started`
-- in a started run, and, when attempts[i] is not NULL, with that attempt, and, when p_worker_id is not NULL,
-- claimed by that worker (the fence); a task named twice is applied once. Everything else changes nothing.
-- Dependents are released and started in the releasing update; runs advance through _advance_runs. Returns
-- one row per item that names an existing task: its position, whether this call applied it, and the task row
-- afterwards.
create function pgflow._complete_tasks(p_run_ids uuid[], p_step_slugs text[], p_task_indexes integer[], p_outputs jsonb[], p_attempts integer[], p_worker_id uuid)
returns table(ord integer, applied boolean, task pgflow.step_tasks)
language plpgsql
set search_path = ''
as $$
declare
  v_group record;
  v_normal int[];
  v_exceptions int[];
  v_applied int[] := '{}';
  v_ord int;
  v_queue text[];
  v_msg bigint[];
  v_done record;
  v_done_runs uuid[];
  v_done_steps text[];
  v_done_flows text[];
  v_done_children int[];
  v_ready_runs uuid[];
  v_start_runs uuid[];
  v_start_steps text[];
  v_start_ats timestamptz[];
  v_start_tasks int[];
  v_i int;
  v_finished_runs uuid[];
  v_events boolean;
begin
  if coalesce(cardinality(p_run_ids), 0) = 0 then
    return;
  end if;

  -- Lock order 2: the runs of the batch, in run-id order.
  perform 1 from pgflow.runs r where r.run_id = any (p_run_ids) order by r.run_id for no key update;

  -- Lock order 3: the tasks' messages, per queue.
  for v_group in
    select t.queue_name, array_agg(t.message_id order by t.message_id) as ids
    from unnest(p_run_ids, p_step_slugs, p_task_indexes) as i(run_id, step_slug, task_index)
    join pgflow.step_tasks t on t.run_id = i.run_id and t.step_slug = i.step_slug and t.task_index = i.task_index
    where t.message_id is not null
    group by t.queue_name
    order by t.queue_name
  loop
    perform pgflow._lock_messages(v_group.queue_name, v_group.ids);
  end loop;

  -- Classify every item after the locks: current ones (the first current item of a task named twice) either
  -- complete normally or take one of the two rare paths; the rest are stale.
  select array_agg(c.ord order by c.ord) filter (where c.kind = 'normal'),
         array_agg(c.ord order by c.ord) filter (where c.kind = 'exception')
  into v_normal, v_exceptions
  from (
    select x.ord,
           case
             when not x.current then 'stale'
             -- A task named twice: the first current item wins.
             when x.ord <> min(x.ord) filter (where x.current) over (partition by x.run_id, x.step_slug, x.task_index)
               then 'stale'
             else x.kind
           end as kind
    from (
      select i.ord, i.run_id, i.step_slug, i.task_index,
             r.status is not distinct from 'started' and t.status is not distinct from 'started'
               and (p_attempts[i.ord] is null or t.attempts_count is not distinct from p_attempts[i.ord])
               and (p_worker_id is null or t.last_worker_id is not distinct from p_worker_id) as current,
             case
               when ss.status <> 'started' then 'exception'
               when s.step_type = 'single' and (i.output is null or jsonb_typeof(i.output) <> 'array')
                    and exists (
                      select 1
                      from pgflow.deps d
                      join pgflow.steps cs on cs.flow_slug = d.flow_slug and cs.step_slug = d.step_slug
                      join pgflow.step_states cst on cst.run_id = i.run_id and cst.step_slug = d.step_slug
                      where d.flow_slug = t.flow_slug and d.dep_slug = i.step_slug
                        and cs.step_type = 'map' and cst.initial_tasks is null) then 'exception'
               else 'normal'
             end as kind
      from unnest(p_run_ids, p_step_slugs, p_task_indexes, p_outputs)
             with ordinality as i(run_id, step_slug, task_index, output, ord)
      left join pgflow.step_tasks t
        on t.run_id = i.run_id and t.step_slug = i.step_slug and t.task_index = i.task_index
      left join pgflow.runs r on r.run_id = i.run_id
      left join pgflow.step_states ss on ss.run_id = i.run_id and ss.step_slug = i.step_slug
      left join pgflow.steps s on s.flow_slug = t.flow_slug and s.step_slug = t.step_slug
    ) x
  ) c;

  if v_normal is not null then
    -- Tasks, then their messages.
    with done as (
      update pgflow.step_tasks t
      set status = 'completed', completed_at = now(), output = i.output
      from unnest(p_run_ids, p_step_slugs, p_task_indexes, p_outputs)
             with ordinality as i(run_id, step_slug, task_index, output, ord)
      where i.ord = any (v_normal)
        and t.run_id = i.run_id and t.step_slug = i.step_slug and t.task_index = i.task_index
      returning t.queue_name, t.message_id
    )
    select array_agg(d.queue_name), array_agg(d.message_id) into v_queue, v_msg from done d;
    perform pgflow._queue_op(g.queue_name, 'archive', g.ids)
    from (select q.queue_name, array_agg(q.msg) as ids
          from unnest(v_queue, v_msg) as q(queue_name, msg)
          where q.msg is not null
          group by q.queue_name) g;
    v_applied := v_normal;

    -- Step counters; a step whose last task finished completes with its output (a map: the task outputs in
    -- task order).
    with counted as (
      select i.run_id, i.step_slug, count(*)::int as n
      from unnest(p_run_ids, p_step_slugs) with ordinality as i(run_id, step_slug, ord)
      where i.ord = any (v_normal)
      group by i.run_id, i.step_slug
    ),
    counted_down as (
      update pgflow.step_states ss
      set remaining_tasks = ss.remaining_tasks - c.n,
          status = case when ss.remaining_tasks - c.n = 0 then 'completed' else ss.status end,
          completed_at = case when ss.remaining_tasks - c.n = 0 then now() end,
          output = case
            when ss.remaining_tasks - c.n > 0 then null
            when s.step_type = 'map' then (
              select jsonb_agg(t.output order by t.task_index) from pgflow.step_tasks t
              where t.run_id = ss.run_id and t.step_slug = ss.step_slug)
            else (select t.output from pgflow.step_tasks t
                  where t.run_id = ss.run_id and t.step_slug = ss.step_slug and t.task_index = 0)
          end
      from counted c, pgflow.steps s
      where ss.run_id = c.run_id and ss.step_slug = c.step_slug
        and s.flow_slug = ss.flow_slug and s.step_slug = ss.step_slug
      returning ss.run_id, ss.step_slug, ss.flow_slug, ss.status,
                case when s.step_type = 'map' then ss.initial_tasks
                     when jsonb_typeof(ss.output) = 'array' then jsonb_array_length(ss.output) end as child_tasks
    )
    select array_agg(x.run_id), array_agg(x.step_slug), array_agg(x.flow_slug), array_agg(x.child_tasks)
    into v_done_runs, v_done_steps, v_done_flows, v_done_children
    from counted_down x
    where x.status = 'completed';
  end if;

  if v_done_runs is not null then
    v_events := pgflow._step_events_enabled();
    if v_events then
      for v_done in
        select ss.run_id, ss.step_slug, ss.output, ss.completed_at
        from unnest(v_done_runs, v_done_steps) as d(run_id, step_slug)
        join pgflow.step_states ss on ss.run_id = d.run_id and ss.step_slug = d.step_slug
        order by ss.run_id, ss.step_slug
      loop
        perform pgflow._emit('step:' || v_done.step_slug || ':completed', v_done.run_id, jsonb_build_object(
          'event_type', 'step:completed',
          'run_id', v_done.run_id,
          'step_slug', v_done.step_slug,
          'status', 'completed',
          'output', v_done.output,
          'completed_at', v_done.completed_at
        ));
      end loop;
    end if;

    -- Dependents: one dependency fewer to wait for; a map dependent learns its task count. In a run whose
    -- newly ready steps take the plain start of _advance_runs (the run is started, none of its ready steps
    -- needs the cascade, and no step was ready before this release), those steps start in the same update;
    -- their tasks are created below. Other runs with ready steps go through _advance_runs.
    with rel as (
      select dn.run_id, d.step_slug as child, count(*)::int as n, max(dn.child_tasks) as child_tasks
      from unnest(v_done_runs, v_done_steps, v_done_flows, v_done_children)
             as dn(run_id, step_slug, flow_slug, child_tasks)
      join pgflow.deps d on d.flow_slug = dn.flow_slug and d.dep_slug = dn.step_slug
      group by dn.run_id, d.step_slug
    ),
    next as (
      select rel.run_id, rel.child, rel.n, x.initial_tasks, x.ready,
             x.ready and c.status = 'created' as startable,
             x.ready and c.status = 'created'
               and pgflow._needs_cascade(x.initial_tasks, cs.required_input_pattern, cs.forbidden_input_pattern)
               as cascade,
             r.status = 'started' as run_started
      from rel
      join pgflow.runs r on r.run_id = rel.run_id
      join pgflow.step_states c on c.run_id = rel.run_id and c.step_slug = rel.child
      join pgflow.steps cs on cs.flow_slug = c.flow_slug and cs.step_slug = c.step_slug
      cross join lateral (
        select case when cs.step_type = 'map' and c.initial_tasks is null then rel.child_tasks
                    else c.initial_tasks end as initial_tasks,
               c.remaining_deps - rel.n = 0 as ready
      ) x
    ),
    -- Per run: whether its newly ready steps take the plain start.
    plain as materialized (
      select n.run_id,
             bool_or(n.ready) and bool_and(n.run_started) and not bool_or(n.cascade)
               and not exists (select 1 from pgflow.step_states w
                               where w.run_id = n.run_id and w.status = 'created' and w.remaining_deps = 0)
               as plain
      from next n
      group by n.run_id
    ),
    -- Per step: whether it starts now (a created step with tasks, newly ready in a plain run).
    decided as (
      select n.run_id, n.child, n.n, n.initial_tasks, n.ready, p.plain,
             p.plain and n.startable and n.initial_tasks > 0 as start
      from next n
      join plain p on p.run_id = n.run_id
    ),
    released as (
      update pgflow.step_states c
      set remaining_deps = c.remaining_deps - d.n,
          initial_tasks = d.initial_tasks,
          status = case when d.start then 'started' else c.status end,
          started_at = case when d.start then now() else c.started_at end,
          remaining_tasks = case when d.start then d.initial_tasks else c.remaining_tasks end
      from decided d
      where c.run_id = d.run_id and c.step_slug = d.child
      returning c.run_id, c.step_slug, d.ready, d.plain, d.start, c.started_at, c.remaining_tasks
    )
    select array_agg(r.run_id order by r.run_id, r.step_slug) filter (where r.start),
           array_agg(r.step_slug order by r.run_id, r.step_slug) filter (where r.start),
           array_agg(r.started_at order by r.run_id, r.step_slug) filter (where r.start),
           array_agg(r.remaining_tasks order by r.run_id, r.step_slug) filter (where r.start),
           array_agg(distinct r.run_id) filter (where r.ready and not r.plain)
    into v_start_runs, v_start_steps, v_start_ats, v_start_tasks, v_ready_runs
    from released r;

    with counted as (
      select d.run_id, count(*)::int as n from unnest(v_done_runs) as d(run_id) group by d.run_id
    ),
    counted_down as (
      update pgflow.runs r
      set remaining_steps = r.remaining_steps - c.n
      from counted c
      where r.run_id = c.run_id
      returning r.run_id, r.remaining_steps
    )
    select array_agg(c.run_id) filter (where c.remaining_steps = 0) into v_finished_runs from counted_down c;

    -- The steps started above: their events, in run and step order, then their tasks (as _start_ready_steps).
    if v_start_runs is not null then
      if v_events then
        for v_i in 1 .. cardinality(v_start_runs) loop
          perform pgflow._emit_step_started(v_start_runs[v_i], v_start_steps[v_i], v_start_ats[v_i],
                                            v_start_tasks[v_i], 0);
        end loop;
      end if;
      perform pgflow._create_step_tasks(v_start_runs, v_start_steps);
    end if;

    -- The other runs with newly ready steps go through _advance_runs. Runs whose steps are all done have
    -- nothing to start (_advance_runs would only complete them) and complete directly.
    if v_ready_runs is not null then
      perform pgflow._advance_runs(v_ready_runs);
    end if;
    if v_finished_runs is not null then
      perform pgflow._complete_runs(v_finished_runs);
    end if;
  end if;

  -- The rare paths, one item at a time (the locks are held).
  if v_exceptions is not null then
    foreach v_ord in array v_exceptions loop
      if pgflow._complete_task_exception(p_run_ids[v_ord], p_step_slugs[v_ord], p_task_indexes[v_ord],
                                         p_outputs[v_ord]) then
        v_applied := v_applied || v_ord;
      end if;
    end loop;
  end if;

  return query
  select i.ord::int, i.ord = any (v_applied), t
  from unnest(p_run_ids, p_step_slugs, p_task_indexes) with ordinality as i(run_id, step_slug, task_index, ord)
  join pgflow.step_tasks t on t.run_id = i.run_id and t.step_slug = i.step_slug and t.task_index = i.task_index
  order by i.ord;
end;
$$;

-- Upstream's completion, unfenced, through the one implementation. Always returns the task row; for a task that
-- is not `started`, or of a run that is not started, nothing changes.
create function pgflow.complete_task(run_id uuid, step_slug text, task_index integer, output jsonb)
returns setof pgflow.step_tasks
language sql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
as $$
  select pgflow._replan_if_grown();
  select (c.task).*
  from pgflow._complete_tasks(array[complete_task.run_id], array[complete_task.step_slug],
                              array[complete_task.task_index], array[complete_task.output], array[null::int],
                              null) c;
$$;

-- The fenced completion of one task (see the top of this file), through the one implementation.
create function pgflow.complete_task(run_id uuid, step_slug text, task_index integer, output jsonb, attempt integer, worker_id uuid default NULL::uuid)
returns setof pgflow.task_outcome
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
as $$
begin
  perform pgflow._replan_if_grown();
  if attempt is null then
    raise exception 'complete_task(): attempt is required by the fenced form'
      using errcode = 'invalid_parameter_value',
            hint = 'Pass the attempt the claim returned, or call the four-argument complete_task.';
  end if;
  return query
  select (c.task).run_id, (c.task).step_slug, (c.task).task_index,
         case when c.applied then 'applied' else 'stale' end,
         (c.task).status, (c.task).attempts_count, (c.task).last_worker_id
  from pgflow._complete_tasks(array[complete_task.run_id], array[complete_task.step_slug],
                              array[complete_task.task_index], array[complete_task.output],
                              array[complete_task.attempt], complete_task.worker_id) c;
end;
$$;

-- The fenced batch, set-based: one outcome row per item that names an existing task, in the order given.
create function pgflow.complete_tasks(run_ids uuid[], step_slugs text[], task_indexes integer[], outputs jsonb[], attempts integer[], worker_id uuid default NULL::uuid)
returns setof pgflow.task_outcome
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
as $$
begin
  perform pgflow._replan_if_grown();
  if cardinality(run_ids) is distinct from cardinality(step_slugs)
     or cardinality(run_ids) is distinct from cardinality(task_indexes)
     or cardinality(run_ids) is distinct from cardinality(outputs)
     or cardinality(run_ids) is distinct from cardinality(attempts) then
    raise exception 'complete_tasks(): array lengths differ (run_ids %, step_slugs %, task_indexes %, outputs %, attempts %)',
      cardinality(run_ids), cardinality(step_slugs), cardinality(task_indexes), cardinality(outputs),
      cardinality(attempts)
      using errcode = 'invalid_parameter_value';
  end if;
  if array_position(attempts, null) is not null then
    raise exception 'complete_tasks(): attempts[%] is NULL', array_position(attempts, null)
      using errcode = 'invalid_parameter_value',
            hint = 'Every item needs the attempt its claim returned.';
  end if;
  return query
  select (c.task).run_id, (c.task).step_slug, (c.task).task_index,
         case when c.applied then 'applied' else 'stale' end,
         (c.task).status, (c.task).attempts_count, (c.task).last_worker_id
  from pgflow._complete_tasks(complete_tasks.run_ids, complete_tasks.step_slugs, complete_tasks.task_indexes,
                              complete_tasks.outputs, complete_tasks.attempts, complete_tasks.worker_id) c
  order by c.ord;
end;
$$;

-- Upstream's failure: records a started task's failure, unfenced: retry with exponential backoff while attempts
-- remain, otherwise apply the step's when_exhausted (fail the run, or skip the step / skip it with its
-- dependents). Always returns the task row; for a task that is not `started`, or of a run that is not started,
-- nothing changes.
create function pgflow.fail_task(run_id uuid, step_slug text, task_index integer, error_message text)
returns setof pgflow.step_tasks
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
as $$
declare
  v_task pgflow.step_tasks;
begin
  select (f.task).* into v_task
  from pgflow._fail_task(fail_task.run_id, fail_task.step_slug, fail_task.task_index, fail_task.error_message,
                         false, null, null, null) f;
  if v_task.run_id is not null then
    return next v_task;
  end if;
end;
$$;

-- The fenced failure, with the handler's two decisions:
--   attempt, worker_id     the fence (see the top of this file)
--   retry_delay_seconds    when the task is retried, its message becomes visible after this many seconds instead
--                          of the step's exponential backoff (capped at one day)
--   terminal               no retry: the task fails as if its attempts were used up; when_exhausted applies
-- Returns one task_outcome row ('applied' or 'stale'); no row when the task does not exist.
create function pgflow.fail_task(run_id uuid, step_slug text, task_index integer, error_message text, attempt integer, worker_id uuid default NULL::uuid, retry_delay_seconds integer default NULL::integer, terminal boolean default false)
returns setof pgflow.task_outcome
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
as $$
declare
  v_result record;
begin
  if attempt is null then
    raise exception 'fail_task(): attempt is required by the fenced form'
      using errcode = 'invalid_parameter_value',
            hint = 'Pass the attempt the claim returned, or call the four-argument fail_task.';
  end if;
  select f.applied, f.task into v_result
  from pgflow._fail_task(fail_task.run_id, fail_task.step_slug, fail_task.task_index, fail_task.error_message,
                         coalesce(fail_task.terminal, false), fail_task.attempt, fail_task.worker_id,
                         fail_task.retry_delay_seconds) f;
  if (v_result.task).run_id is not null then
    return next ((v_result.task).run_id, (v_result.task).step_slug, (v_result.task).task_index,
                 case when v_result.applied then 'applied' else 'stale' end,
                 (v_result.task).status, (v_result.task).attempts_count,
                 (v_result.task).last_worker_id)::pgflow.task_outcome;
  end if;
end;
$$;

-- Records the worker's finished outputs (fenced, exactly as complete_tasks: item i = run_ids[i],
-- done_step_slugs[i], task_indexes[i], outputs[i], attempts[i]; empty arrays: none), then reads and claims up
-- to `qty` messages of `queue_name` for the worker's (flow_slugs[j], step_slugs[j]) pairs, exactly as
-- read_and_claim_tasks (qty 0: no claim), in one transaction. Returns the rows of both, completions first:
--   outcome 'applied' | 'stale'   one row per completion item naming an existing task: run_id, step_slug,
--                                 task_index, attempts_count (the task's current attempt) and status
--   the claim's rows              as read_and_claim_tasks
-- When the claim finds an unsupported batch, the completions are still recorded (they are the worker's own
-- results); only the claim changes nothing. The completions' task creation is marked as the exchange's (the
-- transaction-local setting pgflow.signal_source) for pgflow._signal_queues, which also learns the exchange's
-- worker; the mark is cleared before the claim. Plans are reset first when the tables have grown
-- (pgflow._replan_if_grown).
create function pgflow.exchange(queue_name text, worker_id uuid, flow_slugs text[], step_slugs text[], qty integer, vt integer, run_ids uuid[], done_step_slugs text[], task_indexes integer[], outputs jsonb[], attempts integer[])
returns table(outcome text, msg_id bigint, flow_slug text, run_id uuid, step_slug text, task_index integer, input jsonb, flow_input jsonb, attempts_count integer, timeout integer, report jsonb, status text)
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
as $$
begin
  perform pgflow._replan_if_grown();
  if coalesce(cardinality(exchange.run_ids), 0) > 0 then
    if array_position(exchange.attempts, null) is not null
       or cardinality(exchange.attempts) is distinct from cardinality(exchange.run_ids) then
      raise exception 'exchange(): every completion needs the attempt its claim returned'
        using errcode = 'invalid_parameter_value';
    end if;
    perform set_config('pgflow.signal_source', 'exchange', true);
    perform set_config('pgflow.signal_worker', exchange.worker_id::text, true);
    return query
    select case when c.applied then 'applied' else 'stale' end, null::bigint, (c.task).flow_slug,
           (c.task).run_id, (c.task).step_slug, (c.task).task_index, null::jsonb, null::jsonb,
           (c.task).attempts_count, null::int, null::jsonb, (c.task).status
    from pgflow._complete_tasks(exchange.run_ids, exchange.done_step_slugs, exchange.task_indexes,
                                exchange.outputs, exchange.attempts, exchange.worker_id) c
    order by c.ord;
    perform set_config('pgflow.signal_source', '', true);
    perform set_config('pgflow.signal_worker', '', true);
  end if;
  if coalesce(exchange.qty, 0) > 0 then
    return query
    select c.outcome, c.msg_id, c.flow_slug, c.run_id, c.step_slug, c.task_index, c.input, c.flow_input,
           c.attempts_count, c.timeout, c.report, null::text
    from pgflow.read_and_claim_tasks(exchange.queue_name, exchange.qty, exchange.vt, exchange.worker_id,
                                     exchange.flow_slugs, exchange.step_slugs) c;
  end if;
end;
$$;

-- ==== schema/09_deployments.sql ====
-- Deployments: aliases over immutable versions, named shared queues, and coverage.
--
-- Owns: the one namespace of flow slugs and aliases, activating an alias, resolving an alias to its version,
-- checking and provisioning named shared queues, and the questions an operator asks before a rollout or a
-- retirement (queue_coverage_gaps, version_retirable).

-- Raises PF018 when a new concrete slug is already an alias of another flow.
create function pgflow._assert_slug_not_alias(p_flow_slug text)
returns void
language plpgsql
stable
set search_path = ''
as $$
declare
  v_alias record;
begin
  select a.alias, a.flow_slug into v_alias
  from pgflow.flow_aliases a
  where lower(a.alias) = lower(p_flow_slug) and a.flow_slug <> p_flow_slug
  limit 1;
  if found then
    raise exception 'Flow slug "%" is already the alias "%" of flow "%".', p_flow_slug, v_alias.alias,
        v_alias.flow_slug
      using errcode = 'PF018',
            detail = 'start_flow resolves aliases first, so runs of the new flow could never be started by its slug.',
            hint = 'Choose another concrete slug (aliases name versions; concrete slugs carry the version).';
  end if;
end;
$$;

-- Raises PF018 unless `p_alias` may name `p_flow_slug`: it is a valid slug and no other concrete flow has it
-- (in any letter case) as its slug.
create function pgflow._assert_alias_allowed(p_alias text, p_flow_slug text)
returns void
language plpgsql
stable
set search_path = ''
as $$
declare
  v_other text;
begin
  if not pgflow.is_valid_slug(p_alias) then
    raise exception 'Alias "%" of flow "%" is not a valid slug.', coalesce(p_alias, 'NULL'), p_flow_slug
      using errcode = 'invalid_parameter_value',
            hint = 'A slug starts with a letter or underscore, continues with letters, digits or underscores, and has at most 128 characters.';
  end if;
  select f.flow_slug into v_other
  from pgflow.flows f
  where lower(f.flow_slug) = lower(p_alias) and f.flow_slug <> p_flow_slug
  limit 1;
  if found then
    raise exception 'Alias "%" cannot point at flow "%": it is the concrete slug of flow "%".', p_alias,
        p_flow_slug, v_other
      using errcode = 'PF018',
            detail = 'start_flow resolves aliases first, so the alias would hide that flow.',
            hint = 'Choose an alias that is no flow''s concrete slug (a name without a version suffix, for example).';
  end if;
end;
$$;

-- Raises PF016 when any of `p_queues` (private queues of flow p_flow_slug: its default queue or generated step
-- queues) is a shared queue.
create function pgflow._assert_not_shared(p_flow_slug text, p_queues text[])
returns void
language plpgsql
stable
set search_path = ''
as $$
declare
  v_queue text;
begin
  select sq.queue_name into v_queue
  from pgflow.shared_queues sq
  where sq.queue_name = any (p_queues)
  limit 1;
  if found then
    raise exception 'Queue "%" of flow "%" is a shared queue.', v_queue, p_flow_slug
      using errcode = 'PF016',
            detail = 'Named routes share it; a flow''s default queue and its generated step queues are private to it.',
            hint = 'Choose another concrete flow slug, or route the flow''s steps to the shared queue by name (queue mode ''named'').';
  end if;
end;
$$;

-- Raises PF014 unless `p_queue` (named for step `p_step` of flow `p_flow`) is a valid queue name: a lowercase
-- identifier ([a-z_][a-z0-9_]*) of at most 47 characters, which pgmq.validate_queue_name and
-- pgmq.format_table_name then also accept.
create function pgflow._check_named_queue(p_flow text, p_step text, p_queue text)
returns void
language plpgsql
stable
set search_path = ''
as $$
begin
  if p_queue is null or p_queue !~ '^[a-z_][a-z0-9_]*$' or length(p_queue) > pgflow._max_queue_name_length() then
    raise exception 'Queue "%" named for step "%" of flow "%" is not a valid queue name.', coalesce(p_queue, 'NULL'),
        p_step, p_flow
      using errcode = 'PF014',
            detail = format('A queue name is a lowercase identifier (letters a-z, digits, underscores; not starting with a digit) of 1 to %s characters; this one has %s.',
                            pgflow._max_queue_name_length(), coalesce(length(p_queue), 0)),
            hint = 'Name the queue in lowercase with letters, digits and underscores only, at most 47 characters.';
  end if;
  perform pgmq.validate_queue_name(p_queue);
end;
$$;

-- Checks, before any mutation, that flow `p_flow_slug` may route steps `p_steps[i]` to the named queues
-- `p_queues[i]`: each queue is not private to any flow (PF016: a flow-mode flow's default queue, or a
-- step-mode flow's generated queue), and is either already shared, or new, or (with p_adopt) an existing PGMQ
-- queue pgflow did not create (else PF017). Returns the queues that will be adopted.
create function pgflow._check_shared_queues(p_flow_slug text, p_steps text[], p_queues text[], p_adopt boolean)
returns text[]
language plpgsql
stable
set search_path = ''
as $$
declare
  v_queue text;
  v_step text;
  v_other record;
  v_meta text;
  v_adopt text[] := '{}';
  i int;
begin
  for i in 1 .. coalesce(cardinality(p_queues), 0) loop
    v_queue := p_queues[i];
    v_step := p_steps[i];
    if v_queue = any (v_adopt) then
      continue;
    end if;

    select f.flow_slug into v_other
    from pgflow.flows f
    where f.queue_mode = 'flow' and lower(f.flow_slug) = v_queue
    limit 1;
    if found then
      raise exception 'Queue "%" named for step "%" of flow "%" is private to another flow.', v_queue, v_step,
          p_flow_slug
        using errcode = 'PF016',
              detail = format('It is the default queue of flow "%s".', v_other.flow_slug),
              hint = 'Name another queue: a flow''s own queues are never shared.';
    end if;
    select s.flow_slug, s.step_slug into v_other
    from pgflow.steps s
    join pgflow.flows f on f.flow_slug = s.flow_slug
    where s.queue_name = v_queue and f.queue_mode = 'step'
    limit 1;
    if found then
      raise exception 'Queue "%" named for step "%" of flow "%" is private to another flow.', v_queue, v_step,
          p_flow_slug
        using errcode = 'PF016',
              detail = format('It is the generated queue of step "%s" in flow "%s".', v_other.step_slug, v_other.flow_slug),
              hint = 'Name another queue: a flow''s own queues are never shared.';
    end if;

    if exists (select 1 from pgflow.shared_queues sq where sq.queue_name = v_queue) then
      continue;
    end if;
    v_meta := pgflow._queue_meta_name(v_queue);
    if v_meta is null then
      continue;
    end if;
    if v_meta <> v_queue then
      raise exception 'Queue "%" named for step "%" of flow "%" collides with the PGMQ queue "%".', v_queue, v_step,
          p_flow_slug, v_meta
        using errcode = 'PF016',
              detail = 'The names differ only in letter case, and PGMQ queue tables are case-insensitive.',
              hint = 'Name the queue exactly as PGMQ spells it, or name another queue.';
    end if;
    if not coalesce(p_adopt, false) then
      raise exception 'Queue "%" named for step "%" of flow "%" exists in PGMQ, but pgflow did not create it.',
          v_queue, v_step, p_flow_slug
        using errcode = 'PF017',
              detail = 'An existing queue may hold messages that are not pgflow tasks; a worker would stop on them.',
              hint = 'If the queue is meant for pgflow (and empty, or holding only pgflow tasks), compile with adopt_queues => true; otherwise name another queue.';
    end if;
    v_adopt := v_adopt || v_queue;
  end loop;
  return v_adopt;
end;
$$;

-- Creates (or registers, when adopted) every shared queue of a named route map. Idempotent; recreates a shared
-- queue that was dropped by hand (its message ids continue after the recorded ones, see _ensure_queue).
create function pgflow._provision_shared_queues(p_queues text[], p_adopted text[])
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_queue text;
begin
  for v_queue in select distinct q from unnest(p_queues) as q order by 1 loop
    perform pgflow._ensure_queue(v_queue);
    insert into pgflow.shared_queues (queue_name, adopted)
    values (v_queue, v_queue = any (coalesce(p_adopted, '{}')))
    on conflict (queue_name) do nothing;
  end loop;
end;
$$;

-- Points `p_alias` at `p_flow_slug` (the caller has persisted the flow's complete shape and routing in this
-- transaction, under its concrete-slug lock). Idempotent: an alias already pointing there is left as it is.
-- Otherwise the previous target is recorded, activated_at is now, and the event `alias:activated` goes out
-- through pgflow._emit. Returns {"alias", "flow_slug", "previous_flow_slug", "activated_at", "activated"}.
create function pgflow._activate_alias(p_alias text, p_flow_slug text)
returns jsonb
language plpgsql
set search_path = ''
as $$
declare
  v_current pgflow.flow_aliases;
begin
  perform pg_advisory_xact_lock(3, hashtext(lower(p_alias)));
  perform pgflow._assert_alias_allowed(p_alias, p_flow_slug);

  select a.* into v_current from pgflow.flow_aliases a where lower(a.alias) = lower(p_alias);
  if found and v_current.alias <> p_alias then
    raise exception 'Alias "%" differs only in case from the existing alias "%".', p_alias, v_current.alias
      using errcode = 'PF018',
            hint = 'Use the existing alias''s exact spelling.';
  end if;
  if found and v_current.flow_slug = p_flow_slug then
    return jsonb_build_object('alias', p_alias, 'flow_slug', p_flow_slug,
      'previous_flow_slug', v_current.previous_flow_slug, 'activated_at', v_current.activated_at,
      'activated', false);
  end if;

  insert into pgflow.flow_aliases as a (alias, flow_slug, activated_at, previous_flow_slug)
  values (p_alias, p_flow_slug, clock_timestamp(), null)
  on conflict (alias) do update
    set flow_slug = excluded.flow_slug, activated_at = excluded.activated_at,
        previous_flow_slug = a.flow_slug
  returning a.* into v_current;

  perform pgflow._emit('alias:activated', null, jsonb_build_object(
    'event_type', 'alias:activated',
    'alias', v_current.alias,
    'flow_slug', v_current.flow_slug,
    'previous_flow_slug', v_current.previous_flow_slug,
    'activated_at', v_current.activated_at
  ));
  return jsonb_build_object('alias', v_current.alias, 'flow_slug', v_current.flow_slug,
    'previous_flow_slug', v_current.previous_flow_slug, 'activated_at', v_current.activated_at,
    'activated', true);
end;
$$;

-- Points `alias` at the compiled concrete flow `flow_slug` (idempotent; records the previous target; emits
-- alias:activated). Returns {"alias", "flow_slug", "previous_flow_slug", "activated_at", "activated"}.
-- Raises PF019 for a flow that is not compiled, PF018 for an alias that is not allowed (see
-- _assert_alias_allowed).
create function pgflow.activate_alias(alias text, flow_slug text)
returns jsonb
language plpgsql
security definer
set search_path = ''
as $$
begin
  -- The concrete-slug lock first (as compilation takes it), then the alias lock inside _activate_alias.
  perform pg_advisory_xact_lock(1, hashtext(lower(activate_alias.flow_slug)));
  perform 1 from pgflow.flows f where f.flow_slug = activate_alias.flow_slug for key share;
  if not found then
    raise exception 'Alias "%" cannot point at flow "%": no flow has that slug.', activate_alias.alias,
        activate_alias.flow_slug
      using errcode = 'PF019',
            hint = 'Compile the flow first (start a worker that serves it, or call pgflow.ensure_flow_compiled), then activate its alias.';
  end if;
  return pgflow._activate_alias(activate_alias.alias, activate_alias.flow_slug);
end;
$$;

-- The concrete flow slug a name resolves to: an alias's target (aliases first), else the name itself.
create function pgflow.resolve_flow_slug(flow_slug text)
returns text
language plpgsql
stable
set search_path = ''
as $$
begin
  return coalesce(
    (select a.flow_slug from pgflow.flow_aliases a where a.alias = resolve_flow_slug.flow_slug),
    resolve_flow_slug.flow_slug);
end;
$$;

-- Every (flow_slug, step_slug) pair that any consumer of `queue_name` must be able to run, with the reason that
-- makes it required (a pair can appear once per reason):
--   'active_alias'   a step routed to the queue of a concrete version an alias points at: new runs start it
--   'started_run'    a step routed to the queue, not finished yet in a started run: that run may still create
--                    its task there
--   'task_snapshot'  a queued (executable) or started (recoverable) task snapshotted in the queue
-- With `count` (aliases, runs or tasks) and up to three `examples` (alias names, run ids, or
-- {"run_id", "msg_id"} objects). Reads only aliases, definitions and started runs or steps: the cost follows the
-- work in flight, not the history.
create function pgflow._queue_requirements(p_queue text)
returns table(flow_slug text, step_slug text, reason text, count bigint, examples jsonb)
language sql
stable
set search_path = ''
as $$
  select s.flow_slug, s.step_slug, 'active_alias', count(*),
         coalesce(jsonb_path_query_array(jsonb_agg(to_jsonb(a.alias) order by a.alias), '$[0 to 2]'), '[]')
  from pgflow.flow_aliases a
  join pgflow.steps s on s.flow_slug = a.flow_slug
  where s.queue_name = lower(p_queue)
  group by s.flow_slug, s.step_slug
  union all
  select x.flow_slug, x.step_slug, 'started_run', count(*),
         coalesce(jsonb_path_query_array(jsonb_agg(to_jsonb(x.run_id) order by x.started_at), '$[0 to 2]'), '[]')
  from (
    select ss.flow_slug, ss.step_slug, r.run_id, r.started_at
    from pgflow.runs r
    join pgflow.step_states ss on ss.run_id = r.run_id
    join pgflow.steps s on s.flow_slug = ss.flow_slug and s.step_slug = ss.step_slug
    where r.status = 'started' and ss.status in ('created', 'started') and s.queue_name = lower(p_queue)
  ) x
  group by x.flow_slug, x.step_slug
  union all
  select t.flow_slug, t.step_slug, 'task_snapshot', count(*),
         coalesce(jsonb_path_query_array(
           jsonb_agg(jsonb_build_object('run_id', t.run_id, 'msg_id', t.message_id) order by t.message_id),
           '$[0 to 2]'), '[]')
  from pgflow.step_states ss
  join pgflow.step_tasks t on t.run_id = ss.run_id and t.step_slug = ss.step_slug
  where ss.status = 'started' and t.queue_name = lower(p_queue) and t.status in ('queued', 'started')
  group by t.flow_slug, t.step_slug;
$$;

-- The startup coverage check: given the queue a worker polls and the (flow_slugs[i], step_slugs[i]) pairs it can
-- run, every required pair (see _queue_requirements) it lacks, with the reason, a count, up to three examples
-- and how to repair the gap. No row: the worker covers everything the queue can carry. Workers call it after
-- compiling and before registering, and refuse to start on any row.
create function pgflow.queue_coverage_gaps(queue_name text, flow_slugs text[], step_slugs text[])
returns table(flow_slug text, step_slug text, reason text, count bigint, examples jsonb, repair text)
language sql
stable security definer
set search_path = ''
as $$
  select q.flow_slug, q.step_slug, q.reason, q.count, q.examples,
         case q.reason
           when 'active_alias' then format(
             'Flow "%s" is the active version of alias %s and routes step "%s" to queue "%s": include that version in this worker''s registry.',
             q.flow_slug, q.examples ->> 0, q.step_slug, lower(queue_coverage_gaps.queue_name))
           when 'started_run' then format(
             '%s started run(s) of flow "%s" may still create step "%s" tasks on queue "%s": keep that version''s handlers in this worker until pgflow.version_retirable(''%s'', ''%s'') says it has drained.',
             q.count, q.flow_slug, q.step_slug, lower(queue_coverage_gaps.queue_name), q.flow_slug,
             lower(queue_coverage_gaps.queue_name))
           else format(
             '%s task(s) of flow "%s" step "%s" wait or run on queue "%s": keep that version''s handlers in this worker until they finish.',
             q.count, q.flow_slug, q.step_slug, lower(queue_coverage_gaps.queue_name))
         end
  from pgflow._queue_requirements(queue_coverage_gaps.queue_name) q
  where not exists (
    select 1 from unnest(queue_coverage_gaps.flow_slugs, queue_coverage_gaps.step_slugs) as p(flow_slug, step_slug)
    where p.flow_slug = q.flow_slug and p.step_slug = q.step_slug)
  order by q.flow_slug, q.step_slug, q.reason;
$$;

-- Whether concrete version `flow_slug` can be retired from queue `queue_name` (its handlers removed from the
-- workers of that queue): no alias points at it with a step routed there, no started run of it can still
-- reach the queue, and no executable or recoverable task of it remains there. Returns
--   {"flow_slug", "queue_name", "retirable", "blockers": [{"step_slug", "reason", "count", "examples"}]}
create function pgflow.version_retirable(flow_slug text, queue_name text)
returns jsonb
language sql
stable security definer
set search_path = ''
as $$
  select jsonb_build_object(
    'flow_slug', version_retirable.flow_slug,
    'queue_name', lower(version_retirable.queue_name),
    'retirable', count(q.*) = 0,
    'blockers', coalesce(jsonb_agg(jsonb_build_object('step_slug', q.step_slug, 'reason', q.reason,
                                                      'count', q.count, 'examples', q.examples)
                                   order by q.step_slug, q.reason) filter (where q.flow_slug is not null),
                         '[]'::jsonb))
  from pgflow._queue_requirements(version_retirable.queue_name) q
  where q.flow_slug = version_retirable.flow_slug;
$$;

-- ==== schema/10_workers.sql ====
-- Workers, worker functions and heartbeats.
--
-- Owns: registering a worker with the exact (flow, step) pairs it serves, heartbeats, stopping, the worker
-- function fence (a disabled function's workers claim nothing), releasing a stopping worker's tasks, and the
-- view pgflow.queue_coverage.

-- The window in which a worker's heartbeat counts as live (coverage monitoring). Workers heartbeat far more
-- often (the Rust runtime: every few seconds); a worker silent for longer is treated as gone.
create function pgflow._worker_liveness_window()
returns interval
language sql
immutable parallel safe
as $$ select interval '30 seconds' $$;

-- The state of a worker function as JSON: {"function_name", "enabled", "disabled_reason", "disabled_at"}.
-- A function never tracked is enabled.
create function pgflow._worker_function_state(p_function_name text)
returns jsonb
language sql
stable
set search_path = ''
as $$
  select jsonb_build_object(
    'function_name', p_function_name,
    'enabled', coalesce((select wf.enabled from pgflow.worker_functions wf where wf.function_name = p_function_name), true),
    'disabled_reason', (select wf.disabled_reason from pgflow.worker_functions wf where wf.function_name = p_function_name),
    'disabled_at', (select wf.disabled_at from pgflow.worker_functions wf where wf.function_name = p_function_name));
$$;

-- Upstream's track_worker_function (upsert; never re-enables a disabled function), now returning the
-- function's state so a restarted worker learns that it is fenced:
--   {"function_name", "enabled", "disabled_reason", "disabled_at"}
-- (Upstream returns void; callers that ignore the result are unaffected.)
create function pgflow.track_worker_function(function_name text)
returns jsonb
language plpgsql
security definer
set search_path = ''
as $$
begin
  insert into pgflow.worker_functions (function_name, updated_at, last_invoked_at)
  values (track_worker_function.function_name, clock_timestamp(), null)
  on conflict on constraint worker_functions_pkey do update set updated_at = clock_timestamp();
  return pgflow._worker_function_state(track_worker_function.function_name);
end;
$$;

-- Registers (or re-registers) a worker for one queue and the exact (flow_slugs[i], step_slugs[i]) pairs it
-- runs from it, after compiling every flow it serves. A worker function may serve several flows. Every pair
-- must be a persisted route to the queue (else PF020, MESSAGE / DETAIL / HINT). Records the worker (queue in
-- lowercase, heartbeat now, not stopped) and its pairs, tracks the function, and returns
--   {"worker_id", "queue_name", "pairs": [[flow, step], ...], "function_name", "enabled", "disabled_reason",
--    "disabled_at"}
-- A worker whose function is disabled (enabled = false) must stop without claiming.
create function pgflow.register_worker(worker_id uuid, function_name text, queue_name text, flow_slugs text[], step_slugs text[])
returns jsonb
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_queue text := lower(register_worker.queue_name);
  v_bad record;
  v_state jsonb;
begin
  if cardinality(register_worker.flow_slugs) is distinct from cardinality(register_worker.step_slugs)
     or coalesce(cardinality(register_worker.flow_slugs), 0) = 0 then
    raise exception 'register_worker(): give the same number (at least one) of flow_slugs and step_slugs, got % and %',
      cardinality(register_worker.flow_slugs), cardinality(register_worker.step_slugs)
      using errcode = 'invalid_parameter_value';
  end if;

  select p.flow_slug, p.step_slug, s.queue_name as route, f.flow_slug as flow
  into v_bad
  from unnest(register_worker.flow_slugs, register_worker.step_slugs) as p(flow_slug, step_slug)
  left join pgflow.flows f on f.flow_slug = p.flow_slug
  left join pgflow.steps s on s.flow_slug = p.flow_slug and s.step_slug = p.step_slug
  where s.queue_name is distinct from v_queue
  limit 1;
  if found then
    if v_bad.flow is null then
      raise exception 'Worker subscription for flow "%" cannot be registered: the flow does not exist.', v_bad.flow_slug
        using errcode = 'PF020',
              hint = 'Call pgflow.ensure_flow_compiled() before registering workers.';
    elsif v_bad.route is null then
      raise exception 'Worker subscription for step "%" of flow "%" cannot be registered: the flow has no such step.',
          v_bad.step_slug, v_bad.flow_slug
        using errcode = 'PF020',
              hint = 'The worker''s flow definition differs from the compiled one; deploy matching code.';
    else
      raise exception 'Worker subscription for flow "%" step "%" cannot be registered on queue "%".',
          v_bad.flow_slug, v_bad.step_slug, v_queue
        using errcode = 'PF020',
              detail = format('The persisted route of the step is the queue "%s".', v_bad.route),
              hint = 'Poll the queue that ensure_flow_compiled() persisted (pgflow.flow_routes()), or register only the steps routed to this queue.';
    end if;
  end if;

  v_state := pgflow.track_worker_function(register_worker.function_name);

  insert into pgflow.workers as w (worker_id, queue_name, function_name, started_at, last_heartbeat_at, stopped_at)
  values (register_worker.worker_id, v_queue, register_worker.function_name, clock_timestamp(),
          clock_timestamp(), null)
  on conflict on constraint workers_pkey do update
    set queue_name = excluded.queue_name, function_name = excluded.function_name,
        last_heartbeat_at = excluded.last_heartbeat_at, stopped_at = null;

  delete from pgflow.worker_routes wr where wr.worker_id = register_worker.worker_id;
  insert into pgflow.worker_routes (worker_id, flow_slug, step_slug)
  select distinct register_worker.worker_id, p.flow_slug, p.step_slug
  from unnest(register_worker.flow_slugs, register_worker.step_slugs) as p(flow_slug, step_slug);

  return v_state || jsonb_build_object(
    'worker_id', register_worker.worker_id, 'queue_name', v_queue,
    'pairs', (select jsonb_agg(jsonb_build_array(p.flow_slug, p.step_slug))
              from unnest(register_worker.flow_slugs, register_worker.step_slugs) as p(flow_slug, step_slug)));
end;
$$;

-- A worker's heartbeat: last_heartbeat_at = now. Returns its function's state and its own
--   {"function_name", "enabled", "disabled_reason", "disabled_at", "deprecated", "revived"}
-- so running workers of a function fenced elsewhere stop too, and a deprecated worker drains; NULL for an
-- unknown worker. A worker that recovery declared dead (its heartbeat went missing, see
-- requeue_dead_worker_tasks) but is still alive is registered again here ("revived": true): its tasks were
-- already recovered, and its late results for them are fenced.
create function pgflow.worker_heartbeat(worker_id uuid)
returns jsonb
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_function text;
  v_deprecated boolean;
  v_revived boolean;
begin
  update pgflow.workers w
  set last_heartbeat_at = clock_timestamp(), stopped_at = null
  from (select o.worker_id, o.stopped_at is not null as was_stopped
        from pgflow.workers o where o.worker_id = worker_heartbeat.worker_id for update) old
  where w.worker_id = old.worker_id
  returning w.function_name, w.deprecated_at is not null, old.was_stopped
  into v_function, v_deprecated, v_revived;
  if v_function is null then
    return null;
  end if;
  return pgflow._worker_function_state(v_function)
    || jsonb_build_object('deprecated', v_deprecated, 'revived', v_revived);
end;
$$;

create function pgflow.mark_worker_stopped(worker_id uuid)
returns void
language sql
security definer
set search_path = ''
as $$
  update pgflow.workers w set stopped_at = clock_timestamp() where w.worker_id = mark_worker_stopped.worker_id;
$$;

-- Lifts the fence (an operator, after fixing the cause or completing a replacement): enabled, reason cleared.
create function pgflow.enable_worker_function(function_name text)
returns jsonb
language plpgsql
set search_path = ''
as $$
begin
  insert into pgflow.worker_functions as wf (function_name, enabled, updated_at)
  values (enable_worker_function.function_name, true, clock_timestamp())
  on conflict on constraint worker_functions_pkey do update
    set enabled = true, disabled_reason = null, disabled_at = null, updated_at = clock_timestamp();
  return pgflow._worker_function_state(enable_worker_function.function_name);
end;
$$;

-- The fence. Persistently disables a worker function (a deployment unit: one binary or service) with the
-- reason recorded. A worker calls it before a fatal stop (an unsupported claim batch); operators call it
-- before replacing a deployment in place. While disabled:
--   * claim_tasks claims nothing for the function's workers (outcome "disabled", the batch visible again);
--   * track_worker_function, register_worker and worker_heartbeat report enabled = false, so a restarted
--     worker stops before claiming.
-- Idempotent: disabling a disabled function keeps the first reason and time (the root cause).
-- Returns the state JSON (as track_worker_function).
create function pgflow.disable_worker_function(function_name text, reason text)
returns jsonb
language plpgsql
security definer
set search_path = ''
as $$
begin
  insert into pgflow.worker_functions as wf (function_name, enabled, disabled_reason, disabled_at, updated_at)
  values (disable_worker_function.function_name, false,
          coalesce(disable_worker_function.reason, 'disabled'), clock_timestamp(), clock_timestamp())
  on conflict on constraint worker_functions_pkey do update
    set enabled = false,
        disabled_reason = case when wf.enabled then excluded.disabled_reason else coalesce(wf.disabled_reason, excluded.disabled_reason) end,
        disabled_at = case when wf.enabled then excluded.disabled_at else coalesce(wf.disabled_at, excluded.disabled_at) end,
        updated_at = clock_timestamp();
  return pgflow._worker_function_state(disable_worker_function.function_name);
end;
$$;

-- Hands back every task the worker still has `started` (a graceful shutdown that could not finish them):
-- the task is `queued` again with its attempt given back, and its message is visible at once, so another
-- worker picks it up without waiting for recovery. The tasks are found through the work in flight, not the
-- worker's history; messages are locked before tasks (0011_claims.sql). Returns the number of tasks released.
--
-- An attempt number given back is used again by the next claim; the fence still tells the two claims apart
-- because the next claim records another worker (workers pass their worker_id with every result).
create function pgflow.release_worker_tasks(worker_id uuid)
returns integer
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_group record;
  v_locked bigint[];
  v_count int := 0;
begin
  for v_group in
    select c.queue_name, array_agg(c.message_id order by c.message_id) as ids
    from pgflow._started_tasks() c
    where c.last_worker_id = release_worker_tasks.worker_id
      and c.permanently_stalled_at is null and c.message_id is not null
    group by c.queue_name
    order by c.queue_name
  loop
    v_locked := pgflow._lock_messages(v_group.queue_name, v_group.ids);
    with mine as (
      select t.run_id, t.step_slug, t.task_index
      from pgflow.step_tasks t
      where t.queue_name = v_group.queue_name and t.message_id = any (v_locked)
        and t.status = 'started' and t.last_worker_id = release_worker_tasks.worker_id
      order by t.message_id
      for update
    ),
    released as (
      update pgflow.step_tasks t
      set status = 'queued',
          started_at = null,
          last_worker_id = null,
          attempts_count = greatest(t.attempts_count - 1, 0)
      from mine m
      where t.run_id = m.run_id and t.step_slug = m.step_slug and t.task_index = m.task_index
      returning t.message_id
    )
    select coalesce(array_agg(r.message_id), '{}') into v_locked from released r;
    if cardinality(v_locked) > 0 then
      perform pgmq.set_vt(v_group.queue_name, v_locked, 0);
      v_count := v_count + cardinality(v_locked);
    end if;
  end loop;
  return v_count;
end;
$$;

-- pgflow.queue_coverage: every persisted route, one row per step of every flow, in step order,
-- with the live workers that cover it: a worker polling the route's queue that registered the route's
-- (flow, step) pair, or that registered no pairs at all (a worker registered the upstream way serves its whole
-- queue). Counting reads only started step states, never task history.
create view pgflow.queue_coverage as
select s.flow_slug,
       s.step_slug,
       s.step_index,
       f.queue_mode,
       s.queue_name,
       coalesce(t.queued, 0) as queued_tasks,
       coalesce(t.started, 0) as started_tasks,
       t.oldest_queued_at,
       now() - t.oldest_queued_at as oldest_queued_age,
       coalesce(w.live, 0) as live_workers,
       coalesce(w.ids, '{}'::uuid[]) as live_worker_ids,
       coalesce(t.queued, 0) > 0 and coalesce(w.live, 0) = 0 as uncovered
from pgflow.steps s
join pgflow.flows f on f.flow_slug = s.flow_slug
left join lateral (
  select count(*) filter (where st.status = 'queued') as queued,
         count(*) filter (where st.status = 'started') as started,
         min(st.queued_at) filter (where st.status = 'queued') as oldest_queued_at
  from pgflow.step_states ss
  join pgflow.step_tasks st on st.run_id = ss.run_id and st.step_slug = ss.step_slug
  where ss.flow_slug = s.flow_slug and ss.step_slug = s.step_slug and ss.status = 'started'
) t on true
left join lateral (
  select count(*) as live, array_agg(wk.worker_id order by wk.worker_id) as ids
  from pgflow.workers wk
  left join pgflow.worker_functions wf on wf.function_name = wk.function_name
  where wk.queue_name = s.queue_name
    and (exists (select 1 from pgflow.worker_routes wr
                 where wr.worker_id = wk.worker_id and wr.flow_slug = s.flow_slug and wr.step_slug = s.step_slug)
         or not exists (select 1 from pgflow.worker_routes wr where wr.worker_id = wk.worker_id))
    and wk.stopped_at is null
    and wk.last_heartbeat_at > now() - pgflow._worker_liveness_window()
    and coalesce(wf.enabled, true)
) w on true;

comment on view pgflow.queue_coverage is
  'Every persisted route (flow, step, queue mode, queue) with queued/started task counts, the oldest queued task, and live covering workers; uncovered = queued work and no live worker.';

-- ==== schema/11_maintenance.sql ====
-- Maintenance: recovery of stalled tasks and dead workers' tasks, and retention.
--
-- Owns: requeueing tasks whose worker stopped answering (stall timeout or dead heartbeat), marking tasks that
-- stalled too often as permanently stalled, pruning finished history, and run_maintenance, which workers call
-- one at a time under the maintenance lock (try-only, never waited for).

-- Key of the advisory lock that lets one caller at a time run recovery and retention ("pgflow-rq").
create function pgflow._maintenance_lock_key()
returns bigint
language sql
immutable parallel safe
as $$ select 8099555070761726577::bigint $$;

-- The started tasks, found through started step states (idx_step_states_started), so the cost follows the
-- work in flight, never the task history. With the effective timeout and max_attempts of each task's step.
create function pgflow._started_tasks()
returns table(queue_name text, message_id bigint, run_id uuid, step_slug text, task_index integer, started_at timestamp with time zone, last_worker_id uuid, attempts_count integer, permanently_stalled_at timestamp with time zone, effective_timeout integer, max_attempts integer)
language sql
stable
set search_path = ''
as $$
  select t.queue_name, t.message_id, t.run_id, t.step_slug, t.task_index, t.started_at, t.last_worker_id,
         t.attempts_count, t.permanently_stalled_at,
         coalesce(s.opt_timeout, f.opt_timeout), coalesce(s.opt_max_attempts, f.opt_max_attempts)
  from pgflow.step_states ss
  join pgflow.runs r on r.run_id = ss.run_id and r.status = 'started'
  join pgflow.step_tasks t on t.run_id = ss.run_id and t.step_slug = ss.step_slug and t.status = 'started'
  join pgflow.steps s on s.flow_slug = ss.flow_slug and s.step_slug = ss.step_slug
  join pgflow.flows f on f.flow_slug = ss.flow_slug
  where ss.status = 'started';
$$;

-- The operator's decision for a permanently stalled task (requeued 3 times, still never finished):
--   * action 'retry': the task goes back to `queued` with a fresh message in its own queue and a new
--     requeue budget; its attempts_count is kept;
--   * action 'fail': the task fails as if it had exhausted its attempts (the step's when_exhausted applies:
--     fail the run, skip the step, or skip it with its dependents).
-- Returns the task row afterwards.
create function pgflow.resolve_stalled_task(run_id uuid, step_slug text, task_index integer, action text, error_message text default 'Task stalled permanently'::text)
returns setof pgflow.step_tasks
language plpgsql
set search_path = ''
as $$
declare
  v_task pgflow.step_tasks;
  v_msg_id bigint;
begin
  if action is null or action not in ('fail', 'retry') then
    raise exception 'resolve_stalled_task(): action must be ''fail'' or ''retry'', got %', coalesce(quote_literal(action), 'NULL');
  end if;

  perform 1 from pgflow.runs r where r.run_id = resolve_stalled_task.run_id for no key update;

  select t.* into v_task
  from pgflow.step_tasks t
  where t.run_id = resolve_stalled_task.run_id and t.step_slug = resolve_stalled_task.step_slug
    and t.task_index = resolve_stalled_task.task_index
  for update;

  if v_task.run_id is null then
    raise exception 'resolve_stalled_task(): no task (run_id %, step %, task_index %)',
      resolve_stalled_task.run_id, resolve_stalled_task.step_slug, resolve_stalled_task.task_index;
  end if;
  if v_task.status <> 'started' or v_task.permanently_stalled_at is null then
    raise exception 'resolve_stalled_task(): task (run_id %, step %, task_index %) is not permanently stalled (status %)',
      v_task.run_id, v_task.step_slug, v_task.task_index, v_task.status
      using hint = 'Only tasks marked by requeue_stalled_tasks() (permanently_stalled_at set) can be resolved.';
  end if;

  if action = 'fail' then
    return query
    select (f.task).* from pgflow._fail_task(v_task.run_id, v_task.step_slug, v_task.task_index, error_message,
                                             true, null, null, null) f;
    return;
  end if;

  select pgmq.send(v_task.queue_name, jsonb_build_object(
    'flow_slug', v_task.flow_slug,
    'run_id', v_task.run_id,
    'step_slug', v_task.step_slug,
    'task_index', v_task.task_index)) into v_msg_id;

  update pgflow.step_tasks t
  set status = 'queued', started_at = null, last_worker_id = null, message_id = v_msg_id,
      requeued_count = 0, permanently_stalled_at = null, last_requeued_at = now()
  where t.run_id = v_task.run_id and t.step_slug = v_task.step_slug and t.task_index = v_task.task_index
  returning t.* into v_task;

  return next v_task;
end;
$$;

-- Requeues started tasks whose worker went silent: a task is stalled once it has been started for longer than
-- its effective step timeout (coalesce(step, flow)) plus pgflow._stall_buffer_seconds(). Only tasks of started
-- runs and started steps are considered. Safe to call concurrently: rows another caller holds are skipped.
--   * fewer than 3 requeues so far: back to `queued`, message visible now, requeued_count + 1 (the attempt
--     that stalled stays counted; as upstream, the next claim counts another one);
--   * otherwise: permanently_stalled_at is set and the message archived; the task stays `started` until an
--     operator decides with resolve_stalled_task().
-- Returns the number of tasks requeued.
create function pgflow.requeue_stalled_tasks()
returns integer
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_requeued int := 0;
  v_group record;
  v_locked bigint[];
  v_result record;
begin
  for v_group in
    select c.queue_name, array_agg(c.message_id order by c.message_id) as ids
    from pgflow._started_tasks() c
    where c.permanently_stalled_at is null and c.message_id is not null
      and pgflow._recovery_boundary(c.started_at, c.effective_timeout) < now()
    group by c.queue_name
    order by c.queue_name
  loop
    v_locked := pgflow._lock_messages(v_group.queue_name, v_group.ids, true);
    with stalled as (
      select t.run_id, t.step_slug, t.task_index
      from pgflow.step_tasks t
      where t.queue_name = v_group.queue_name and t.message_id = any (v_locked)
        and t.status = 'started' and t.permanently_stalled_at is null
      order by t.message_id
      for update skip locked
    ),
    changed as (
      update pgflow.step_tasks t
      set status = case when t.requeued_count < 3 then 'queued' else t.status end,
          started_at = case when t.requeued_count < 3 then null else t.started_at end,
          last_worker_id = case when t.requeued_count < 3 then null else t.last_worker_id end,
          requeued_count = case when t.requeued_count < 3 then t.requeued_count + 1 else t.requeued_count end,
          last_requeued_at = case when t.requeued_count < 3 then now() else t.last_requeued_at end,
          permanently_stalled_at = case when t.requeued_count < 3 then null else now() end
      from stalled x
      where t.run_id = x.run_id and t.step_slug = x.step_slug and t.task_index = x.task_index
      returning t.message_id, t.status
    )
    select array_agg(c.message_id) filter (where c.status = 'queued') as requeue,
           array_agg(c.message_id) filter (where c.status <> 'queued') as stalled
    into v_result
    from changed c;
    if v_result.requeue is not null then
      perform pgmq.set_vt(v_group.queue_name, v_result.requeue, 0);
      v_requeued := v_requeued + cardinality(v_result.requeue);
    end if;
    if v_result.stalled is not null then
      perform pgmq.archive(v_group.queue_name, v_result.stalled);
    end if;
  end loop;

  return v_requeued;
end;
$$;

-- Fast recovery from dead workers. A worker whose heartbeat is older than `dead_after` (and that has not
-- stopped) is dead: it is marked stopped, and each task it still has `started` is recovered at once instead of
-- waiting for the step timeout plus the stall buffer:
--   * with attempts left: back to `queued`, its message visible now, requeued_count + 1; the attempt the dead
--     worker used stays counted, and the next claim counts the next one (no extra attempt is consumed);
--   * with no attempt left (attempts_count >= max_attempts): the task fails as exhausted with the error
--     "worker <id> stopped responding during the last attempt", and the step's when_exhausted applies; a task
--     never runs more than max_attempts times this way.
-- A worker that was only slow (a long pause, a lost connection) is safe too: its late results are fenced to the
-- attempt and come back 'stale'. Returns the number of tasks recovered (requeued or failed).
create function pgflow.requeue_dead_worker_tasks(dead_after interval)
returns integer
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_dead uuid[];
  v_task record;
  v_group record;
  v_locked bigint[];
  v_count int := 0;
  v_n int;
begin
  if dead_after is null or dead_after <= interval '0' then
    raise exception 'requeue_dead_worker_tasks(): dead_after must be a positive interval, got %', dead_after
      using errcode = 'invalid_parameter_value';
  end if;

  -- Mark newly silent workers stopped (monitoring then stops counting them; a worker that was only slow sees
  -- it at its next heartbeat and registers again).
  update pgflow.workers w
  set stopped_at = clock_timestamp()
  where w.stopped_at is null and w.last_heartbeat_at < clock_timestamp() - dead_after;

  -- Every silent worker that still holds started tasks, found through the work in flight.
  select array_agg(distinct c.last_worker_id) into v_dead
  from pgflow._started_tasks() c
  join pgflow.workers w on w.worker_id = c.last_worker_id
  where c.permanently_stalled_at is null and w.last_heartbeat_at < clock_timestamp() - dead_after;

  if v_dead is null then
    return 0;
  end if;

  -- The last attempt died with its worker: fail it (run row, then message, then task, in run order).
  for v_task in
    select c.run_id, c.step_slug, c.task_index, c.attempts_count, c.max_attempts, c.last_worker_id
    from pgflow._started_tasks() c
    where c.last_worker_id = any (v_dead) and c.permanently_stalled_at is null
      and c.attempts_count >= c.max_attempts
    order by c.run_id, c.step_slug, c.task_index
  loop
    if (select f.applied from pgflow._fail_task(v_task.run_id, v_task.step_slug, v_task.task_index,
          format('worker %s stopped responding during the last attempt (%s of %s)', v_task.last_worker_id,
                 v_task.attempts_count, v_task.max_attempts),
          true, v_task.attempts_count, v_task.last_worker_id, null) f) then
      v_count := v_count + 1;
    end if;
  end loop;

  -- The others go back to the queue (message, then task).
  for v_group in
    select c.queue_name, array_agg(c.message_id order by c.message_id) as ids
    from pgflow._started_tasks() c
    where c.last_worker_id = any (v_dead) and c.permanently_stalled_at is null and c.message_id is not null
      and c.attempts_count < c.max_attempts
    group by c.queue_name
    order by c.queue_name
  loop
    v_locked := pgflow._lock_messages(v_group.queue_name, v_group.ids, true);
    with orphaned as (
      select t.run_id, t.step_slug, t.task_index
      from pgflow.step_tasks t
      where t.queue_name = v_group.queue_name and t.message_id = any (v_locked)
        and t.status = 'started' and t.last_worker_id = any (v_dead)
      order by t.message_id
      for update skip locked
    ),
    requeued as (
      update pgflow.step_tasks t
      set status = 'queued', started_at = null, last_worker_id = null,
          requeued_count = t.requeued_count + 1, last_requeued_at = now()
      from orphaned o
      where t.run_id = o.run_id and t.step_slug = o.step_slug and t.task_index = o.task_index
      returning t.message_id
    )
    select coalesce(array_agg(r.message_id), '{}') into v_locked from requeued r;
    v_n := cardinality(v_locked);
    if v_n > 0 then
      perform pgmq.set_vt(v_group.queue_name, v_locked, 0);
      v_count := v_count + v_n;
    end if;
  end loop;

  return v_count;
end;
$$;

-- Deletes all finished history older than the retention interval (upstream's maintenance query): calls
-- prune_history until nothing older is left. Prefer prune_history, or the workers' own retention, on a busy
-- database: this one runs in a single transaction however much there is.
create function pgflow.prune_data_older_than(retention_interval interval)
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_result jsonb;
begin
  loop
    v_result := pgflow.prune_history(retention_interval, 1000);
    exit when (v_result ->> 'runs')::int < 1000 and (v_result ->> 'archived_messages')::int < 10000
          and (v_result ->> 'workers')::int < 1000;
  end loop;
end;
$$;

-- Bounded retention: deletes at most `max_runs` runs that finished (completed or failed) before
-- now() - older_than, with their step states, tasks and the tasks' messages (live or archived, each in the
-- task's queue); at most `max_runs` * 10 archived messages older than the cutoff in each queue pgflow routes to;
-- and at most `max_runs` worker rows that stopped (or last beat) before the cutoff and that no retained task
-- names. Started runs, definitions and live workers are never touched. Returns {"runs", "archived_messages", "workers"}: how many rows went.
-- Call it again while any count equals its bound.
create function pgflow.prune_history(older_than interval, max_runs integer default 1000)
returns jsonb
language plpgsql
set search_path = ''
as $$
declare
  v_cutoff timestamptz := now() - older_than;
  v_run_ids uuid[];
  v_group record;
  v_queue text;
  v_n int;
  v_archived bigint := 0;
  v_workers int;
begin
  if older_than is null or older_than < interval '0' or coalesce(max_runs, 0) < 1 then
    raise exception 'prune_history(): older_than must be a non-negative interval and max_runs at least 1 (got %, %)',
      older_than, max_runs
      using errcode = 'invalid_parameter_value';
  end if;

  select array_agg(x.run_id) into v_run_ids
  from (
    select r.run_id
    from pgflow.runs r
    where r.status <> 'started' and coalesce(r.completed_at, r.failed_at) < v_cutoff
    order by coalesce(r.completed_at, r.failed_at)
    limit max_runs
    for update skip locked
  ) x;
  v_run_ids := coalesce(v_run_ids, '{}');

  for v_group in
    select t.queue_name, array_agg(t.message_id) as ids
    from pgflow.step_tasks t
    where t.run_id = any (v_run_ids) and t.message_id is not null
    group by t.queue_name
  loop
    if pgflow._queue_meta_name(v_group.queue_name) is not null then
      perform pgmq.delete(v_group.queue_name, v_group.ids);
      execute format('delete from pgmq.%I where msg_id = any ($1)',
                     pgmq.format_table_name(v_group.queue_name, 'a'))
      using v_group.ids;
    end if;
  end loop;

  delete from pgflow.step_tasks t where t.run_id = any (v_run_ids);
  delete from pgflow.step_states ss where ss.run_id = any (v_run_ids);
  delete from pgflow.runs r where r.run_id = any (v_run_ids);

  for v_queue in select distinct s.queue_name from pgflow.steps s order by 1 loop
    if pgflow._queue_meta_name(v_queue) is not null then
      execute format(
        'delete from pgmq.%1$I where msg_id in (
           select a.msg_id from pgmq.%1$I a where a.archived_at < $1 order by a.archived_at limit $2)',
        pgmq.format_table_name(v_queue, 'a'))
      using v_cutoff, max_runs * 10;
      get diagnostics v_n = row_count;
      v_archived := v_archived + v_n;
    end if;
  end loop;

  delete from pgflow.workers w
  where w.worker_id in (
    select o.worker_id from pgflow.workers o
    where coalesce(o.stopped_at, o.last_heartbeat_at) < v_cutoff
      -- Still named by a retained task: kept until that task goes, so a deletion never has to touch tasks.
      and not exists (select 1 from pgflow.step_tasks t where t.last_worker_id = o.worker_id)
    order by coalesce(o.stopped_at, o.last_heartbeat_at)
    limit max_runs
    for update skip locked);
  get diagnostics v_workers = row_count;

  return jsonb_build_object('runs', cardinality(v_run_ids), 'archived_messages', v_archived,
                            'workers', v_workers);
end;
$$;

-- One maintenance sweep, run by workers periodically; at most one caller at a time does the work (a
-- transaction-scoped advisory lock; the others return at once with "skipped": true):
--   * requeue_stalled_tasks();
--   * requeue_dead_worker_tasks(dead_after) when dead_after is given;
--   * prune_history(retain_for, prune_batch) when retain_for is given (one bounded batch per sweep);
--   * the run_watchers rows of sessions that have ended are removed.
-- Returns {"skipped", "stalled", "dead", "pruned": {...} | null}.
create function pgflow.run_maintenance(dead_after interval default NULL::interval, retain_for interval default NULL::interval, prune_batch integer default 1000)
returns jsonb
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_stalled int;
  v_dead int;
  v_pruned jsonb;
begin
  if not pg_try_advisory_xact_lock(pgflow._maintenance_lock_key()) then
    return jsonb_build_object('skipped', true, 'stalled', 0, 'dead', 0, 'pruned', null);
  end if;
  v_stalled := pgflow.requeue_stalled_tasks();
  v_dead := case when dead_after is null then 0 else pgflow.requeue_dead_worker_tasks(dead_after) end;
  if retain_for is not null then
    v_pruned := pgflow.prune_history(retain_for, prune_batch);
  end if;
  delete from pgflow.run_watchers w
  where not exists (select 1 from pg_catalog.pg_stat_activity a where a.pid = w.backend_pid);
  return jsonb_build_object('skipped', false, 'stalled', v_stalled, 'dead', v_dead, 'pruned', v_pruned);
end;
$$;

-- Schedules requeue_stalled_tasks() with pg_cron. Unlike upstream it is not run at install (pg_cron is
-- optional); it needs pg_cron only when called. Workers can instead call requeue_stalled_tasks() themselves.
create function pgflow.setup_requeue_stalled_tasks_cron(cron_interval text default '15 seconds'::text)
returns text
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_job_id bigint;
begin
  if to_regprocedure('cron.schedule(text,text,text)') is null then
    raise exception 'setup_requeue_stalled_tasks_cron(): pg_cron is not installed'
      using hint = 'Install pg_cron, or let workers call pgflow.requeue_stalled_tasks() periodically.';
  end if;
  begin
    execute 'select cron.unschedule($1)' using 'pgflow_requeue_stalled_tasks';
  exception when others then
    null;
  end;
  execute 'select cron.schedule($1, $2, $3)'
    into v_job_id
    using 'pgflow_requeue_stalled_tasks', cron_interval, 'select pgflow.requeue_stalled_tasks()';
  return format('Scheduled pgflow_requeue_stalled_tasks (every %s, job_id=%s)', cron_interval, v_job_id);
end;
$$;

-- ==== schema/12_privileges.sql ====
-- Privileges: nothing in schema pgflow is usable by PUBLIC; one list of functions per role.
--
-- The entry points a worker or a client calls run with the rights of their owner (the role that installed
-- pgflow: `security definer`, with an empty search_path, written in each function's own definition), so the
-- roles that call them need EXECUTE on exactly those functions and no rights on the tables or on PGMQ.
-- pgflow.grant_worker_privileges(role) and pgflow.grant_client_privileges(role) grant exactly the lists below
-- (OPERATIONS.md shows the same lists); everything else (definitions, deletion, the fence's enable side,
-- operator decisions, retention of all history) stays with the owner.

revoke all on schema pgflow from public;

-- The functions a worker calls: compilation, registration and heartbeats, claiming, results, recovery and
-- retention. Signatures as regprocedure text; a change that adds an entry point adds it here.
create function pgflow._worker_api()
returns text[]
language sql
immutable
as $$
  select array[
    'pgflow.ensure_flow_compiled(text,jsonb,boolean,text,jsonb,text,boolean)',
    'pgflow.activate_alias(text,text)',
    'pgflow.flow_routes(text)',
    'pgflow.resolve_step_queues(text,text[])',
    'pgflow.register_worker(uuid,text,text,text[],text[])',
    'pgflow.queue_coverage_gaps(text,text[],text[])',
    'pgflow.version_retirable(text,text)',
    'pgflow.track_worker_function(text)',
    'pgflow.worker_heartbeat(uuid)',
    'pgflow.mark_worker_stopped(uuid)',
    'pgflow.disable_worker_function(text,text)',
    'pgflow.claim_tasks(text,bigint[],uuid,text[],text[])',
    'pgflow.read_and_claim_tasks(text,integer,integer,uuid,text[],text[])',
    'pgflow.exchange(text,uuid,text[],text[],integer,integer,uuid[],text[],integer[],jsonb[],integer[])',
    'pgflow.start_tasks(text,bigint[],uuid)',
    'pgflow.start_tasks(text,bigint[],uuid,text)',
    'pgflow.set_vt_batch(text,bigint[],integer[])',
    'pgflow.complete_task(uuid,text,integer,jsonb)',
    'pgflow.complete_task(uuid,text,integer,jsonb,integer,uuid)',
    'pgflow.complete_tasks(uuid[],text[],integer[],jsonb[],integer[],uuid)',
    'pgflow.fail_task(uuid,text,integer,text)',
    'pgflow.fail_task(uuid,text,integer,text,integer,uuid,integer,boolean)',
    'pgflow.release_worker_tasks(uuid)',
    'pgflow.requeue_stalled_tasks()',
    'pgflow.requeue_dead_worker_tasks(interval)',
    'pgflow.run_maintenance(interval,interval,integer)'
  ]
$$;

-- The functions a client calls: start runs and read them.
create function pgflow._client_api()
returns text[]
language sql
immutable
as $$
  select array[
    'pgflow.start_flow(text,jsonb,uuid)',
    'pgflow.start_flows(text,jsonb[],uuid[])',
    'pgflow.start_flow_with_states(text,jsonb,uuid)',
    'pgflow.get_run_with_states(uuid)',
    'pgflow.run_channel(uuid)',
    'pgflow.resolve_flow_slug(text)',
    'pgflow.watch_run(uuid)',
    'pgflow.unwatch_run(uuid)'
  ]
$$;

-- Grants `role_name` what a pgflow-rs worker needs, and nothing more:
--   usage on schema pgflow; execute on pgflow._worker_api(); select on pgflow.schema_migrations (the worker's
--   schema-version check), pgflow.runs (StepContext::flow_input) and the view pgflow.queue_coverage.
-- Run it as the owner of the pgflow schema (the installing role), again after upgrades that add functions.
create function pgflow.grant_worker_privileges(role_name text)
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_fn text;
begin
  execute format('grant usage on schema pgflow to %I', role_name);
  foreach v_fn in array pgflow._worker_api() loop
    execute format('grant execute on function %s to %I', v_fn::regprocedure, role_name);
  end loop;
  execute format('grant select on pgflow.runs, pgflow.queue_coverage to %I', role_name);
  -- Created by the installer (pgflow_sql::install or the printed script) before the migrations.
  if to_regclass('pgflow.schema_migrations') is not null then
    execute format('grant select on pgflow.schema_migrations to %I', role_name);
  end if;
end;
$$;

-- Grants `role_name` what a client (starting runs, waiting for them, reading their state) needs:
--   usage on schema pgflow; execute on pgflow._client_api(); select on pgflow.runs and pgflow.step_states.
-- Run it as the owner of the pgflow schema.
create function pgflow.grant_client_privileges(role_name text)
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_fn text;
begin
  execute format('grant usage on schema pgflow to %I', role_name);
  foreach v_fn in array pgflow._client_api() loop
    execute format('grant execute on function %s to %I', v_fn::regprocedure, role_name);
  end loop;
  execute format('grant select on pgflow.runs, pgflow.step_states to %I', role_name);
end;
$$;

revoke execute on all functions in schema pgflow from public;
alter default privileges in schema pgflow revoke execute on functions from public;

