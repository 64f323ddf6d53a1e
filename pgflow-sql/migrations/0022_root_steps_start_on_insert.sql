-- pgflow-rs SQL core, migration 0022: a new run's root steps are inserted started.
--
-- start_flow inserted every step state as 'created' and then, through _advance_runs and _start_ready_steps,
-- updated its root steps to 'started' in a second statement: one more row version, with its index entries,
-- per root step and run, on the path every run takes. When no root step needs the cascade (a condition to
-- evaluate, or no tasks: an empty root map), start_flow now inserts the root steps started and creates their
-- tasks directly; the other runs go through _advance_runs as before. The result is the same rows with the
-- same values (created_at and started_at are both the transaction's now(), as before), the same events in
-- the same order (run:started, then step:started per root step in step order), and the same messages.
-- Which ready steps need the cascade is one rule, _needs_cascade, used by _advance_runs and start_flow;
-- task creation, sending and signalling are one function, _create_step_tasks, used by both start paths.

-- Whether a step that has become ready needs the cascade of _advance_run instead of a plain start: it has a
-- condition to evaluate, or no tasks (an empty map). Inlined into the statements that use it.
create function pgflow._needs_cascade(p_initial_tasks int, p_required_input_pattern jsonb,
                                      p_forbidden_input_pattern jsonb)
returns boolean
language sql
immutable
parallel safe
as $$
  select p_initial_tasks = 0 or p_required_input_pattern is not null or p_forbidden_input_pattern is not null
$$;

-- As in 0021, with the rule in _needs_cascade.
create or replace function pgflow._advance_runs(p_run_ids uuid[])
returns void
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_fast uuid[];
  v_done uuid[];
  v_run uuid;
begin
  select coalesce(array_agg(x.run_id) filter (where not x.needs_cascade), '{}'),
         array_agg(x.run_id) filter (where not x.needs_cascade and x.remaining_steps = 0)
  into v_fast, v_done
  from (
    select r.run_id, r.remaining_steps, exists (
      select 1
      from pgflow.step_states ss
      join pgflow.steps s on s.flow_slug = ss.flow_slug and s.step_slug = ss.step_slug
      where ss.run_id = r.run_id and ss.status = 'created' and ss.remaining_deps = 0
        and pgflow._needs_cascade(ss.initial_tasks, s.required_input_pattern, s.forbidden_input_pattern)
    ) as needs_cascade
    from pgflow.runs r
    where r.run_id = any (p_run_ids)
  ) x;
  if cardinality(v_fast) > 0 then
    perform pgflow._start_ready_steps(v_fast);
  end if;
  foreach v_run in array coalesce(p_run_ids, '{}') loop
    if not v_run = any (v_fast) then
      perform pgflow._advance_run(v_run);
    end if;
  end loop;
  if v_done is not null then
    perform pgflow._complete_runs(v_done);
  end if;
end;
$$;

-- Creates the tasks of steps just started (`p_run_ids[i]`, `p_step_slugs[i]`), sends their messages with one
-- send_batch per queue, and signals those queues. Single steps get one task; map steps one per element of
-- their input (the run input for a root map, else the output of the step they depend on).
create function pgflow._create_step_tasks(p_run_ids uuid[], p_step_slugs text[])
returns void
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_group record;
  v_queues text[];
begin
  for v_group in
    select s.queue_name, coalesce(s.opt_start_delay, 0) as delay,
           array_agg(t.run_id order by t.run_id, t.step_slug, t.task_index) as run_ids,
           array_agg(r.flow_slug order by t.run_id, t.step_slug, t.task_index) as flow_slugs,
           array_agg(t.step_slug order by t.run_id, t.step_slug, t.task_index) as step_slugs,
           array_agg(t.task_index order by t.run_id, t.step_slug, t.task_index) as task_indexes,
           array_agg(t.element order by t.run_id, t.step_slug, t.task_index) as elements
    from unnest(p_run_ids, p_step_slugs) as x(run_id, step_slug)
    join pgflow.runs r on r.run_id = x.run_id
    join pgflow.steps s on s.flow_slug = r.flow_slug and s.step_slug = x.step_slug
    cross join lateral (
      select x.run_id, x.step_slug, 0 as task_index, null::jsonb as element
      where s.step_type = 'single'
      union all
      select x.run_id, x.step_slug, (e.ord - 1)::int, e.value
      from jsonb_array_elements(
             case when s.step_type <> 'map' then '[]'::jsonb
                  when s.deps_count = 0 then r.input
                  else (select ds.output from pgflow.deps d
                        join pgflow.step_states ds on ds.run_id = x.run_id and ds.step_slug = d.dep_slug
                        where d.flow_slug = r.flow_slug and d.step_slug = x.step_slug
                        limit 1)
             end) with ordinality as e(value, ord)
    ) t
    group by s.queue_name, coalesce(s.opt_start_delay, 0)
  loop
    insert into pgflow.step_tasks (flow_slug, run_id, step_slug, task_index, message_id, queue_name, element)
    select m.flow_slug, m.run_id, m.step_slug, m.task_index, sent.msg_id, v_group.queue_name, m.element
    from (
      select id as msg_id, row_number() over (order by id) as ord
      from pgmq.send_batch(
        v_group.queue_name,
        (select array_agg(jsonb_build_object(
                  'flow_slug', u.flow_slug,
                  'run_id', u.run_id,
                  'step_slug', u.step_slug,
                  'task_index', u.task_index) order by u.ord)
         from unnest(v_group.flow_slugs, v_group.run_ids, v_group.step_slugs, v_group.task_indexes)
                with ordinality as u(flow_slug, run_id, step_slug, task_index, ord)),
        null::jsonb[],
        clock_timestamp() + make_interval(secs => v_group.delay)
      ) as id
    ) sent
    join unnest(v_group.flow_slugs, v_group.run_ids, v_group.step_slugs, v_group.task_indexes, v_group.elements)
           with ordinality as m(flow_slug, run_id, step_slug, task_index, element, ord)
      on m.ord = sent.ord;
    v_queues := array_append(v_queues, v_group.queue_name);
  end loop;
  perform pgflow._signal_queues(v_queues);
end;
$$;

-- step:started of a step just started.
create function pgflow._emit_step_started(p_run_id uuid, p_step_slug text, p_started_at timestamptz,
                                          p_remaining_tasks int, p_remaining_deps int)
returns void
language plpgsql
volatile
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

-- As in 0021, creating the tasks through _create_step_tasks.
create or replace function pgflow._start_ready_steps(p_run_ids uuid[])
returns void
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_started record;
  v_runs uuid[];
  v_steps text[];
  v_events boolean := pgflow._step_events_enabled();
begin
  for v_started in
    with started as (
      update pgflow.step_states ss
      set status = 'started', started_at = now(), remaining_tasks = ss.initial_tasks
      from pgflow.runs r
      where ss.run_id = any (p_run_ids)
        and ss.status = 'created' and ss.remaining_deps = 0 and ss.initial_tasks > 0
        and r.run_id = ss.run_id and r.status = 'started'
      returning ss.run_id, ss.step_slug, ss.started_at, ss.remaining_tasks, ss.remaining_deps
    )
    select * from started order by run_id, step_slug
  loop
    v_runs := array_append(v_runs, v_started.run_id);
    v_steps := array_append(v_steps, v_started.step_slug);
    if v_events then
      perform pgflow._emit_step_started(v_started.run_id, v_started.step_slug, v_started.started_at,
                                        v_started.remaining_tasks, v_started.remaining_deps);
    end if;
  end loop;

  if v_runs is not null then
    perform pgflow._create_step_tasks(v_runs, v_steps);
  end if;
end;
$$;

-- As in 0021, inserting the root steps started when none of them needs the cascade.
create or replace function pgflow.start_flow(flow_slug text, input jsonb, run_id uuid default null)
returns setof pgflow.runs
language plpgsql
volatile
security definer
set search_path = ''
set plan_cache_mode = force_generic_plan
set enable_seqscan = off
as $$
declare
  v_slug text := pgflow.resolve_flow_slug(start_flow.flow_slug);
  v_run pgflow.runs;
  v_root_len int;
  v_steps int;
  v_root_map boolean;
  v_roots text[];
  v_root_tasks int[];
  v_i int;
begin
  select count(*)::int, coalesce(bool_or(s.step_type = 'map' and s.deps_count = 0), false)
  into v_steps, v_root_map
  from pgflow.steps s
  where s.flow_slug = v_slug;

  if v_root_map then
    if input is null then
      raise exception 'Flow % has root map steps but input is NULL', v_slug;
    elsif jsonb_typeof(input) <> 'array' then
      raise exception 'Flow % has root map steps but input is not an array (got %)',
        v_slug, jsonb_typeof(input);
    end if;
    v_root_len := jsonb_array_length(input);
  end if;

  insert into pgflow.runs (run_id, flow_slug, input, remaining_steps)
  values (coalesce(start_flow.run_id, gen_random_uuid()), v_slug, start_flow.input, v_steps)
  returning * into v_run;

  -- Root steps are inserted started unless one of them needs the cascade; the roots inserted started come
  -- back in step order.
  with inserted as (
    insert into pgflow.step_states (flow_slug, run_id, step_slug, remaining_deps, initial_tasks, status,
                                    started_at, remaining_tasks)
    select y.flow_slug, v_run.run_id, y.step_slug, y.deps_count, y.initial_tasks,
           case when y.start then 'started' else 'created' end,
           case when y.start then now() end,
           case when y.start then y.initial_tasks end
    from (
      select s.flow_slug, s.step_slug, s.deps_count, x.initial_tasks,
             s.deps_count = 0 and not coalesce(bool_or(s.deps_count = 0 and pgflow._needs_cascade(
               x.initial_tasks, s.required_input_pattern, s.forbidden_input_pattern)) over (), false) as start
      from pgflow.steps s
      cross join lateral (
        select case when s.step_type = 'single' then 1
                    when s.deps_count = 0 then v_root_len
               end as initial_tasks
      ) x
      where s.flow_slug = v_slug
    ) y
    returning step_states.step_slug, step_states.status, step_states.remaining_tasks
  )
  select array_agg(i.step_slug order by i.step_slug) filter (where i.status = 'started'),
         array_agg(i.remaining_tasks order by i.step_slug) filter (where i.status = 'started')
  into v_roots, v_root_tasks
  from inserted i;

  perform pgflow._emit('run:started', v_run.run_id, jsonb_build_object(
    'event_type', 'run:started',
    'run_id', v_run.run_id,
    'flow_slug', v_run.flow_slug,
    'input', v_run.input,
    'status', 'started',
    'remaining_steps', v_run.remaining_steps,
    'started_at', v_run.started_at
  ));

  -- No root started here (a root needs the cascade, or the flow has no steps): _advance_runs decides.
  if v_roots is null then
    perform pgflow._advance_runs(array[v_run.run_id]);
  else
    if pgflow._step_events_enabled() then
      for v_i in 1 .. cardinality(v_roots) loop
        perform pgflow._emit_step_started(v_run.run_id, v_roots[v_i], now(), v_root_tasks[v_i], 0);
      end loop;
    end if;
    perform pgflow._create_step_tasks(array_fill(v_run.run_id, array[cardinality(v_roots)]), v_roots);
  end if;

  return query select r.* from pgflow.runs r where r.run_id = v_run.run_id;
end;
$$;

revoke execute on all functions in schema pgflow from public;
