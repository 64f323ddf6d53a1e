-- pgflow-rs SQL core, migration 0006: the run lifecycle.
--
-- Upstream interface: start_flow, start_flow_with_states, get_run_with_states, cascade_resolve_conditions,
-- _cascade_force_skip_steps, cascade_complete_taskless_steps, start_ready_steps, maybe_complete_run.
-- Internal helpers: _condition_met, _fail_run, _terminate_tasks, _advance_run.

------------------------------------------------------------------------------------------------------------
-- Internal helpers
------------------------------------------------------------------------------------------------------------

-- Whether a step's `if` / `ifNot` patterns hold. The evaluated document is the run input for root steps,
-- otherwise {dep_slug: output} over the step's completed dependencies ({} when none completed).
create function pgflow._condition_met(
  p_run_id uuid,
  p_run_input jsonb,
  p_flow_slug text,
  p_step_slug text,
  p_deps_count int,
  p_required jsonb,
  p_forbidden jsonb
)
returns boolean
language plpgsql
stable
set search_path = ''
as $$
declare
  v_doc jsonb;
begin
  if p_required is null and p_forbidden is null then
    return true;
  end if;

  if p_deps_count = 0 then
    v_doc := p_run_input;
  else
    select coalesce(jsonb_object_agg(d.dep_slug, ds.output), '{}'::jsonb) into v_doc
    from pgflow.deps d
    join pgflow.step_states ds on ds.run_id = p_run_id and ds.step_slug = d.dep_slug
    where d.flow_slug = p_flow_slug and d.step_slug = p_step_slug and ds.status = 'completed';
  end if;

  return (p_required is null or v_doc @> p_required)
     and (p_forbidden is null or not (v_doc @> p_forbidden));
end;
$$;

-- Moves the unfinished (queued or started) tasks of some steps of a run, or of the whole run when
-- p_step_slugs is NULL, to a terminal status (`skipped` or `cancelled`) and archives their messages, each in
-- the queue recorded on the task. Returns the number of tasks changed. The caller holds the run row; the
-- messages are locked before the task rows (the lock order of 0011_claims.sql), so a concurrent claim of one
-- of these messages either finishes first (its task is then cancelled too) or waits for this transaction.
create function pgflow._terminate_tasks(p_run_id uuid, p_step_slugs text[], p_status text)
returns int
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_count int := 0;
  v_group record;
begin
  for v_group in
    select t.queue_name, array_agg(t.message_id order by t.message_id) as ids
    from pgflow.step_tasks t
    where t.run_id = p_run_id
      and (p_step_slugs is null or t.step_slug = any (p_step_slugs))
      and t.status in ('queued', 'started')
    group by t.queue_name
    order by t.queue_name
  loop
    perform pgflow._lock_messages(v_group.queue_name, array_remove(v_group.ids, null));
  end loop;

  for v_group in
    with changed as (
      update pgflow.step_tasks t
      set status = p_status
      where t.run_id = p_run_id
        and (p_step_slugs is null or t.step_slug = any (p_step_slugs))
        and t.status in ('queued', 'started')
      returning t.queue_name, t.message_id
    )
    select c.queue_name, array_agg(c.message_id) filter (where c.message_id is not null) as ids,
           count(*)::int as n
    from changed c
    group by c.queue_name
  loop
    v_count := v_count + v_group.n;
    if v_group.ids is not null then
      perform pgmq.archive(v_group.queue_name, v_group.ids);
    end if;
  end loop;
  return v_count;
end;
$$;

-- Fails a started run: status `failed`, every unfinished task `cancelled` with its message archived, and a
-- `run:failed` event (with error_message when given). No-op for a run that is not started.
create function pgflow._fail_run(p_run_id uuid, p_error_message text)
returns boolean
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_run pgflow.runs;
begin
  update pgflow.runs r
  set status = 'failed', failed_at = now()
  where r.run_id = p_run_id and r.status = 'started'
  returning r.* into v_run;
  if not found then
    return false;
  end if;

  perform pgflow._terminate_tasks(p_run_id, null, 'cancelled');

  perform pgflow._emit('run:failed', p_run_id, jsonb_strip_nulls(jsonb_build_object(
    'event_type', 'run:failed',
    'run_id', v_run.run_id,
    'flow_slug', v_run.flow_slug,
    'status', 'failed',
    'error_message', p_error_message,
    'failed_at', v_run.failed_at
  )));
  return true;
