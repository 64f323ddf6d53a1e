-- pgflow-rs SQL core, migration 0012: workers. Registration with an exact subscription, heartbeats, the fence
-- that persistently disables a worker function (upstream pgflow #654 describes the production procedure it
-- serves), stopping, and handing back unfinished tasks.

-- The window in which a worker's heartbeat counts as live (coverage monitoring). Workers heartbeat far more
-- often (the Rust runtime: every few seconds); a worker silent for longer is treated as gone.
create function pgflow._worker_liveness_window()
returns interval
language sql
immutable
parallel safe
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
volatile
set search_path = ''
as $$
begin
  insert into pgflow.worker_functions (function_name, updated_at, last_invoked_at)
  values (track_worker_function.function_name, clock_timestamp(), null)
  on conflict on constraint worker_functions_pkey do update set updated_at = clock_timestamp();
  return pgflow._worker_function_state(track_worker_function.function_name);
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
volatile
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

-- Lifts the fence (an operator, after fixing the cause or completing a replacement): enabled, reason cleared.
create function pgflow.enable_worker_function(function_name text)
returns jsonb
language plpgsql
volatile
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

-- Registers (or re-registers) a worker with its exact subscription, after ensure_flow_compiled:
--   worker_id      the worker's id (a restarted process uses a new one)
--   function_name  its worker function (tracked as by track_worker_function)
--   queue_name     the queue it polls
--   flow_slug      the concrete flow it serves
--   step_slug      the one step it serves (per-step queues: required), or NULL for every step of the flow
--                  (plain flows)
-- The subscription must match the persisted route (else SQLSTATE PF020, MESSAGE / DETAIL / HINT):
--   * the flow exists;
--   * queue mode 'step': step_slug is a step of the flow and queue_name is that step's persisted queue;
--   * queue mode 'flow': queue_name is the flow's queue (lower(flow_slug)); step_slug NULL or a step.
-- Records queue_name (lowercase), flow_slug, step_slug, heartbeat now, stopped_at NULL, and returns
--   {"worker_id", "queue_name", "flow_slug", "step_slug", "queue_mode",
--    "enabled", "disabled_reason", "disabled_at", "function_name"}
-- A worker whose function is disabled (enabled = false) must stop without claiming.
create function pgflow.register_worker(
  worker_id uuid,
  function_name text,
  queue_name text,
  flow_slug text,
  step_slug text default null
)
returns jsonb
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_mode text;
  v_route text;
  v_queue text := lower(register_worker.queue_name);
  v_state jsonb;
begin
  select f.queue_mode into v_mode from pgflow.flows f where f.flow_slug = register_worker.flow_slug;
  if v_mode is null then
    raise exception 'Worker subscription for flow "%" cannot be registered: the flow does not exist.', register_worker.flow_slug
      using errcode = 'PF020',
            hint = 'Call pgflow.ensure_flow_compiled() before registering workers.';
  end if;

  if register_worker.step_slug is not null then
    select s.queue_name into v_route
    from pgflow.steps s
    where s.flow_slug = register_worker.flow_slug and s.step_slug = register_worker.step_slug;
    if v_route is null then
      raise exception 'Worker subscription for step "%" of flow "%" cannot be registered: the flow has no such step.',
          register_worker.step_slug, register_worker.flow_slug
        using errcode = 'PF020',
              hint = 'The worker''s flow definition differs from the compiled one; deploy matching code.';
    end if;
  elsif v_mode = 'step' then
    raise exception 'Worker subscription for flow "%" cannot be registered without a step.', register_worker.flow_slug
      using errcode = 'PF020',
            detail = 'The flow uses per-step queues: every worker serves exactly one step.',
            hint = 'Start the worker for one step of the flow.';
  else
    v_route := lower(register_worker.flow_slug);
  end if;

  if v_route <> v_queue then
    raise exception 'Worker subscription for flow "%"% cannot be registered on queue "%".',
        register_worker.flow_slug,
        coalesce(format(' step "%s"', register_worker.step_slug), ''), v_queue
      using errcode = 'PF020',
            detail = format('The persisted route of the subscription is the queue "%s".', v_route),
            hint = 'Poll the queue that ensure_flow_compiled() persisted (pgflow.flow_routes()).';
  end if;

  v_state := pgflow.track_worker_function(register_worker.function_name);

  insert into pgflow.workers as w (worker_id, queue_name, function_name, flow_slug, step_slug, started_at,
                                   last_heartbeat_at, stopped_at)
  values (register_worker.worker_id, v_queue, register_worker.function_name, register_worker.flow_slug,
          register_worker.step_slug, clock_timestamp(), clock_timestamp(), null)
  on conflict on constraint workers_pkey do update
    set queue_name = excluded.queue_name, function_name = excluded.function_name,
        flow_slug = excluded.flow_slug, step_slug = excluded.step_slug,
        last_heartbeat_at = excluded.last_heartbeat_at, stopped_at = null;

  return v_state || jsonb_build_object(
    'worker_id', register_worker.worker_id, 'queue_name', v_queue, 'flow_slug', register_worker.flow_slug,
    'step_slug', register_worker.step_slug, 'queue_mode', v_mode);
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
volatile
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
volatile
set search_path = ''
as $$
  update pgflow.workers w set stopped_at = clock_timestamp() where w.worker_id = mark_worker_stopped.worker_id;
$$;

-- Hands back every task the worker still has `started` (a graceful shutdown that could not finish them):
-- the task is `queued` again with its attempt given back, and its message is visible at once, so another
-- worker picks it up without waiting for recovery. The tasks are found through the work in flight, not the
-- worker's history; messages are locked before tasks (0011_claims.sql). Returns the number of tasks released.
--
-- An attempt number given back is used again by the next claim; the fence still tells the two claims apart
-- because the next claim records another worker (workers pass their worker_id with every result).
create function pgflow.release_worker_tasks(worker_id uuid)
returns int
language plpgsql
volatile
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
