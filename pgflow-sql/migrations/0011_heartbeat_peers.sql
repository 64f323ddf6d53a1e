-- pgflow-rs SQL core: a heartbeat also answers how many live workers share the worker's queue ("peers"), so
-- that workers of one queue share out their exchanges in flight instead of each running its full number.

-- ---- as in schema/10_workers.sql : pgflow.worker_heartbeat ----
create or replace function pgflow.worker_heartbeat(worker_id uuid)
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
-- ---- end pgflow.worker_heartbeat ----