end;
$$;

------------------------------------------------------------------------------------------------------------
-- Cascades
------------------------------------------------------------------------------------------------------------

-- Skips a step and all its transitive dependents that are not terminal yet; their unfinished tasks become
-- `skipped` and their messages are archived. Returns the number of steps skipped.
create function pgflow._cascade_force_skip_steps(run_id uuid, step_slug text, skip_reason text)
returns int
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_flow_slug text;
  v_slugs text[];
  v_step record;
begin
  select r.flow_slug into v_flow_slug from pgflow.runs r where r.run_id = _cascade_force_skip_steps.run_id;
  if not found then
    raise exception 'Run not found: %', _cascade_force_skip_steps.run_id;
  end if;

  for v_step in
    with recursive affected (step_slug) as (
      select _cascade_force_skip_steps.step_slug
      union
      select d.step_slug
      from pgflow.deps d
      join affected a on d.dep_slug = a.step_slug
      where d.flow_slug = v_flow_slug
    ),
    skipped as (
      update pgflow.step_states ss
      set status = 'skipped',
          skipped_at = now(),
          remaining_tasks = null,
          skip_reason = case when ss.step_slug = _cascade_force_skip_steps.step_slug
                             then _cascade_force_skip_steps.skip_reason else 'dependency_skipped' end
      from affected a
      where ss.run_id = _cascade_force_skip_steps.run_id
        and ss.step_slug = a.step_slug
        and ss.status in ('created', 'started')
      returning ss.step_slug, ss.skip_reason, ss.skipped_at
    )
    select k.step_slug, k.skip_reason, k.skipped_at
    from skipped k
    join pgflow.steps s on s.flow_slug = v_flow_slug and s.step_slug = k.step_slug
    order by s.step_index
  loop
    v_slugs := array_append(v_slugs, v_step.step_slug);
    perform pgflow._emit('step:' || v_step.step_slug || ':skipped', _cascade_force_skip_steps.run_id,
      jsonb_build_object(
        'event_type', 'step:skipped',
        'run_id', _cascade_force_skip_steps.run_id,
        'flow_slug', v_flow_slug,
        'step_slug', v_step.step_slug,
        'status', 'skipped',
        'skip_reason', v_step.skip_reason,
        'skipped_at', v_step.skipped_at
      ));
  end loop;

  if v_slugs is null then
    return 0;
  end if;

  perform pgflow._terminate_tasks(_cascade_force_skip_steps.run_id, v_slugs, 'skipped');

  update pgflow.runs r
  set remaining_steps = r.remaining_steps - cardinality(v_slugs)
  where r.run_id = _cascade_force_skip_steps.run_id;

  return cardinality(v_slugs);
end;
$$;

-- Releases the direct dependents of steps that just finished without output flowing on (skipped), or that
-- completed taskless: remaining_deps drops by the number of such parents, and a map dependent learns it
-- has nothing to iterate (initial_tasks 0).
create function pgflow._release_dependents(p_run_id uuid, p_flow_slug text, p_parents text[])
returns void
language sql
volatile
set search_path = ''
as $$
  update pgflow.step_states c
  set remaining_deps = c.remaining_deps - x.n,
      initial_tasks = case when x.step_type = 'map' then 0 else c.initial_tasks end
  from (
    select d.step_slug, s.step_type, count(*)::int as n
    from pgflow.deps d
    join pgflow.steps s on s.flow_slug = d.flow_slug and s.step_slug = d.step_slug
    where d.flow_slug = p_flow_slug and d.dep_slug = any (p_parents)
    group by d.step_slug, s.step_type
  ) x
  where c.run_id = p_run_id and c.step_slug = x.step_slug;
$$;

-- Applies `if` / `ifNot` to every ready (created, no pending dependency) step that has a pattern.
-- Returns false when the run is (or became) failed, true when it may continue.
create function pgflow.cascade_resolve_conditions(run_id uuid)
returns boolean
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_run pgflow.runs;
  v_iterations int := 0;
  v_fail record;
  v_skip record;
  v_skipped text[];
  v_cascade text;
