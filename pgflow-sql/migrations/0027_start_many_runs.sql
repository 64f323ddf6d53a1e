-- pgflow-rs SQL core, migration 0027: start many runs of one flow in one call.
--
-- pgflow.start_flows(flow_slug, inputs jsonb[], run_ids uuid[] default null) starts one run per input and
-- returns the runs in input order. It does for a batch what start_flow does for one run, with one statement
-- per stage for the whole batch: the runs, their step states, and the root tasks of every run (one
-- _create_step_tasks call, so one send per queue). Events are unchanged: one run:started per run (and
-- step:started per root step when step events are on). Either every run starts or none does.
--
-- start_flow is now start_flows with one input, so there is one implementation of a start. Its errors and
-- results are unchanged. start_flows names the offending input's position when a root map flow gets a
-- non-array input among several.
--
-- Why: most of a start's server time is fixed cost per call (statement start-up, the flow's steps read, the
-- send). Measured with pgbench on one session, 8 diamond runs per statement: 3.7-4.1 ms as eight start_flow
-- calls, 1.6-1.8 ms as one start_flows call. Under the bench's load (900 diamond runs/s, a call per 10 ms),
-- 0.27 ms of server time per run against 0.64 ms. A single start_flow costs what it did (within 5 %).

create function pgflow.start_flows(flow_slug text, inputs jsonb[], run_ids uuid[] default null)
returns setof pgflow.runs
language plpgsql
volatile
security definer
set search_path = ''
set plan_cache_mode = force_generic_plan
set enable_seqscan = off
as $$
declare
  v_slug text := pgflow.resolve_flow_slug(start_flows.flow_slug);
  v_n int := cardinality(start_flows.inputs);
  v_steps int;
  v_root_map boolean;
  v_bad int;
  v_i int;
  v_runs uuid[];
  v_run pgflow.runs;
  v_started int;
  v_start_runs uuid[];
  v_start_steps text[];
  v_start_tasks int[];
  v_cascade uuid[];
