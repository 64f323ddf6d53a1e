-- Runs: starting them, and advancing them as steps finish.
--
-- Owns: start_flow, start_flows and start_flow_with_states; step conditions and skip cascades; creating the
-- tasks of ready steps (one message per task on the step's queue); releasing dependents; completing runs.
-- The lock order these follow is written at the top of 07_claims.sql.

-- Whether a step's `if` / `ifNot` patterns hold. The evaluated document is the run input for root steps,
-- otherwise {dep_slug: output} over the step's completed dependencies ({} when none completed).
create function pgflow._condition_met(p_run_id uuid, p_run_input jsonb, p_flow_slug text, p_step_slug text, p_deps_count integer, p_required jsonb, p_forbidden jsonb)
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

-- Whether a step that has become ready needs the cascade of _advance_run instead of a plain start: it has a
-- condition to evaluate, or no tasks (an empty map). Inlined into the statements that use it.
create function pgflow._needs_cascade(p_initial_tasks integer, p_required_input_pattern jsonb, p_forbidden_input_pattern jsonb)
returns boolean
language sql
immutable parallel safe
as $$
  select p_initial_tasks = 0 or p_required_input_pattern is not null or p_forbidden_input_pattern is not null
$$;

-- What a claimed task's handler receives, the one definition every claim path uses:
--   input       a map task: its array element (copied onto the task when the step started);
--               a single step: {dep_slug: output} over its completed dependencies ({} for a root step);
--   flow_input  the run input for a root single step, NULL otherwise.
-- Plain SQL without SET options, so the planner can inline it into the claim statements.
create function pgflow._task_inputs(p_run_id uuid, p_flow_slug text, p_step_slug text, p_step_type text, p_deps_count integer, p_element jsonb, p_run_input jsonb)
returns table(input jsonb, flow_input jsonb)
language sql
stable
as $$
  select
    case
      when p_step_type = 'map' then p_element
      else coalesce((
        select jsonb_object_agg(d.dep_slug, ds.output)
        from pgflow.deps d
        join pgflow.step_states ds on ds.run_id = p_run_id and ds.step_slug = d.dep_slug
        where d.flow_slug = p_flow_slug and d.step_slug = p_step_slug and ds.status = 'completed'),
        '{}'::jsonb)
    end,
    case when p_step_type = 'single' and p_deps_count = 0 then p_run_input end
$$;

-- Creates the tasks of steps just started (`p_run_ids[i]`, `p_step_slugs[i]`), sends their messages with one
-- batch per queue through the queue's statements, and signals those queues. Single steps get one task; map
-- steps one per element of their input (the run input for a root map, else the output of the step they
-- depend on). Each run's row is found by its key. The join of the batch to runs and steps could also be
-- planned from steps to every run of the flow (through the runs' flow_slug index), and was, whenever runs had not been
-- analysed since it grew: the planner then assumes a few runs per flow, and a start read one index entry per
-- run the flow had ever had (3,000 in the test that found it). The lateral lookup (kept apart by offset 0)
-- leaves the planner no such choice. On a queue with priorities (18_priorities.sql) each message carries its
-- run's rank in its headers.
--
-- CLAIMED AT CREATION. Inside pgflow.exchange, the exchange's worker would read these tasks back from its queue
-- in the same transaction. So when the exchange left its claim in the transaction-local setting
-- pgflow.exchange_claim ({"queue", "worker", "budget", "pairs", "claimed", "read"}), tasks it would claim are
-- created claimed instead: `started` with attempt 1 for that worker, their messages sent already read once
-- and hidden for the step timeout plus the claim buffer, as a claim leaves them; their message ids are added
-- to "claimed" and "budget" goes down. A task qualifies when it is on the exchange's queue, its (flow, step) is
-- one of the worker's pairs, its step has no start delay, and the queue has neither flow control nor
-- priorities (their claims decide more than order). The queue's order is kept: the worker's read takes the
-- queue's older visible messages first, so as many of the budget as the queue has visible messages (counted
-- without locking, up to the budget) is left to that read, and only the rest is taken here, earliest tasks
-- first. Such tasks are never signalled (nobody else is to read them). This takes no lock: the rows are new.
-- The exchange reads its queue for the rest of its budget only when that read has something to find: "read"
-- is set when a count found visible messages, or when a task on the exchange's queue was created queued.
-- Otherwise the read could find only messages that became visible after the count; a read a moment earlier
-- misses those the same way, and their senders signal the queue.
create function pgflow._create_step_tasks(p_run_ids uuid[], p_step_slugs text[])
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_claim jsonb := nullif(current_setting('pgflow.exchange_claim', true), '')::jsonb;
  v_pair_flows text[];
  v_pair_steps text[];
  v_budget int;
  v_take int;
  v_ids bigint[];
  v_group record;
  v_part record;
  v_queues text[];
  v_read boolean := false;
begin
  if v_claim is not null then
    v_budget := (v_claim ->> 'budget')::int;
    select array_agg(p.pair ->> 0), array_agg(p.pair ->> 1) into v_pair_flows, v_pair_steps
    from jsonb_array_elements(v_claim -> 'pairs') as p(pair);
  end if;
  for v_group in
    select s.queue_name, coalesce(s.opt_start_delay, 0) as delay,
           pgflow._queue_aging_secs(s.queue_name) as aging_secs,
           array_agg(r.priority order by t.run_id, t.step_slug, t.task_index) as priorities,
           array_agg(t.run_id order by t.run_id, t.step_slug, t.task_index) as run_ids,
           array_agg(r.flow_slug order by t.run_id, t.step_slug, t.task_index) as flow_slugs,
           array_agg(t.step_slug order by t.run_id, t.step_slug, t.task_index) as step_slugs,
           array_agg(t.task_index order by t.run_id, t.step_slug, t.task_index) as task_indexes,
           array_agg(t.element order by t.run_id, t.step_slug, t.task_index) as elements,
           array_agg(coalesce(s.opt_timeout, f.opt_timeout) order by t.run_id, t.step_slug, t.task_index)
             as timeouts,
           array_agg(v_claim is not null
                     and exists (select 1 from unnest(v_pair_flows, v_pair_steps) as p(flow_slug, step_slug)
                                 where p.flow_slug = r.flow_slug and p.step_slug = t.step_slug)
                     order by t.run_id, t.step_slug, t.task_index) as claimable
    from unnest(p_run_ids, p_step_slugs) as x(run_id, step_slug)
    cross join lateral (select r.flow_slug, r.input, r.priority from pgflow.runs r where r.run_id = x.run_id offset 0) r
    join pgflow.steps s on s.flow_slug = r.flow_slug and s.step_slug = x.step_slug
    join pgflow.flows f on f.flow_slug = r.flow_slug
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
    -- CLAIMED AT CREATION (above): how many of this group the exchange's worker takes now.
    v_take := 0;
    if v_budget > 0 and v_group.queue_name = v_claim ->> 'queue' and v_group.delay = 0
       and v_group.aging_secs is null and true = any (v_group.claimable)
       and not pgflow._queue_limited(v_group.queue_name) then
      v_take := v_budget - coalesce(cardinality(
                  pgflow._queue_op(v_group.queue_name, 'peek_visible', null, null, v_budget)), 0);
      v_read := v_read or v_take < v_budget;
    end if;
    for v_part in
      select c.claimed,
             array_agg(c.priority order by c.ord) as priorities,
             array_agg(c.run_id order by c.ord) as run_ids,
             array_agg(c.flow_slug order by c.ord) as flow_slugs,
             array_agg(c.step_slug order by c.ord) as step_slugs,
             array_agg(c.task_index order by c.ord) as task_indexes,
             array_agg(c.element order by c.ord) as elements,
             array_agg(clock_timestamp()
                       + make_interval(secs => c.timeout::float8 + pgflow._claim_visibility_buffer_seconds())
                       order by c.ord) filter (where c.claimed) as claimed_vts
      from (
        select u.*, u.claimable and count(*) filter (where u.claimable) over (order by u.ord) <= v_take as claimed
        from unnest(v_group.priorities, v_group.run_ids, v_group.flow_slugs, v_group.step_slugs,
                    v_group.task_indexes, v_group.elements, v_group.timeouts, v_group.claimable)
               with ordinality as u(priority, run_id, flow_slug, step_slug, task_index, element, timeout,
                                    claimable, ord)
      ) c
      group by c.claimed
      order by c.claimed desc
    loop
      with created as (
        insert into pgflow.step_tasks (flow_slug, run_id, step_slug, task_index, message_id, queue_name, element,
                                       status, attempts_count, started_at, last_worker_id)
        select m.flow_slug, m.run_id, m.step_slug, m.task_index, sent.msg_id, v_group.queue_name, m.element,
               case when v_part.claimed then 'started' else 'queued' end,
               case when v_part.claimed then 1 else 0 end,
               case when v_part.claimed then now() end,
               case when v_part.claimed then (v_claim ->> 'worker')::uuid end
        from unnest(pgflow._queue_op(
               v_group.queue_name, 'send', null,
               case when v_part.claimed then v_part.claimed_vts
                    else array[clock_timestamp() + make_interval(secs => v_group.delay)] end,
               case when v_part.claimed then 1 end,
               (select array_agg(jsonb_build_object(
                         'flow_slug', u.flow_slug,
                         'run_id', u.run_id,
                         'step_slug', u.step_slug,
                         'task_index', u.task_index) order by u.ord)
                from unnest(v_part.flow_slugs, v_part.run_ids, v_part.step_slugs, v_part.task_indexes)
                       with ordinality as u(flow_slug, run_id, step_slug, task_index, ord)),
               case when v_group.aging_secs is not null
                    then array(select pgflow._rank_headers(v_group.aging_secs, p.priority)
                               from unnest(v_part.priorities) with ordinality as p(priority, ord) order by p.ord) end))
               with ordinality as sent(msg_id, ord)
        join unnest(v_part.flow_slugs, v_part.run_ids, v_part.step_slugs, v_part.task_indexes, v_part.elements)
               with ordinality as m(flow_slug, run_id, step_slug, task_index, element, ord)
          on m.ord = sent.ord
        returning message_id
      )
      select array_agg(c.message_id) into v_ids from created c;
      if v_part.claimed then
        v_budget := v_budget - cardinality(v_ids);
        v_claim := jsonb_set(jsonb_set(v_claim, '{budget}', to_jsonb(v_budget)), '{claimed}',
                             coalesce(v_claim -> 'claimed', '[]') || to_jsonb(v_ids));
        perform set_config('pgflow.exchange_claim', v_claim::text, true);
      else
        v_queues := array_append(v_queues, v_group.queue_name);
        v_read := v_read or coalesce(v_group.queue_name = v_claim ->> 'queue', false);
      end if;
    end loop;
  end loop;
  if v_read and not (v_claim ? 'read') then
    perform set_config('pgflow.exchange_claim', jsonb_set(v_claim, '{read}', 'true')::text, true);
  end if;
  if v_queues is not null then
    perform pgflow._signal_queues(v_queues);
  end if;
end;
$$;

-- Starts every ready step that has tasks, in every started run of `p_run_ids`, creating their tasks through
-- _create_step_tasks (the only function that creates tasks).
create function pgflow._start_ready_steps(p_run_ids uuid[])
returns void
language plpgsql
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

-- Upstream's start_ready_steps(run_id): the same, for one run.
create function pgflow.start_ready_steps(run_id uuid)
returns void
language sql
set search_path = ''
as $$
  select pgflow._start_ready_steps(array[start_ready_steps.run_id]);
$$;

-- Releases the direct dependents of steps that just finished without output flowing on (skipped), or that
-- completed taskless: remaining_deps drops by the number of such parents, and a map dependent learns it
-- has nothing to iterate (initial_tasks 0).
create function pgflow._release_dependents(p_run_id uuid, p_flow_slug text, p_parents text[])
returns void
language sql
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

-- Skips a step and all its transitive dependents that are not terminal yet; their unfinished tasks become
-- `skipped` and their messages are archived. Returns the number of steps skipped.
create function pgflow._cascade_force_skip_steps(run_id uuid, step_slug text, skip_reason text)
returns integer
language plpgsql
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

-- Applies `if` / `ifNot` to every ready (created, no pending dependency) step that has a pattern.
-- Returns false when the run is (or became) failed, true when it may continue.
create function pgflow.cascade_resolve_conditions(run_id uuid)
returns boolean
language plpgsql
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
returns integer
language plpgsql
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

-- Completes every started run of `p_run_ids` whose steps are all completed or skipped. Output: {leaf_step:
-- output} over the completed leaf steps (steps nothing depends on), NULL when none completed. Emits
-- `run:completed` for each.
create function pgflow._complete_runs(p_run_ids uuid[])
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_run pgflow.runs;
begin
  for v_run in
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
    where r.run_id = any (p_run_ids) and r.remaining_steps = 0 and r.status = 'started'
    returning r.*
  loop
    perform pgflow._emit('run:completed', v_run.run_id, jsonb_build_object(
      'event_type', 'run:completed',
      'run_id', v_run.run_id,
      'flow_slug', v_run.flow_slug,
      'status', 'completed',
      'output', v_run.output,
      'completed_at', v_run.completed_at
    ));
  end loop;
end;
$$;

-- Upstream's maybe_complete_run(run_id): the same, for one run.
create function pgflow.maybe_complete_run(run_id uuid)
returns void
language sql
set search_path = ''
as $$
  select pgflow._complete_runs(array[maybe_complete_run.run_id]);
$$;

-- Moves a run forward after something finished: conditions, taskless steps (re-checking conditions of
-- steps that became ready through an empty map), then new tasks, then run completion.
create function pgflow._advance_run(p_run_id uuid)
returns boolean
language plpgsql
set search_path = ''
as $$
begin
  loop
    if not pgflow.cascade_resolve_conditions(p_run_id) then
      return false;
    end if;
    exit when pgflow.cascade_complete_taskless_steps(p_run_id) = 0;
  end loop;
  perform pgflow._start_ready_steps(array[p_run_id]);
  perform pgflow._complete_runs(array[p_run_id]);
  return true;
end;
$$;

-- Advances the runs `p_run_ids` after their steps changed: the one place that decides how. Runs none of whose
-- ready steps needs the cascade (_needs_cascade: a condition to evaluate, or no tasks) start those steps
-- together, set-based; the others go through the full cascade of _advance_run (which completes its run when
-- it can). The fast runs whose steps are all done complete.
create function pgflow._advance_runs(p_run_ids uuid[])
returns void
language plpgsql
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

-- Starts one run of flow `flow_slug` (a slug or an alias) per input, in one transaction, and returns the runs
-- in input order. run_ids: one id (or NULL: a new one) per input, or NULL. priorities: one priority (or NULL:
-- 0) per input, or NULL (all 0): higher is claimed first on queues with priorities (18_priorities.sql).
create function pgflow.start_flows(flow_slug text, inputs jsonb[], run_ids uuid[], priorities integer[])
returns setof pgflow.runs
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
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
  if start_flows.priorities is not null and cardinality(start_flows.priorities) is distinct from v_n then
    raise exception 'start_flows(%): % priorities for % inputs; pass one priority (or NULL) per input, or no priorities',
      v_slug, coalesce(cardinality(start_flows.priorities), 0), v_n
      using errcode = 'invalid_parameter_value';
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
    insert into pgflow.runs (run_id, flow_slug, input, remaining_steps, priority)
    select v_runs[i.ord], v_slug, i.input, v_steps, coalesce(start_flows.priorities[i.ord], 0)
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

-- start_flows without priorities (all 0).
create function pgflow.start_flows(flow_slug text, inputs jsonb[], run_ids uuid[] default NULL::uuid[])
returns setof pgflow.runs
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
as $$
begin
  return query select * from pgflow.start_flows(start_flows.flow_slug, start_flows.inputs, start_flows.run_ids,
                                                null::integer[]);
end;
$$;

-- start_flow with a priority (higher is claimed first on queues with priorities).
create function pgflow.start_flow(flow_slug text, input jsonb, run_id uuid, priority integer)
returns setof pgflow.runs
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
as $$
begin
  return query select * from pgflow.start_flows(start_flow.flow_slug, array[start_flow.input],
                                                array[start_flow.run_id], array[start_flow.priority]);
end;
$$;

-- start_flow: one run, through start_flows.
create function pgflow.start_flow(flow_slug text, input jsonb, run_id uuid default NULL::uuid)
returns setof pgflow.runs
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
as $$
begin
  return query select * from pgflow.start_flows(start_flow.flow_slug, array[start_flow.input],
                                                array[start_flow.run_id], null::integer[]);
end;
$$;

create function pgflow.start_flow_with_states(flow_slug text, input jsonb, run_id uuid default NULL::uuid)
returns jsonb
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
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
