-- Cached plans and growing tables.
--
-- The claim, completion and start functions run on generic plans cached per connection (0019). A
-- generic plan is built from the table sizes of the moment: on a table of a few pages, reading the
-- whole of it through an index costs less than probing it once per task, and PostgreSQL picks that.
-- A worker that connects while its tables are small (a fresh installation, or right after a
-- retention sweep emptied them) keeps those plans while the tables grow, and every claim and
-- completion then reads all of step_states: on a development cluster, with a few thousand runs, the
-- claim's classification of ten messages took 0.5 ms on a plan built for that size and 20 ms on one
-- built when the tables were empty. PostgreSQL rebuilds a
-- cached plan when the table is analysed, and autovacuum analyses a growing table only about once a
-- minute.
--
-- Every worker heartbeat therefore analyses each of the hot tables that has more than doubled (and
-- passed 64 kB) since its last analysis. Doubling bounds the work: a table that grows steadily is
-- analysed a few times while it is small and then rarely. `skip_locked` leaves a table that another
-- analysis or vacuum holds to that one, so the heartbeat never waits on a table lock.

create function pgflow._refresh_plan_statistics()
returns int
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_table regclass;
  v_analysed int := 0;
begin
  for v_table in
    select c.oid::regclass
    from pg_catalog.pg_class c
    where c.oid in ('pgflow.runs'::regclass, 'pgflow.step_states'::regclass, 'pgflow.step_tasks'::regclass)
      and pg_catalog.pg_relation_size(c.oid) / pg_catalog.current_setting('block_size')::int
          > 2 * greatest(c.relpages, 4)
  loop
    execute format('analyze (skip_locked) %s', v_table);
    v_analysed := v_analysed + 1;
  end loop;
  return v_analysed;
end;
$$;

-- The heartbeat of 0012, which now also keeps the hot tables' statistics (and so the plans cached on
-- them) in step with their size.
create or replace function pgflow.worker_heartbeat(worker_id uuid)
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
  perform pgflow._refresh_plan_statistics();
  return pgflow._worker_function_state(v_function)
    || jsonb_build_object('deprecated', v_deprecated, 'revived', v_revived);
end;
$$;

alter function pgflow.worker_heartbeat(uuid) security definer;

revoke execute on all functions in schema pgflow from public;
