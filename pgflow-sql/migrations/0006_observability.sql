-- pgflow-rs SQL core: observability.
--
-- * The event log pgflow.events, written by pgflow._log_event: deferred reads, stale results, unsupported stops,
--   fences set and lifted, alias activations, permanently stalled tasks, exhausted tasks and failed runs, each
--   naming its cause; prune_history bounds it with the rest of the history.
-- * The channel pgflow_failures: one notification per exhausted task and per failed run.
-- * runs.trace_context: the W3C trace context a run was started in (the setting pgflow.trace_context), returned
--   by the claim with each task.
-- * pgflow.queue_stats(): depth, visible messages and oldest-message age per queue, for workers and clients.

alter table pgflow.runs add column trace_context jsonb;

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
  from pgflow.step_tasks t
  where t.queue_name = p_queue and t.message_id = any (p_ids)
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

revoke execute on all functions in schema pgflow from public;

create or replace function pgflow._claim_tasks(queue_name text, msg_ids bigint[], worker_id uuid, flow_slugs text[], step_slugs text[], read_vt integer)
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
    perform pgflow._log_event('unsupported_stop', 'claim', worker_id => _claim_tasks.worker_id,
                              queue_name => v_queue, detail => v_report);

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
  if v_defer_ids is not null then
    perform pgflow._log_deferred_reads(v_queue, v_defer_ids, _claim_tasks.worker_id);
  end if;

  if v_claim_ids is not null then
    return query
    select 'claimed'::text, c.msg_id, t.flow_slug, t.run_id, t.step_slug, t.task_index, i.input, i.flow_input,
           t.attempts_count, coalesce(s.opt_timeout, f.opt_timeout), r.trace_context
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

create or replace function pgflow._complete_tasks(
  p_run_ids uuid[],
  p_step_slugs text[],
  p_task_indexes int[],
  p_outputs jsonb[],
  p_attempts int[],
  p_worker_id uuid
)
returns table (ord int, applied boolean, task pgflow.step_tasks)
language plpgsql
volatile
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

  -- Lock order 3: the tasks' messages, per queue in message order. A completion that can fail its run cancels
  -- the run's other live tasks: their messages are locked here too, in the same order, never after the
  -- batch's own. It can when a single step's non-array output feeds a map that has no task count yet, or when
  -- it completes its step in a flow with a step that fails the run on an unmet condition.
  for v_group in
    with item as (
      select t.run_id, t.flow_slug, t.step_slug, t.queue_name, t.message_id, i.output,
             count(*) over (partition by t.run_id, t.step_slug) as n
      from unnest(p_run_ids, p_step_slugs, p_task_indexes, p_outputs) as i(run_id, step_slug, task_index, output)
      join pgflow.step_tasks t
        on t.run_id = i.run_id and t.step_slug = i.step_slug and t.task_index = i.task_index
    ),
    failing as (
      select distinct it.run_id
      from item it
      join pgflow.steps s on s.flow_slug = it.flow_slug and s.step_slug = it.step_slug
      where (s.step_type = 'single' and jsonb_typeof(it.output) is distinct from 'array'
             and exists (
               select 1
               from pgflow.deps d
               join pgflow.steps cs on cs.flow_slug = d.flow_slug and cs.step_slug = d.step_slug
               join pgflow.step_states cst on cst.run_id = it.run_id and cst.step_slug = d.step_slug
               where d.flow_slug = it.flow_slug and d.dep_slug = it.step_slug
                 and cs.step_type = 'map' and cst.initial_tasks is null))
         or (exists (select 1 from pgflow.step_states ss
                     where ss.run_id = it.run_id and ss.step_slug = it.step_slug and ss.remaining_tasks <= it.n)
             and exists (select 1 from pgflow.steps fs
                         where fs.flow_slug = it.flow_slug and fs.when_unmet = 'fail'
                           and (fs.required_input_pattern is not null or fs.forbidden_input_pattern is not null)))
    ),
    msg as (
      select it.queue_name, it.message_id from item it where it.message_id is not null
      union
      select o.queue_name, o.message_id
      from failing f
      join pgflow.step_tasks o on o.run_id = f.run_id
      where o.status in ('queued', 'started') and o.message_id is not null
    )
    select m.queue_name, array_agg(m.message_id order by m.message_id) as ids
    from msg m
    group by m.queue_name
    order by m.queue_name
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

  -- Results that changed nothing leave a trace in the event log.
  if coalesce(cardinality(v_applied), 0) < cardinality(p_run_ids) then
    perform pgflow._log_stale_results(p_run_ids, p_step_slugs, p_task_indexes, p_attempts, p_worker_id, v_applied);
  end if;

  return query
  select i.ord::int, i.ord = any (v_applied), t
  from unnest(p_run_ids, p_step_slugs, p_task_indexes) with ordinality as i(run_id, step_slug, task_index, ord)
  join pgflow.step_tasks t on t.run_id = i.run_id and t.step_slug = i.step_slug and t.task_index = i.task_index
  order by i.ord;
