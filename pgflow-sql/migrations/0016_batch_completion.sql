-- pgflow-rs SQL core, migration 0016: set-based completion.
--
-- Completing a batch of tasks no longer loops over a single-task function: a handful of set-based statements
-- update the tasks, archive their messages (one pgmq.archive(queue, ids[]) per queue), decrement the step
-- counters per step, complete the steps whose last task finished, release their dependents, count down the
-- runs, start every newly ready step of every run (one pgmq.send_batch per queue and start delay), and complete
-- the runs that finished. The single-task completion functions call the same implementation with one item, so
-- completion has one implementation; results, idempotency and fencing are exactly those of 0007.
--
-- The lock order of 0011_claims.sql holds: the runs of the batch (in run-id order), then the tasks' messages
-- (per queue, in message-id order), then the task rows.

------------------------------------------------------------------------------------------------------------
-- Starting ready steps and completing runs, for many runs at once
------------------------------------------------------------------------------------------------------------

-- Whether step events go anywhere (Supabase Realtime, or pgflow.notify = 'all'); when they do not, the batch
-- paths skip building them.
create function pgflow._step_events_enabled()
returns boolean
language sql
stable
set search_path = ''
as $$
  select to_regprocedure('realtime.send(jsonb,text,text,boolean)') is not null
      or coalesce(nullif(current_setting('pgflow.notify', true), ''), 'run') = 'all';
$$;

-- Starts every ready step that has tasks, in every started run of `p_run_ids`: one PGMQ message and one
-- step_tasks row per task, in the step's queue. Messages of steps sharing a queue and start delay go out in one
-- send_batch, across runs. A map task gets its array element (the run input for a root map, else the output of
-- its only dependency), read once with jsonb_array_elements.
create function pgflow._start_ready_steps(p_run_ids uuid[])
returns void
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_started record;
  v_runs uuid[];
  v_steps text[];
  v_counts int[];
  v_group record;
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
    v_counts := array_append(v_counts, v_started.remaining_tasks);
    if v_events then
      perform pgflow._emit('step:' || v_started.step_slug || ':started', v_started.run_id, jsonb_build_object(
        'event_type', 'step:started',
        'run_id', v_started.run_id,
        'step_slug', v_started.step_slug,
        'status', 'started',
        'started_at', v_started.started_at,
        'remaining_tasks', v_started.remaining_tasks,
        'remaining_deps', v_started.remaining_deps
      ));
    end if;
  end loop;

  if v_runs is null then
    return;
  end if;

  for v_group in
    select s.queue_name, coalesce(s.opt_start_delay, 0) as delay,
           array_agg(t.run_id order by t.run_id, t.step_slug, t.task_index) as run_ids,
           array_agg(r.flow_slug order by t.run_id, t.step_slug, t.task_index) as flow_slugs,
           array_agg(t.step_slug order by t.run_id, t.step_slug, t.task_index) as step_slugs,
           array_agg(t.task_index order by t.run_id, t.step_slug, t.task_index) as task_indexes,
           array_agg(t.element order by t.run_id, t.step_slug, t.task_index) as elements
    from unnest(v_runs, v_steps, v_counts) as x(run_id, step_slug, n)
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
        v_group.delay
      ) as id
    ) sent
    join unnest(v_group.flow_slugs, v_group.run_ids, v_group.step_slugs, v_group.task_indexes, v_group.elements)
           with ordinality as m(flow_slug, run_id, step_slug, task_index, element, ord)
      on m.ord = sent.ord;
  end loop;
end;
$$;

-- Upstream's start_ready_steps(run_id): the same, for one run.
create or replace function pgflow.start_ready_steps(run_id uuid)
returns void
language sql
volatile
set search_path = ''
as $$
  select pgflow._start_ready_steps(array[start_ready_steps.run_id]);
$$;

-- Completes every started run of `p_run_ids` whose steps are all completed or skipped. Output: {leaf_step:
-- output} over the completed leaf steps (steps nothing depends on), NULL when none completed. Emits
-- `run:completed` for each.
create function pgflow._complete_runs(p_run_ids uuid[])
returns void
language plpgsql
volatile
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
create or replace function pgflow.maybe_complete_run(run_id uuid)
returns void
language sql
volatile
set search_path = ''
as $$
  select pgflow._complete_runs(array[maybe_complete_run.run_id]);
$$;

------------------------------------------------------------------------------------------------------------
-- Completion
------------------------------------------------------------------------------------------------------------