begin
  if v_n is null then
    raise exception 'start_flows(%): inputs is NULL; pass an array with one input per run', v_slug;
  end if;
  if start_flows.run_ids is not null and cardinality(start_flows.run_ids) is distinct from v_n then
    raise exception 'start_flows(%): % run ids for % inputs; pass one run id (or NULL) per input, or no run ids',
      v_slug, coalesce(cardinality(start_flows.run_ids), 0), v_n;
  end if;
  if v_n = 0 then
    return;
  end if;

  select count(*)::int, coalesce(bool_or(s.step_type = 'map' and s.deps_count = 0), false)
  into v_steps, v_root_map
  from pgflow.steps s
  where s.flow_slug = v_slug;

  if v_root_map then
    select min(i.ord) into v_bad
    from unnest(start_flows.inputs) with ordinality as i(input, ord)
    where i.input is null or jsonb_typeof(i.input) <> 'array';
    if v_bad is not null and start_flows.inputs[v_bad] is null then
      raise exception 'Flow % has root map steps but input is NULL%', v_slug,
        case when v_n > 1 then format(' (input %s of %s)', v_bad, v_n) else '' end;
    elsif v_bad is not null then
      raise exception 'Flow % has root map steps but input is not an array (got %)%', v_slug,
        jsonb_typeof(start_flows.inputs[v_bad]),
        case when v_n > 1 then format(' (input %s of %s)', v_bad, v_n) else '' end;
    end if;
  end if;

  for v_i in 1 .. v_n loop
    v_runs[v_i] := coalesce(start_flows.run_ids[v_i], gen_random_uuid());
  end loop;

  -- One run:started per run, in input order.
  for v_run in
    insert into pgflow.runs (run_id, flow_slug, input, remaining_steps)
    select v_runs[i.ord], v_slug, i.input, v_steps
    from unnest(start_flows.inputs) with ordinality as i(input, ord)
    order by i.ord
    returning *
  loop
    perform pgflow._emit('run:started', v_run.run_id, jsonb_build_object(
      'event_type', 'run:started',
      'run_id', v_run.run_id,
      'flow_slug', v_run.flow_slug,
      'input', v_run.input,
      'status', 'started',
      'remaining_steps', v_run.remaining_steps,
      'started_at', v_run.started_at
    ));
  end loop;

  -- A run's root steps are inserted started unless one of them needs the cascade (a root condition, or an
  -- empty root map); the roots inserted started come back ordered by run and step.
  with inserted as (
    insert into pgflow.step_states (flow_slug, run_id, step_slug, remaining_deps, initial_tasks, status,
                                    started_at, remaining_tasks)
    select y.flow_slug, y.run_id, y.step_slug, y.deps_count, y.initial_tasks,
           case when y.start then 'started' else 'created' end,
           case when y.start then now() end,
           case when y.start then y.initial_tasks end
    from (
      select s.flow_slug, r.run_id, s.step_slug, s.deps_count, x.initial_tasks,
             s.deps_count = 0 and not coalesce(bool_or(s.deps_count = 0 and pgflow._needs_cascade(
               x.initial_tasks, s.required_input_pattern, s.forbidden_input_pattern))
               over (partition by r.run_id), false) as start
      from unnest(v_runs, start_flows.inputs) as r(run_id, input)
      cross join pgflow.steps s
      cross join lateral (
        select case when s.step_type = 'single' then 1
                    when s.deps_count = 0 then jsonb_array_length(r.input)
               end as initial_tasks
      ) x
      where s.flow_slug = v_slug
    ) y
    returning step_states.run_id, step_states.step_slug, step_states.status, step_states.remaining_tasks
  )
  select count(distinct i.run_id) filter (where i.status = 'started')::int,
         array_agg(i.run_id order by i.run_id, i.step_slug) filter (where i.status = 'started'),
         array_agg(i.step_slug order by i.run_id, i.step_slug) filter (where i.status = 'started'),
         array_agg(i.remaining_tasks order by i.run_id, i.step_slug) filter (where i.status = 'started')
  into v_started, v_start_runs, v_start_steps, v_start_tasks
  from inserted i;

  if v_start_runs is not null and pgflow._step_events_enabled() then
    for v_i in 1 .. cardinality(v_start_runs) loop
      perform pgflow._emit_step_started(v_start_runs[v_i], v_start_steps[v_i], now(), v_start_tasks[v_i], 0);
    end loop;
  end if;
  -- Runs with no root started here (a root needs the cascade, or the flow has no steps): _advance_runs
  -- decides.
  if v_started < v_n then
    select array_agg(r.run_id order by r.ord) into v_cascade
    from unnest(v_runs) with ordinality as r(run_id, ord)
    where r.run_id <> all (coalesce(v_start_runs, '{}'));
    perform pgflow._advance_runs(v_cascade);
  end if;
  if v_start_runs is not null then
    perform pgflow._create_step_tasks(v_start_runs, v_start_steps);
  end if;

  -- Read back by key, one lateral lookup per run (kept apart with offset 0): a join could be planned as a
  -- pass over a whole index by a session whose plan predates the table's growth.
  return query select r.* from unnest(v_runs) with ordinality as u(run_id, ord)
               cross join lateral (select * from pgflow.runs x where x.run_id = u.run_id offset 0) r
               order by u.ord;
end;
$$;

-- start_flow: one run, through start_flows.
create or replace function pgflow.start_flow(flow_slug text, input jsonb, run_id uuid default null)
returns setof pgflow.runs
language plpgsql
volatile
security definer
set search_path = ''
set plan_cache_mode = force_generic_plan
set enable_seqscan = off
as $$
begin
  return query select * from pgflow.start_flows(start_flow.flow_slug, array[start_flow.input],
                                                array[start_flow.run_id]);
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
    'pgflow.resolve_flow_slug(text)'
  ]
$$;

revoke execute on all functions in schema pgflow from public;
