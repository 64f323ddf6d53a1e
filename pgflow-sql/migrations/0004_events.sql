-- pgflow-rs SQL core, migration 0004: run and step events.
--
-- Every lifecycle event goes through pgflow._emit(event, run_id, payload). `event` and `payload` are exactly
-- what upstream broadcasts (`run:started`, `step:<slug>:completed`, ...; payload keys per event type).
--
-- Where it goes, decided on every call (a cheap catalog lookup), so installing Realtime later just works:
--   * Supabase: `realtime.send(payload, event, 'pgflow:run:<run_id>', false)` exists -> forward unchanged,
--     same topics, same order as upstream.
--   * Anywhere else: `pg_notify(pgflow.run_channel(run_id), <compact json>)`, i.e. on channel
--     `pgflow_run_<run id as 32 hex digits>`. The compact payload is
--     {"event_type": ..., "event": ..., "run_id": ..., "step_slug": ... (step events), "status": ...}
--     without inputs or outputs (NOTIFY payloads are limited to 8000 bytes); read outputs from the tables.
--     Notifications are delivered on commit, in emission order.
--   * Setting `pgflow.notify` controls the pg_notify path: 'run' (default: only run:* events), 'all' (run and
--     step events) or 'off'. The default keeps NOTIFY off the per-task hot path: a transaction that notifies
--     takes a cluster-wide lock while it commits, which serialises those commits. Set it per database
--     (`ALTER DATABASE ... SET pgflow.notify = 'all'`), role or session to watch step events.
create function pgflow._emit(event text, run_id uuid, payload jsonb)
returns void
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_mode text;
begin
  if to_regprocedure('realtime.send(jsonb,text,text,boolean)') is not null then
    perform realtime.send(payload, event, 'pgflow:run:' || run_id::text, false);
    return;
  end if;

  v_mode := coalesce(nullif(current_setting('pgflow.notify', true), ''), 'run');
  if v_mode = 'off' or (v_mode = 'run' and left(event, 4) <> 'run:') then
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