-- The two rare outcomes of a completion that is current (task `started` with its attempt), handled one by one:
--   * the task's step already ended (not `started`): nothing to record, the message is archived;
--   * a single step feeding a map that is not sized yet produced something other than an array: a type
--     violation, which fails the task, the step and the run.
-- The caller holds the run row and the task's message. Returns whether the output was applied.
create function pgflow._complete_task_exception(p_run_id uuid, p_step_slug text, p_task_index int, p_output jsonb)
returns boolean
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_task pgflow.step_tasks;
  v_child text;
  v_type text;
  v_error text;
begin
  select t.* into v_task
  from pgflow.step_tasks t
  where t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index;

  if not exists (select 1 from pgflow.step_states ss
                 where ss.run_id = p_run_id and ss.step_slug = p_step_slug and ss.status = 'started') then
    perform pgmq.archive(v_task.queue_name, v_task.message_id);
    return false;
  end if;

  select d.step_slug into v_child
  from pgflow.deps d
  join pgflow.steps cs on cs.flow_slug = d.flow_slug and cs.step_slug = d.step_slug
  join pgflow.step_states cst on cst.run_id = p_run_id and cst.step_slug = d.step_slug
  where d.flow_slug = v_task.flow_slug and d.dep_slug = p_step_slug
    and cs.step_type = 'map' and cst.initial_tasks is null
  order by cs.step_index
  limit 1;
  v_type := coalesce(jsonb_typeof(p_output), 'null');
  v_error := format('[TYPE_VIOLATION] Map step %s expects array input but dependency %s produced %s',
                    v_child, p_step_slug, v_type);
  update pgflow.step_tasks t
  set status = 'failed', failed_at = now(), output = p_output,
      error_message = format('[TYPE_VIOLATION] Produced %s instead of array', v_type)
  where t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index;
  perform pgmq.archive(v_task.queue_name, v_task.message_id);

  update pgflow.step_states ss
  set status = 'failed', failed_at = now(), error_message = v_error
  where ss.run_id = p_run_id and ss.step_slug = p_step_slug;

  perform pgflow._fail_run(p_run_id, null);
  perform pgflow._emit('step:' || p_step_slug || ':failed', p_run_id,
    jsonb_build_object(
      'event_type', 'step:failed',
      'run_id', p_run_id,
      'step_slug', p_step_slug,
      'status', 'failed',
      'error_message', v_error,
      'failed_at', now()
    ));
  return true;
end;
$$;

-- The one implementation of completion: records the outputs of a batch of tasks (item i = run_ids[i],
-- step_slugs[i], task_indexes[i], outputs[i], attempts[i]). An item is applied only while its task is `started`
-- in a started run, and, when attempts[i] is not NULL, with that attempt, and, when p_worker_id is not NULL,
-- claimed by that worker (the fence of 0007); a task named twice is applied once. Everything else changes
-- nothing. Returns one row per item that names an existing task: its position, whether this call applied it,
-- and the task row afterwards.
create function pgflow._complete_tasks(
  p_run_ids uuid[],
  p_step_slugs text[],
  p_task_indexes int[],
  p_outputs jsonb[],
  p_attempts int[],
  p_worker_id uuid
)
returns table (ord int, applied boolean, task pgflow.step_tasks)
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_group record;
  v_normal int[];
  v_exceptions int[];
  v_applied int[] := '{}';
  v_ord int;
  v_queue text[];
  v_msg bigint[];
  v_done record;
  v_done_runs uuid[];
  v_done_steps text[];
  v_done_flows text[];
  v_done_children int[];
  v_ready_runs uuid[];
  v_fast_runs uuid[];
  v_finished_runs uuid[];
  v_run uuid;
  v_events boolean;