begin
  select r.* into v_run from pgflow.runs r where r.run_id = cascade_resolve_conditions.run_id;
  if not found or v_run.status = 'completed' then
    return true;
  elsif v_run.status = 'failed' then
    return false;
  end if;

  -- Fast path: no ready step carries a condition.
  if not exists (
    select 1
    from pgflow.step_states ss
    join pgflow.steps s on s.flow_slug = ss.flow_slug and s.step_slug = ss.step_slug
    where ss.run_id = v_run.run_id and ss.status = 'created' and ss.remaining_deps = 0
      and (s.required_input_pattern is not null or s.forbidden_input_pattern is not null)
  ) then
    return true;
  end if;

  loop
    v_iterations := v_iterations + 1;
    if v_iterations > 50 then
      raise exception 'cascade_resolve_conditions exceeded safety limit of 50 iterations';
    end if;

    -- Fail mode: the first unmet step (by definition order) fails the run.
    select ss.step_slug into v_fail
    from pgflow.step_states ss
    join pgflow.steps s on s.flow_slug = ss.flow_slug and s.step_slug = ss.step_slug
    where ss.run_id = v_run.run_id and ss.status = 'created' and ss.remaining_deps = 0
      and s.when_unmet = 'fail'
      and (s.required_input_pattern is not null or s.forbidden_input_pattern is not null)
      and not pgflow._condition_met(v_run.run_id, v_run.input, s.flow_slug, s.step_slug, s.deps_count,
                                    s.required_input_pattern, s.forbidden_input_pattern)
    order by s.step_index
    limit 1;

    if found then
      update pgflow.step_states ss
      set status = 'failed', failed_at = now(), error_message = 'Condition not met'
      where ss.run_id = v_run.run_id and ss.step_slug = v_fail.step_slug
      returning ss.failed_at into v_skip;
      perform pgflow._emit('step:' || v_fail.step_slug || ':failed', v_run.run_id, jsonb_build_object(
        'event_type', 'step:failed',
        'run_id', v_run.run_id,
        'step_slug', v_fail.step_slug,
        'status', 'failed',
        'error_message', 'Condition not met',
        'failed_at', now()
      ));
      perform pgflow._fail_run(v_run.run_id, 'Condition not met');
      return false;
    end if;

    -- Plain skip: every unmet `skip` step; dependents continue without it.
    v_skipped := null;
    for v_skip in
      with unmet as (
        select s.step_slug, s.step_index
        from pgflow.step_states ss
        join pgflow.steps s on s.flow_slug = ss.flow_slug and s.step_slug = ss.step_slug
        where ss.run_id = v_run.run_id and ss.status = 'created' and ss.remaining_deps = 0
          and s.when_unmet = 'skip'
          and (s.required_input_pattern is not null or s.forbidden_input_pattern is not null)
          and not pgflow._condition_met(v_run.run_id, v_run.input, s.flow_slug, s.step_slug, s.deps_count,
                                        s.required_input_pattern, s.forbidden_input_pattern)
      ),
      skipped as (
        update pgflow.step_states ss
        set status = 'skipped', skip_reason = 'condition_unmet', skipped_at = now()
        from unmet u
        where ss.run_id = v_run.run_id and ss.step_slug = u.step_slug
        returning ss.step_slug, ss.skipped_at, u.step_index
      )
      select k.step_slug, k.skipped_at from skipped k order by k.step_index
    loop
      v_skipped := array_append(v_skipped, v_skip.step_slug);
      perform pgflow._emit('step:' || v_skip.step_slug || ':skipped', v_run.run_id, jsonb_build_object(
        'event_type', 'step:skipped',
        'run_id', v_run.run_id,
        'flow_slug', v_run.flow_slug,
        'step_slug', v_skip.step_slug,
        'status', 'skipped',
        'skip_reason', 'condition_unmet',
        'skipped_at', v_skip.skipped_at
      ));
    end loop;

    if v_skipped is not null then
      perform pgflow._release_dependents(v_run.run_id, v_run.flow_slug, v_skipped);
      update pgflow.runs r
      set remaining_steps = r.remaining_steps - cardinality(v_skipped)
      where r.run_id = v_run.run_id;
    end if;

    -- Skip-cascade: every unmet `skip-cascade` step, with all its dependents.
    for v_cascade in
      select s.step_slug
      from pgflow.step_states ss
      join pgflow.steps s on s.flow_slug = ss.flow_slug and s.step_slug = ss.step_slug
      where ss.run_id = v_run.run_id and ss.status = 'created' and ss.remaining_deps = 0
        and s.when_unmet = 'skip-cascade'
        and (s.required_input_pattern is not null or s.forbidden_input_pattern is not null)
        and not pgflow._condition_met(v_run.run_id, v_run.input, s.flow_slug, s.step_slug, s.deps_count,
                                      s.required_input_pattern, s.forbidden_input_pattern)
      order by s.step_index
    loop
      perform pgflow._cascade_force_skip_steps(v_run.run_id, v_cascade, 'condition_unmet');
    end loop;

    exit when v_skipped is null;
  end loop;

  return true;
