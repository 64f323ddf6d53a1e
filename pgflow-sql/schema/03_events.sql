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