begin
  if coalesce(cardinality(p_run_ids), 0) = 0 then
    return;
  end if;

  -- Lock order 2: the runs of the batch, in run-id order.
  perform 1 from pgflow.runs r where r.run_id = any (p_run_ids) order by r.run_id for no key update;

  -- Lock order 3: the tasks' messages, per queue.
  for v_group in
    select t.queue_name, array_agg(t.message_id order by t.message_id) as ids
    from unnest(p_run_ids, p_step_slugs, p_task_indexes) as i(run_id, step_slug, task_index)
    join pgflow.step_tasks t on t.run_id = i.run_id and t.step_slug = i.step_slug and t.task_index = i.task_index
    where t.message_id is not null
    group by t.queue_name
    order by t.queue_name
  loop
    perform pgflow._lock_messages(v_group.queue_name, v_group.ids);
  end loop;

  -- Classify every item after the locks: current ones (the first current item of a task named twice) either
  -- complete normally or take one of the two rare paths; the rest are stale.
  select array_agg(c.ord order by c.ord) filter (where c.kind = 'normal'),
         array_agg(c.ord order by c.ord) filter (where c.kind = 'exception')
  into v_normal, v_exceptions
  from (
    select x.ord,
           case
             when not x.current then 'stale'
             -- A task named twice: the first current item wins.
             when x.ord <> min(x.ord) filter (where x.current) over (partition by x.run_id, x.step_slug, x.task_index)
               then 'stale'
             else x.kind
           end as kind
    from (
      select i.ord, i.run_id, i.step_slug, i.task_index,
             r.status is not distinct from 'started' and t.status is not distinct from 'started'
               and (p_attempts[i.ord] is null or t.attempts_count is not distinct from p_attempts[i.ord])
               and (p_worker_id is null or t.last_worker_id is not distinct from p_worker_id) as current,
             case
               when ss.status <> 'started' then 'exception'
               when s.step_type = 'single' and (i.output is null or jsonb_typeof(i.output) <> 'array')
                    and exists (
                      select 1
                      from pgflow.deps d
                      join pgflow.steps cs on cs.flow_slug = d.flow_slug and cs.step_slug = d.step_slug
                      join pgflow.step_states cst on cst.run_id = i.run_id and cst.step_slug = d.step_slug
                      where d.flow_slug = t.flow_slug and d.dep_slug = i.step_slug
                        and cs.step_type = 'map' and cst.initial_tasks is null) then 'exception'
               else 'normal'
             end as kind
      from unnest(p_run_ids, p_step_slugs, p_task_indexes, p_outputs)
             with ordinality as i(run_id, step_slug, task_index, output, ord)
      left join pgflow.step_tasks t
        on t.run_id = i.run_id and t.step_slug = i.step_slug and t.task_index = i.task_index
      left join pgflow.runs r on r.run_id = i.run_id
      left join pgflow.step_states ss on ss.run_id = i.run_id and ss.step_slug = i.step_slug
      left join pgflow.steps s on s.flow_slug = t.flow_slug and s.step_slug = t.step_slug
    ) x
  ) c;

  if v_normal is not null then
    -- Tasks, then their messages.
    with done as (
      update pgflow.step_tasks t
      set status = 'completed', completed_at = now(), output = i.output
      from unnest(p_run_ids, p_step_slugs, p_task_indexes, p_outputs)
             with ordinality as i(run_id, step_slug, task_index, output, ord)
      where i.ord = any (v_normal)
        and t.run_id = i.run_id and t.step_slug = i.step_slug and t.task_index = i.task_index
      returning t.queue_name, t.message_id
    )
    select array_agg(d.queue_name), array_agg(d.message_id) into v_queue, v_msg from done d;
    perform pgmq.archive(g.queue_name, g.ids)
    from (select q.queue_name, array_agg(q.msg) as ids
          from unnest(v_queue, v_msg) as q(queue_name, msg)
          where q.msg is not null
          group by q.queue_name) g;
    v_applied := v_normal;

    -- Step counters; a step whose last task finished completes with its output (a map: the task outputs in
    -- task order).
    with counted as (
      select i.run_id, i.step_slug, count(*)::int as n
      from unnest(p_run_ids, p_step_slugs) with ordinality as i(run_id, step_slug, ord)
      where i.ord = any (v_normal)
      group by i.run_id, i.step_slug
    ),
    counted_down as (
      update pgflow.step_states ss
      set remaining_tasks = ss.remaining_tasks - c.n,
          status = case when ss.remaining_tasks - c.n = 0 then 'completed' else ss.status end,
          completed_at = case when ss.remaining_tasks - c.n = 0 then now() end,
          output = case
            when ss.remaining_tasks - c.n > 0 then null
            when s.step_type = 'map' then (
              select jsonb_agg(t.output order by t.task_index) from pgflow.step_tasks t
              where t.run_id = ss.run_id and t.step_slug = ss.step_slug)
            else (select t.output from pgflow.step_tasks t
                  where t.run_id = ss.run_id and t.step_slug = ss.step_slug and t.task_index = 0)
          end
      from counted c, pgflow.steps s
      where ss.run_id = c.run_id and ss.step_slug = c.step_slug
        and s.flow_slug = ss.flow_slug and s.step_slug = ss.step_slug
      returning ss.run_id, ss.step_slug, ss.flow_slug, ss.status,
                case when s.step_type = 'map' then ss.initial_tasks
                     when jsonb_typeof(ss.output) = 'array' then jsonb_array_length(ss.output) end as child_tasks
    )
    select array_agg(x.run_id), array_agg(x.step_slug), array_agg(x.flow_slug), array_agg(x.child_tasks)
    into v_done_runs, v_done_steps, v_done_flows, v_done_children
    from counted_down x
    where x.status = 'completed';
  end if;

  if v_done_runs is not null then
    v_events := pgflow._step_events_enabled();
    if v_events then
      for v_done in
        select ss.run_id, ss.step_slug, ss.output, ss.completed_at
        from unnest(v_done_runs, v_done_steps) as d(run_id, step_slug)
        join pgflow.step_states ss on ss.run_id = d.run_id and ss.step_slug = d.step_slug
        order by ss.run_id, ss.step_slug
      loop
        perform pgflow._emit('step:' || v_done.step_slug || ':completed', v_done.run_id, jsonb_build_object(
          'event_type', 'step:completed',
          'run_id', v_done.run_id,
          'step_slug', v_done.step_slug,
          'status', 'completed',
          'output', v_done.output,
          'completed_at', v_done.completed_at
        ));
      end loop;
    end if;

    -- Dependents: one dependency fewer to wait for; a map dependent learns its task count.
    with rel as (
      select dn.run_id, d.step_slug as child, count(*)::int as n, max(dn.child_tasks) as child_tasks
      from unnest(v_done_runs, v_done_steps, v_done_flows, v_done_children)
             as dn(run_id, step_slug, flow_slug, child_tasks)
      join pgflow.deps d on d.flow_slug = dn.flow_slug and d.dep_slug = dn.step_slug
      group by dn.run_id, d.step_slug
    ),
    released as (
      update pgflow.step_states c
      set remaining_deps = c.remaining_deps - rel.n,
          initial_tasks = case when cs.step_type = 'map' and c.initial_tasks is null then rel.child_tasks
                               else c.initial_tasks end
      from rel, pgflow.steps cs
      where c.run_id = rel.run_id and c.step_slug = rel.child
        and cs.flow_slug = c.flow_slug and cs.step_slug = c.step_slug
      returning c.run_id, c.remaining_deps
    )
    select array_agg(distinct r.run_id) filter (where r.remaining_deps = 0) into v_ready_runs from released r;

    with counted as (
      select d.run_id, count(*)::int as n from unnest(v_done_runs) as d(run_id) group by d.run_id
    ),
    counted_down as (
      update pgflow.runs r
      set remaining_steps = r.remaining_steps - c.n
      from counted c
      where r.run_id = c.run_id
      returning r.run_id, r.remaining_steps
    )
    select array_agg(c.run_id) filter (where c.remaining_steps = 0) into v_finished_runs from counted_down c;

    -- Runs with newly ready steps: the common case (no condition, nothing taskless among the ready steps)
    -- starts them for all runs at once; the rest go through the full cascade of _advance_run.
    if v_ready_runs is not null then
      select array_agg(x.run_id) filter (where not x.needs_cascade) into v_fast_runs
      from (
        select rr.run_id, exists (
          select 1
          from pgflow.step_states ss
          join pgflow.steps s on s.flow_slug = ss.flow_slug and s.step_slug = ss.step_slug
          where ss.run_id = rr.run_id and ss.status = 'created' and ss.remaining_deps = 0
            and (ss.initial_tasks = 0 or s.required_input_pattern is not null
                 or s.forbidden_input_pattern is not null)) as needs_cascade
        from unnest(v_ready_runs) as rr(run_id)
      ) x;
      if v_fast_runs is not null then
        perform pgflow._start_ready_steps(v_fast_runs);
      end if;
      foreach v_run in array v_ready_runs loop
        if v_fast_runs is null or not v_run = any (v_fast_runs) then
          perform pgflow._advance_run(v_run);
        end if;
      end loop;
    end if;
    if v_finished_runs is not null then
      perform pgflow._complete_runs(v_finished_runs);
    end if;
  end if;

  -- The rare paths, one item at a time (the locks are held).
  if v_exceptions is not null then
    foreach v_ord in array v_exceptions loop
      if pgflow._complete_task_exception(p_run_ids[v_ord], p_step_slugs[v_ord], p_task_indexes[v_ord],
                                         p_outputs[v_ord]) then
        v_applied := v_applied || v_ord;
      end if;
    end loop;
  end if;

  return query
  select i.ord::int, i.ord = any (v_applied), t
  from unnest(p_run_ids, p_step_slugs, p_task_indexes) with ordinality as i(run_id, step_slug, task_index, ord)
  join pgflow.step_tasks t on t.run_id = i.run_id and t.step_slug = i.step_slug and t.task_index = i.task_index
  order by i.ord;