end;
$$;

-- Completes, level by level, the ready steps that have nothing to do (initial_tasks = 0: empty root map,
-- or a map whose only dependency was empty or skipped). A step whose `if`/`ifNot` does not hold is left for
-- cascade_resolve_conditions. Returns the number of steps completed.
create function pgflow.cascade_complete_taskless_steps(run_id uuid)
returns int
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_run pgflow.runs;
  v_iterations int := 0;
  v_total int := 0;
  v_done text[];
  v_step record;
begin
  select r.* into v_run from pgflow.runs r where r.run_id = cascade_complete_taskless_steps.run_id;
  if not found or v_run.status <> 'started' then
    return 0;
  end if;

  loop
    v_iterations := v_iterations + 1;
    if v_iterations > 50 then
      raise exception 'Cascade loop exceeded safety limit of 50 iterations';
    end if;

    v_done := null;
    for v_step in
      with done as (
        update pgflow.step_states ss
        set status = 'completed',
            started_at = now(),
            completed_at = now(),
            remaining_tasks = 0,
            output = case when s.step_type = 'map' then '[]'::jsonb end
        from pgflow.steps s
        where ss.run_id = v_run.run_id
          and ss.status = 'created' and ss.remaining_deps = 0 and ss.initial_tasks = 0
          and s.flow_slug = ss.flow_slug and s.step_slug = ss.step_slug
          and pgflow._condition_met(v_run.run_id, v_run.input, s.flow_slug, s.step_slug, s.deps_count,
                                    s.required_input_pattern, s.forbidden_input_pattern)
        returning ss.step_slug, s.step_index, ss.output, ss.started_at, ss.completed_at
      )
      select * from done order by step_index
    loop
      v_done := array_append(v_done, v_step.step_slug);
      perform pgflow._emit('step:' || v_step.step_slug || ':completed', v_run.run_id, jsonb_build_object(
        'event_type', 'step:completed',
        'run_id', v_run.run_id,
        'step_slug', v_step.step_slug,
        'status', 'completed',
        'output', v_step.output,
        'started_at', v_step.started_at,
        'completed_at', v_step.completed_at,
        'remaining_tasks', 0,
        'remaining_deps', 0
      ));
    end loop;

    exit when v_done is null;

    perform pgflow._release_dependents(v_run.run_id, v_run.flow_slug, v_done);
    update pgflow.runs r
    set remaining_steps = r.remaining_steps - cardinality(v_done)
    where r.run_id = v_run.run_id;
    v_total := v_total + cardinality(v_done);
  end loop;

  return v_total;
end;
$$;

------------------------------------------------------------------------------------------------------------
-- Starting steps and finishing runs
------------------------------------------------------------------------------------------------------------

-- Starts every ready step that has tasks: one PGMQ message and one step_tasks row per task, in the step's
-- queue. Messages of steps sharing a queue and start delay go out in one send_batch.
create function pgflow.start_ready_steps(run_id uuid)
returns void
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_run_status text;
  v_flow_slug text;
  v_slugs text[];
  v_counts int[];
  v_step record;
  v_group record;
