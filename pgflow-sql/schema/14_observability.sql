-- Observability: the event log, failure notifications, trace context of runs, and queue depth.
--
-- Owns: pgflow._log_event (the one writer of pgflow.events) and the triggers that log what the other files do
-- (fences set and lifted, alias activations, permanently stalled tasks, exhausted tasks and failed runs), the
-- failure channel `pgflow_failures`, the trigger that stores a run's W3C trace context, and queue_stats.
--
-- EVENT KINDS (pgflow.events.kind) and their causes (pgflow.events.cause):
--   deferred_read            a message read while its task runs under another claim; cause 'duplicate_visibility'
--   stale_result             a result that changed nothing; cause 'attempt_superseded' (the task runs again
--                            under a later attempt or another worker), 'task_<status>' (the task is finished)
--                            or 'run_<status>' (the run is)
--   unsupported_stop         a claim batch holding messages the worker must not run; the worker stops; cause
--                            'claim', detail = the claim's report
--   fence_set, fence_lifted  a worker function disabled or enabled; cause 'worker' (a worker's fatal stop),
--                            'worker_startup' or 'operator'
--   alias_activated          an alias moved to another version; cause 'worker_startup' or 'operator';
--                            detail.moved_back is true when it went back to the version it had before
--   task_stalled_permanently a started task whose message is gone; cause 'maintenance'
--   task_failed              a task failed for good; cause 'attempts_exhausted'
--   run_failed               a run failed; cause 'step_failed'
--   run_cancelled            a run cancelled (cancel_run, cancel_runs); detail.reason
--   run_retried              a run retried in place (retry_run); detail.retry_number, retried_by, previous_status
--   run_replayed             a run started as a replay (replay_run); detail.replay_of
-- Others may log more kinds through pgflow._log_event.
--
-- Causes that are not evident from the call come from the transaction-local setting `pgflow.cause`, the actor
-- from `pgflow.actor` (pgflow-rs workers set both); otherwise the cause is 'operator' and the actor the
-- session's role.

-- Appends one event. `cause` NULL: the setting pgflow.cause, else 'operator'. The actor is the setting
-- pgflow.actor, else the session's role.
create function pgflow._log_event(
  kind text,
  cause text default null,
  run_id uuid default null,
  flow_slug text default null,
  step_slug text default null,
  task_index int default null,
  worker_id uuid default null,
  queue_name text default null,
  detail jsonb default '{}'
)
returns void
language sql
volatile
set search_path = ''
as $$
  insert into pgflow.events (kind, cause, actor, run_id, flow_slug, step_slug, task_index, worker_id, queue_name,
                             detail)
  values (kind,
          coalesce(cause, nullif(current_setting('pgflow.cause', true), ''), 'operator'),
          coalesce(nullif(current_setting('pgflow.actor', true), ''), session_user::text),
          run_id, flow_slug, step_slug, task_index, worker_id, queue_name, coalesce(detail, '{}'))
$$;

-- Logs the deferred reads of a claim: the messages `p_ids` of queue `p_queue` whose tasks run elsewhere.
create function pgflow._log_deferred_reads(p_queue text, p_ids bigint[], p_worker_id uuid)
returns void
language sql
volatile
set search_path = ''
as $$
  insert into pgflow.events (kind, cause, actor, run_id, flow_slug, step_slug, task_index, worker_id, queue_name,
                             detail)
  select 'deferred_read', 'duplicate_visibility', p_worker_id::text, t.run_id, t.flow_slug, t.step_slug,
         t.task_index, p_worker_id, p_queue,
         jsonb_build_object('msg_id', t.message_id, 'attempt', t.attempts_count,
                            'running_worker_id', t.last_worker_id)
  -- One lookup per message (FINDING A MESSAGE'S TASK in 07_claims.sql).
  from unnest(p_ids) as m(id)
  cross join lateral (
    select t.* from pgflow.step_tasks t where t.queue_name = p_queue and t.message_id = m.id offset 0
  ) t
$$;

-- Logs the results of a completion batch that changed nothing (the items whose position is not in
-- `p_applied`; items naming no task are not logged).
create function pgflow._log_stale_results(
  p_run_ids uuid[],
  p_step_slugs text[],
  p_task_indexes int[],
  p_attempts int[],
  p_worker_id uuid,
  p_applied int[]
)
returns void
language sql
volatile
set search_path = ''
as $$
  insert into pgflow.events (kind, cause, actor, run_id, flow_slug, step_slug, task_index, worker_id, queue_name,
                             detail)
  select 'stale_result',
         case when r.status <> 'started' then 'run_' || r.status
              when t.status <> 'started' then 'task_' || t.status
              else 'attempt_superseded' end,
         coalesce(p_worker_id::text, session_user::text), t.run_id, t.flow_slug, t.step_slug, t.task_index,
         p_worker_id, t.queue_name,
         jsonb_build_object('attempt', p_attempts[i.ord], 'current_attempt', t.attempts_count,
                            'status', t.status, 'last_worker_id', t.last_worker_id)
  from unnest(p_run_ids, p_step_slugs, p_task_indexes) with ordinality as i(run_id, step_slug, task_index, ord)
  join pgflow.step_tasks t on t.run_id = i.run_id and t.step_slug = i.step_slug and t.task_index = i.task_index
  join pgflow.runs r on r.run_id = t.run_id
  where not (i.ord::int = any (coalesce(p_applied, '{}')))
$$;

------------------------------------------------------------------------------------------------------------
-- Failures: the event log and the channel pgflow_failures
------------------------------------------------------------------------------------------------------------

-- One NOTIFY on the channel `pgflow_failures` per failure, delivered on commit: a compact JSON object
-- {"kind": "task_failed" | "run_failed", "run_id", "flow_slug", "step_slug", "task_index" (task_failed),
-- "attempt" (task_failed), "error"} with the error cut to 4000 characters (NOTIFY payloads are limited).
create function pgflow._notify_failure(p_payload jsonb)
returns void
language sql
volatile
set search_path = ''
as $$
  select pg_notify('pgflow_failures',
                   jsonb_set(p_payload, '{error}', to_jsonb(left(p_payload ->> 'error', 4000)))::text)
$$;

create function pgflow._step_tasks_failed()
returns trigger
language plpgsql
set search_path = ''
as $$
begin
  perform pgflow._log_event('task_failed', 'attempts_exhausted', new.run_id, new.flow_slug, new.step_slug,
                            new.task_index, new.last_worker_id, new.queue_name,
                            jsonb_build_object('attempt', new.attempts_count, 'error', new.error_message));
  perform pgflow._notify_failure(jsonb_build_object(
    'kind', 'task_failed', 'run_id', new.run_id, 'flow_slug', new.flow_slug, 'step_slug', new.step_slug,
    'task_index', new.task_index, 'attempt', new.attempts_count, 'error', coalesce(new.error_message, '')));
  return null;
end;
$$;

create trigger step_tasks_failed
  after update of status on pgflow.step_tasks
  for each row when (new.status = 'failed' and old.status is distinct from 'failed')
  execute function pgflow._step_tasks_failed();

create function pgflow._runs_failed()
returns trigger
language plpgsql
set search_path = ''
as $$
declare
  v_step text;
  v_error text;
begin
  select ss.step_slug, ss.error_message into v_step, v_error
  from pgflow.step_states ss
  where ss.run_id = new.run_id and ss.status = 'failed'
  order by ss.failed_at, ss.step_slug
  limit 1;
  perform pgflow._log_event('run_failed', 'step_failed', new.run_id, new.flow_slug, v_step, null, null, null,
                            jsonb_build_object('error', v_error));
  perform pgflow._notify_failure(jsonb_build_object(
    'kind', 'run_failed', 'run_id', new.run_id, 'flow_slug', new.flow_slug, 'step_slug', v_step,
    'error', coalesce(v_error, '')));
  return null;
end;
$$;

create trigger runs_failed
  after update of status on pgflow.runs
  for each row when (new.status = 'failed' and old.status is distinct from 'failed')
  execute function pgflow._runs_failed();

------------------------------------------------------------------------------------------------------------
-- Cancellations, retries and replays (13_run_control.sql)
------------------------------------------------------------------------------------------------------------

-- Logs a run's cancellation (kind run_cancelled, detail.reason), by cancel_run or cancel_runs alike.
create function pgflow._runs_cancelled()
returns trigger
language plpgsql
set search_path = ''
as $$
begin
  perform pgflow._log_event('run_cancelled', null, new.run_id, new.flow_slug,
                            detail => jsonb_build_object('reason', new.cancel_reason));
  return null;
end;
$$;

create trigger runs_cancelled
  after update of status on pgflow.runs
  for each row when (new.status = 'cancelled' and old.status is distinct from 'cancelled')
  execute function pgflow._runs_cancelled();

-- Logs a retry in place (kind run_retried): its number, who asked for it and the status the run left.
create function pgflow._run_retries_logged()
returns trigger
language plpgsql
set search_path = ''
as $$
begin
  perform pgflow._log_event('run_retried', null, new.run_id,
                            (select r.flow_slug from pgflow.runs r where r.run_id = new.run_id),
                            detail => jsonb_build_object('retry_number', new.retry_number,
                                                         'retried_by', new.retried_by,
                                                         'previous_status', new.previous_status));
  return null;
end;
$$;

create trigger run_retries_logged
  after insert on pgflow.run_retries
  for each row execute function pgflow._run_retries_logged();

-- Logs a replay (kind run_replayed) on the new run, naming the run it replays.
create function pgflow._runs_replayed()
returns trigger
language plpgsql
set search_path = ''
as $$
begin
  perform pgflow._log_event('run_replayed', null, new.run_id, new.flow_slug,
                            detail => jsonb_build_object('replay_of', new.replay_of));
  return null;
end;
$$;

create trigger runs_replayed
  after insert on pgflow.runs
  for each row when (new.replay_of is not null)
  execute function pgflow._runs_replayed();

------------------------------------------------------------------------------------------------------------
-- Fences, aliases and stalled tasks
------------------------------------------------------------------------------------------------------------

create function pgflow._worker_functions_fence()
returns trigger
language plpgsql
set search_path = ''
as $$
begin
  perform pgflow._log_event(case when new.enabled then 'fence_lifted' else 'fence_set' end, null,
                            detail => jsonb_build_object('function_name', new.function_name,
                                                         'reason', new.disabled_reason));
  return null;
end;
$$;

create trigger worker_functions_fence_set
  after insert on pgflow.worker_functions
  for each row when (not new.enabled)
  execute function pgflow._worker_functions_fence();

create trigger worker_functions_fence_changed
  after update of enabled on pgflow.worker_functions
  for each row when (old.enabled is distinct from new.enabled)
  execute function pgflow._worker_functions_fence();

create function pgflow._flow_aliases_activated()
returns trigger
language plpgsql
set search_path = ''
as $$
begin
  perform pgflow._log_event('alias_activated', null, flow_slug => new.flow_slug,
                            detail => jsonb_build_object(
                              'alias', new.alias, 'previous_flow_slug', new.previous_flow_slug,
                              'moved_back', tg_op = 'UPDATE' and new.flow_slug is not distinct from old.previous_flow_slug));
  return null;
end;
$$;

create trigger flow_aliases_activated
  after insert on pgflow.flow_aliases
  for each row
  execute function pgflow._flow_aliases_activated();

create trigger flow_aliases_moved
  after update of flow_slug on pgflow.flow_aliases
  for each row when (old.flow_slug is distinct from new.flow_slug)
  execute function pgflow._flow_aliases_activated();

create function pgflow._step_tasks_stalled()
returns trigger
language plpgsql
set search_path = ''
as $$
begin
  perform pgflow._log_event('task_stalled_permanently', 'maintenance', new.run_id, new.flow_slug,
                            new.step_slug, new.task_index, new.last_worker_id, new.queue_name,
                            jsonb_build_object('attempt', new.attempts_count,
                                               'requeued_count', new.requeued_count));
  return null;
end;
$$;

create trigger step_tasks_stalled
  after update of permanently_stalled_at on pgflow.step_tasks
  for each row when (old.permanently_stalled_at is null and new.permanently_stalled_at is not null)
  execute function pgflow._step_tasks_stalled();

------------------------------------------------------------------------------------------------------------
-- Trace context
------------------------------------------------------------------------------------------------------------

-- Stores the transaction-local setting pgflow.trace_context (a JSON object: {"traceparent": "00-...",
-- "tracestate": ...}) with each run started in that transaction. The claim returns it with every task.
create function pgflow._runs_trace_context()
returns trigger
language plpgsql
set search_path = ''
as $$
declare
  v_text text := current_setting('pgflow.trace_context', true);
begin
  begin
    new.trace_context := v_text::jsonb;
  exception when invalid_text_representation then
    new.trace_context := null;
  end;
  if jsonb_typeof(new.trace_context) is distinct from 'object'
     or jsonb_typeof(new.trace_context -> 'traceparent') is distinct from 'string' then
    raise exception 'The setting pgflow.trace_context is not a trace context: %', left(v_text, 200)
      using errcode = 'invalid_parameter_value',
            hint = 'Set it to a JSON object with a W3C "traceparent" string, or leave it empty.';
  end if;
  return new;
end;
$$;

create trigger runs_trace_context
  before insert on pgflow.runs
  for each row when (new.trace_context is null
                     and coalesce(current_setting('pgflow.trace_context', true), '') <> '')
  execute function pgflow._runs_trace_context();

------------------------------------------------------------------------------------------------------------
-- Queue depth
------------------------------------------------------------------------------------------------------------

-- Depth of every queue pgflow sends tasks to (the steps' queues and the shared queues): messages in it,
-- messages visible now, and the age in seconds of its oldest message (NULL when empty). One count per queue
-- table: cheap enough for a scrape every few seconds. Queues whose table is missing are left out.
create function pgflow.queue_stats()
returns table(queue_name text, depth bigint, visible bigint, oldest_age_seconds double precision)
language plpgsql
stable
security definer
set search_path = ''
as $$
declare
  v_queue text;
begin
  for v_queue in
    select s.queue_name from pgflow.steps s
    union
    select q.queue_name from pgflow.shared_queues q
    order by 1
  loop
    if to_regclass(format('pgmq.%I', pgmq.format_table_name(v_queue, 'q'))) is not null then
      return query execute format(
        'select $1, count(*), count(*) filter (where m.vt <= clock_timestamp()),
                extract(epoch from clock_timestamp() - min(m.enqueued_at))::double precision
         from pgmq.%I m', pgmq.format_table_name(v_queue, 'q'))
      using v_queue;
    end if;
  end loop;
end;
$$;

-- Nothing here is PUBLIC's: queue_stats is granted to the worker and client roles (12_privileges.sql).
revoke execute on all functions in schema pgflow from public;
