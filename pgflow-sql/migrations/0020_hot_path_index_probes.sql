-- pgflow-rs SQL core, migration 0020: index probes, not sequential scans, on the hot path.
--
-- 0019 pinned the claim, completion, failure and start functions to generic plans. A generic plan does not
-- know how many keys an array parameter holds, so `run_id = any($1)` is costed as ten lookups. On the small
-- tables a busy but well-pruned installation has (a few thousand runs, tasks and step states), that makes a
-- sequential scan look cheaper than ten index probes, and the generic plans of the completion path scanned
-- runs, step_states and step_tasks whole. Measured on one session driving a diamond flow (four tasks a run)
-- hop by hop over 1,500 tasks of history: 26 ms of server time a run with those plans, 14 ms with index
-- probes. Large tables were never affected (the planner picks the index there anyway), which is why the
-- history benchmark stayed flat while the small-table case was slow.
--
-- Every statement on these paths looks rows up by key, so the functions turn sequential scans off for their
-- calls (a function's SET clause lasts for its whole call, nested calls included). A statement with no usable
-- index still runs as before: the setting only steers the planner where an index exists. Behaviour is
-- unchanged.
do $$
declare
  v_function text;
begin
  -- The functions migration 0019 pinned to generic plans.
  for v_function in
    select format('pgflow.%I(%s)', p.proname, pg_get_function_identity_arguments(p.oid))
    from pg_proc p
    where p.pronamespace = 'pgflow'::regnamespace
      and 'plan_cache_mode=force_generic_plan' = any (p.proconfig)
    order by p.oid
  loop
    execute format('alter function %s set enable_seqscan = off', v_function);
  end loop;
end;
$$;