begin
  select r.status, r.flow_slug into v_run_status, v_flow_slug
  from pgflow.runs r where r.run_id = start_ready_steps.run_id;
  if v_run_status is distinct from 'started' then
    return;
  end if;

  for v_step in
    with started as (
      update pgflow.step_states ss
      set status = 'started', started_at = now(), remaining_tasks = ss.initial_tasks
      where ss.run_id = start_ready_steps.run_id
        and ss.status = 'created' and ss.remaining_deps = 0 and ss.initial_tasks > 0
      returning ss.step_slug, ss.started_at, ss.remaining_tasks, ss.remaining_deps
    )
    select * from started order by step_slug
  loop
    v_slugs := array_append(v_slugs, v_step.step_slug);
    v_counts := array_append(v_counts, v_step.remaining_tasks);
    perform pgflow._emit('step:' || v_step.step_slug || ':started', start_ready_steps.run_id, jsonb_build_object(
      'event_type', 'step:started',
      'run_id', start_ready_steps.run_id,
      'step_slug', v_step.step_slug,
      'status', 'started',
      'started_at', v_step.started_at,
      'remaining_tasks', v_step.remaining_tasks,
      'remaining_deps', v_step.remaining_deps
    ));
  end loop;

  if v_slugs is null then
    return;
  end if;

  -- One task per single step; one per array element for a map step, with the element copied onto the task
  -- (read once here with jsonb_array_elements, instead of once per element at claim time). The array is the
  -- run input for a root map, otherwise the output of the map's only dependency.
  for v_group in
    select s.queue_name, coalesce(s.opt_start_delay, 0) as delay,
           array_agg(t.step_slug order by t.step_slug, t.task_index) as step_slugs,
           array_agg(t.task_index order by t.step_slug, t.task_index) as task_indexes,
           array_agg(t.element order by t.step_slug, t.task_index) as elements
    from unnest(v_slugs, v_counts) as r(step_slug, n)
    join pgflow.steps s on s.flow_slug = v_flow_slug and s.step_slug = r.step_slug
    cross join lateral (
      select r.step_slug, 0 as task_index, null::jsonb as element
      where s.step_type = 'single'
      union all
      select r.step_slug, (e.ord - 1)::int, e.value
      from jsonb_array_elements(
             case when s.step_type <> 'map' then '[]'::jsonb
                  when s.deps_count = 0 then (select rr.input from pgflow.runs rr
                                              where rr.run_id = start_ready_steps.run_id)
                  else (select ds.output from pgflow.deps d
                        join pgflow.step_states ds on ds.run_id = start_ready_steps.run_id
                                                   and ds.step_slug = d.dep_slug
                        where d.flow_slug = v_flow_slug and d.step_slug = r.step_slug
                        limit 1)
             end) with ordinality as e(value, ord)
    ) t
    group by s.queue_name, coalesce(s.opt_start_delay, 0)
  loop
    insert into pgflow.step_tasks (flow_slug, run_id, step_slug, task_index, message_id, queue_name, element)
    select v_flow_slug, start_ready_steps.run_id, m.step_slug, m.task_index, sent.msg_id, v_group.queue_name,
           m.element
    from (
      select id as msg_id, row_number() over (order by id) as ord
      from pgmq.send_batch(
        v_group.queue_name,
        (select array_agg(jsonb_build_object(
                  'flow_slug', v_flow_slug,
                  'run_id', start_ready_steps.run_id,
                  'step_slug', u.step_slug,
                  'task_index', u.task_index) order by u.ord)
         from unnest(v_group.step_slugs, v_group.task_indexes) with ordinality as u(step_slug, task_index, ord)),
        v_group.delay
      ) as id
    ) sent
    join unnest(v_group.step_slugs, v_group.task_indexes, v_group.elements)
           with ordinality as m(step_slug, task_index, element, ord)
      on m.ord = sent.ord;
  end loop;
end;
$$;

