-- pgflow-rs SQL core, migration 0029: run events are sent for the runs someone watches.
--
-- Without Realtime, run events go out with pg_notify (0004). A transaction that notifies takes one
-- cluster-wide lock in its commit and holds it until its commit record is flushed, so the commits of
-- notifying transactions queue one behind the other. Run events were on for every run by default, so every
-- start and every exchange that finished a run notified: under load most commits of the SQL core queued on
-- that lock. Measured with the diamond flow at 950 runs/s on two cores (log_lock_waits): waits of up to
-- 110 ms on it, about once a second, and run latency p99 44-53 ms against 23-27 ms with pg_notify off.
--
-- Now a run's events are sent only while someone watches it:
--   * pgflow.watch_run(run_id) registers the calling session as a watcher of the run and returns the run's
--     status (NULL when there is no such run yet: a caller that chooses the run id may watch first). LISTEN
--     on pgflow.run_channel(run_id) first, then watch, then read the run: a completion that committed before
--     the watch is in the status; one after it notifies.
--     To close the gap between a completion's check for watchers and its commit, watch_run takes the run
--     row FOR SHARE: it waits for a completion of the run in flight, and a completion that starts after
--     the watch waits for the watch to commit (row locks of the lock order, step 2; nothing else is locked).
--   * pgflow.unwatch_run(run_id) removes the session's registration. Registrations of sessions that have
--     ended are removed by pgflow.run_maintenance and cost nothing meanwhile but the events they keep on.
--   * pgflow.notify: 'watched' (the new default: run events of watched runs), 'run' (run events of every
--     run, the old default), 'all' (run and step events of every run) or 'off'. Deployment events and
--     Realtime are unchanged.
-- Listeners that LISTEN without watching keep the old behaviour with `ALTER DATABASE ... SET pgflow.notify
-- = 'run'` (or per role or session of the transactions that emit: workers and clients).

-- Who watches which run. Unlogged: after a crash the sessions that watched are gone too.
create unlogged table pgflow.run_watchers (
  run_id uuid not null,
  backend_pid int not null,
  since timestamptz not null default now(),
  primary key (run_id, backend_pid)
);

-- Registers the calling session as a watcher of `run_id`; returns the run's status, NULL if there is no
-- such run yet (a caller that chooses the run id can watch before starting it, and gets run:started too).
create function pgflow.watch_run(run_id uuid)
returns text
language plpgsql
volatile
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
volatile
security definer
set search_path = ''
as $$
  delete from pgflow.run_watchers w where w.run_id = unwatch_run.run_id and w.backend_pid = pg_backend_pid();
$$;

-- As in 0015, with the mode 'watched' (the default): run events only for runs with a watcher.
create or replace function pgflow._emit(event text, run_id uuid, payload jsonb)
returns void
language plpgsql
volatile
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

-- As in 0008, also removing the run registrations of sessions that have ended.
create or replace function pgflow.run_maintenance(
  dead_after interval default null,
  retain_for interval default null,
  prune_batch int default 1000
)
returns jsonb
language plpgsql
volatile
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
    'pgflow.unwatch_run(uuid)'
  ]
$$;

revoke execute on all functions in schema pgflow from public;