end;
$$;

-- Upstream's completion, unfenced, through the one implementation. Always returns the task row; for a task that
-- is not `started`, or of a run that is not started, nothing changes.
create or replace function pgflow.complete_task(run_id uuid, step_slug text, task_index int, output jsonb)
returns setof pgflow.step_tasks
language sql
volatile
set search_path = ''
as $$
  select (c.task).*
  from pgflow._complete_tasks(array[complete_task.run_id], array[complete_task.step_slug],
                              array[complete_task.task_index], array[complete_task.output], array[null::int],
                              null) c;
$$;

-- The fenced completion (0007), through the one implementation.
create or replace function pgflow.complete_task(
  run_id uuid,
  step_slug text,
  task_index int,
  output jsonb,
  attempt int,
  worker_id uuid default null
)
returns setof pgflow.task_outcome
language plpgsql
volatile
set search_path = ''
as $$
begin
  if attempt is null then
    raise exception 'complete_task(): attempt is required by the fenced form'
      using errcode = 'invalid_parameter_value',
            hint = 'Pass the attempt the claim returned, or call the four-argument complete_task.';
  end if;
  return query
  select (c.task).run_id, (c.task).step_slug, (c.task).task_index,
         case when c.applied then 'applied' else 'stale' end,
         (c.task).status, (c.task).attempts_count, (c.task).last_worker_id
  from pgflow._complete_tasks(array[complete_task.run_id], array[complete_task.step_slug],
                              array[complete_task.task_index], array[complete_task.output],
                              array[complete_task.attempt], complete_task.worker_id) c;