-- Completes a started run whose steps are all completed or skipped. Output: {leaf_step: output} over the
-- completed leaf steps (steps nothing depends on), NULL when none completed.
create function pgflow.maybe_complete_run(run_id uuid)
returns void
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_run pgflow.runs;
begin
  update pgflow.runs r
  set status = 'completed',
      completed_at = now(),
      output = (
        select jsonb_object_agg(ss.step_slug, ss.output)
        from pgflow.step_states ss
        where ss.run_id = r.run_id and ss.status = 'completed'
          and not exists (
            select 1 from pgflow.deps d where d.flow_slug = r.flow_slug and d.dep_slug = ss.step_slug)
      )
  where r.run_id = maybe_complete_run.run_id and r.remaining_steps = 0 and r.status = 'started'
  returning r.* into v_run;

  if found then
    perform pgflow._emit('run:completed', v_run.run_id, jsonb_build_object(
      'event_type', 'run:completed',
      'run_id', v_run.run_id,
      'flow_slug', v_run.flow_slug,
      'status', 'completed',
      'output', v_run.output,
      'completed_at', v_run.completed_at
    ));
  end if;
end;
$$;

-- Moves a run forward after something finished: conditions, taskless steps (re-checking conditions of
-- steps that became ready through an empty map), then new tasks, then run completion.
create function pgflow._advance_run(p_run_id uuid)
returns boolean
language plpgsql
volatile
set search_path = ''
as $$
begin
  loop
    if not pgflow.cascade_resolve_conditions(p_run_id) then
      return false;
    end if;
    exit when pgflow.cascade_complete_taskless_steps(p_run_id) = 0;
  end loop;
  perform pgflow.start_ready_steps(p_run_id);
  perform pgflow.maybe_complete_run(p_run_id);
  return true;
end;
$$;

------------------------------------------------------------------------------------------------------------
-- Starting runs
------------------------------------------------------------------------------------------------------------

create function pgflow.start_flow(flow_slug text, input jsonb, run_id uuid default null)
returns setof pgflow.runs
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_run pgflow.runs;
  v_root_len int;
begin
  if exists (
    select 1 from pgflow.steps s
    where s.flow_slug = start_flow.flow_slug and s.step_type = 'map' and s.deps_count = 0
  ) then
    if input is null then
      raise exception 'Flow % has root map steps but input is NULL', start_flow.flow_slug;
    elsif jsonb_typeof(input) <> 'array' then
      raise exception 'Flow % has root map steps but input is not an array (got %)',
        start_flow.flow_slug, jsonb_typeof(input);
    end if;
    v_root_len := jsonb_array_length(input);
  end if;

  insert into pgflow.runs (run_id, flow_slug, input, remaining_steps)
  values (
    coalesce(start_flow.run_id, gen_random_uuid()),
    start_flow.flow_slug,
    start_flow.input,
    (select count(*) from pgflow.steps s where s.flow_slug = start_flow.flow_slug)
  )
  returning * into v_run;

  insert into pgflow.step_states (flow_slug, run_id, step_slug, remaining_deps, initial_tasks)
  select s.flow_slug, v_run.run_id, s.step_slug, s.deps_count,
         case when s.step_type = 'single' then 1
              when s.deps_count = 0 then v_root_len
         end
  from pgflow.steps s
  where s.flow_slug = start_flow.flow_slug;

  perform pgflow._emit('run:started', v_run.run_id, jsonb_build_object(
    'event_type', 'run:started',
    'run_id', v_run.run_id,
    'flow_slug', v_run.flow_slug,
    'input', v_run.input,
    'status', 'started',
    'remaining_steps', v_run.remaining_steps,
    'started_at', v_run.started_at
  ));

  perform pgflow._advance_run(v_run.run_id);

  return query select r.* from pgflow.runs r where r.run_id = v_run.run_id;
end;
$$;

create function pgflow.get_run_with_states(run_id uuid)
returns jsonb
language sql
security definer
set search_path = ''
as $$
  select jsonb_build_object(
    'run', to_jsonb(r),
    'steps', coalesce(
      (select jsonb_agg(to_jsonb(ss)) from pgflow.step_states ss where ss.run_id = r.run_id),
      '[]'::jsonb)
  )
  from pgflow.runs r
  where r.run_id = get_run_with_states.run_id;
$$;

create function pgflow.start_flow_with_states(flow_slug text, input jsonb, run_id uuid default null)
returns jsonb
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_run_id uuid;
begin
  select r.run_id into v_run_id
  from pgflow.start_flow(start_flow_with_states.flow_slug, start_flow_with_states.input,
                         start_flow_with_states.run_id) r;
  return pgflow.get_run_with_states(v_run_id);
end;
$$;
