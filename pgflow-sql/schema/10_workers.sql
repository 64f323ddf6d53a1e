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
--   {"function_name", "enabled", "disabled_reason", "disabled_at", "deprecated", "revived", "peers"}
-- so running workers of a function fenced elsewhere stop too, and a deprecated worker drains. "peers" counts
-- the live workers of its queue (itself included while it is live and not deprecated): the Rust worker shares
-- its exchanges in flight out among them (WorkerConfig::completion_flushers). NULL for an
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
  v_queue text;
  v_deprecated boolean;
  v_revived boolean;
begin
  update pgflow.workers w
  set last_heartbeat_at = clock_timestamp(), stopped_at = null
  from (select o.worker_id, o.stopped_at is not null as was_stopped
        from pgflow.workers o where o.worker_id = worker_heartbeat.worker_id for update) old
  where w.worker_id = old.worker_id
  returning w.function_name, w.queue_name, w.deprecated_at is not null, old.was_stopped
  into v_function, v_queue, v_deprecated, v_revived;
  if v_function is null then
    return null;
  end if;
  return pgflow._worker_function_state(v_function)
    || jsonb_build_object('deprecated', v_deprecated, 'revived', v_revived,
         'peers', (select count(*) from pgflow.workers p
                   where p.queue_name = v_queue and p.stopped_at is null and p.deprecated_at is null
                     and p.last_heartbeat_at > now() - pgflow._worker_liveness_window()));
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
  v_run_ids uuid[];
  v_step_slugs text[];
  v_task_indexes int[];
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
    select coalesce(array_agg(x.run_id), '{}'), coalesce(array_agg(x.step_slug), '{}'),
           coalesce(array_agg(x.task_index), '{}')
    into v_run_ids, v_step_slugs, v_task_indexes
    -- One lookup per message, in message order (FINDING A MESSAGE'S TASK in 07_claims.sql).
    from unnest(v_locked) as m(id)
    cross join lateral (
      select t.run_id, t.step_slug, t.task_index
      from pgflow.step_tasks t
      where t.queue_name = v_group.queue_name and t.message_id = m.id
        and t.status = 'started' and t.last_worker_id = release_worker_tasks.worker_id
      for update
    ) x;
    perform pgflow._record_attempts('released', v_run_ids, v_step_slugs, v_task_indexes);
    with released as (
      update pgflow.step_tasks t
      set status = 'queued',
          started_at = null,
          last_worker_id = null,
          attempts_count = greatest(t.attempts_count - 1, 0)
      from unnest(v_run_ids, v_step_slugs, v_task_indexes) as m(run_id, step_slug, task_index)
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