end;
$$;

-- The fenced batch (0007), set-based: one outcome row per item that names an existing task, in the order given.
create or replace function pgflow.complete_tasks(
  run_ids uuid[],
  step_slugs text[],
  task_indexes int[],
  outputs jsonb[],
  attempts int[],
  worker_id uuid default null
)
returns setof pgflow.task_outcome
language plpgsql
volatile
set search_path = ''
as $$
begin
  if cardinality(run_ids) is distinct from cardinality(step_slugs)
     or cardinality(run_ids) is distinct from cardinality(task_indexes)
     or cardinality(run_ids) is distinct from cardinality(outputs)
     or cardinality(run_ids) is distinct from cardinality(attempts) then
    raise exception 'complete_tasks(): array lengths differ (run_ids %, step_slugs %, task_indexes %, outputs %, attempts %)',
      cardinality(run_ids), cardinality(step_slugs), cardinality(task_indexes), cardinality(outputs),
      cardinality(attempts)
      using errcode = 'invalid_parameter_value';
  end if;
  if array_position(attempts, null) is not null then
    raise exception 'complete_tasks(): attempts[%] is NULL', array_position(attempts, null)
      using errcode = 'invalid_parameter_value',
            hint = 'Every item needs the attempt its claim returned.';
  end if;
  return query
  select (c.task).run_id, (c.task).step_slug, (c.task).task_index,
         case when c.applied then 'applied' else 'stale' end,
         (c.task).status, (c.task).attempts_count, (c.task).last_worker_id
  from pgflow._complete_tasks(complete_tasks.run_ids, complete_tasks.step_slugs, complete_tasks.task_indexes,
                              complete_tasks.outputs, complete_tasks.attempts, complete_tasks.worker_id) c
  order by c.ord;
end;
$$;

drop function pgflow._complete_task(uuid, text, integer, jsonb, integer, uuid);

-- The entry points above were replaced: they run with their owner's rights again (0014).
alter function pgflow.complete_task(uuid, text, integer, jsonb) security definer;
alter function pgflow.complete_task(uuid, text, integer, jsonb, integer, uuid) security definer;
alter function pgflow.complete_tasks(uuid[], text[], integer[], jsonb[], integer[], uuid) security definer;
revoke execute on all functions in schema pgflow from public;