end;
$$;

create or replace function pgflow.fail_task(run_id uuid, step_slug text, task_index integer, error_message text, attempt integer, worker_id uuid default NULL::uuid, retry_delay_seconds integer default NULL::integer, terminal boolean default false)
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
  if (v_result.task).run_id is not null and not v_result.applied then
    perform pgflow._log_stale_results(array[fail_task.run_id], array[fail_task.step_slug],
                                      array[fail_task.task_index], array[fail_task.attempt], fail_task.worker_id,
                                      '{}');
  end if;
  if (v_result.task).run_id is not null then
    return next ((v_result.task).run_id, (v_result.task).step_slug, (v_result.task).task_index,
                 case when v_result.applied then 'applied' else 'stale' end,
                 (v_result.task).status, (v_result.task).attempts_count,
                 (v_result.task).last_worker_id)::pgflow.task_outcome;
  end if;
end;
$$;

create or replace function pgflow.prune_data_older_than(retention_interval interval)
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
          and (v_result ->> 'workers')::int < 1000 and (v_result ->> 'events')::int < 10000;
  end loop;
end;
$$;

create or replace function pgflow.prune_history(older_than interval, max_runs int default 1000)
returns jsonb
language plpgsql
volatile
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
    where r.status <> 'started' and coalesce(r.completed_at, r.failed_at, r.cancelled_at) < v_cutoff
    order by coalesce(r.completed_at, r.failed_at, r.cancelled_at)
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

  delete from pgflow.run_watchers w where w.run_id = any (v_run_ids);
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

  -- Idempotency keys past their window (the keys of the runs deleted above went with them).
  delete from pgflow.idempotency_keys k
  where (k.flow_name, k.idempotency_key) in (
    select o.flow_name, o.idempotency_key from pgflow.idempotency_keys o
    where o.expires_at < now()
    order by o.expires_at
    limit max_runs * 10);

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

  -- The event log: oldest first, at most max_runs * 10 per call, like archived messages.
  delete from pgflow.events e
  where e.event_id in (
    select o.event_id from pgflow.events o where o.occurred_at < v_cutoff
    order by o.occurred_at limit max_runs * 10);
  get diagnostics v_n = row_count;

  return jsonb_build_object('runs', cardinality(v_run_ids), 'archived_messages', v_archived,
                            'workers', v_workers, 'events', v_n);
end;
$$;

create or replace function pgflow._worker_api()
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
    'pgflow.run_maintenance(interval,interval,integer)',
    'pgflow.cancelled_tasks(uuid[],text[],integer[],integer[])',
    'pgflow.queue_stats()'
  ]
$$;

create or replace function pgflow._client_api()
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
    'pgflow.unwatch_run(uuid)',
    'pgflow.start_flows_with_keys(text,jsonb[],text[],uuid[],interval)',
    'pgflow.cancel_run(uuid,text)',
    'pgflow.cancel_runs(text,text,timestamp with time zone,text[],jsonb,text,integer)',
    'pgflow.retry_run(uuid,text)',
    'pgflow.replay_run(uuid,text)',
    'pgflow.queue_stats()'
  ]
$$;
