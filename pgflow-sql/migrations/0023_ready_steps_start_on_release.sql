-- pgflow-rs SQL core, migration 0023: a dependent that becomes ready starts in the update that releases it.
--
-- Completing a step released its dependents (remaining_deps) in one update, and _advance_runs then started
-- the ones that became ready with a second update of the same rows: one more row version per dependent step,
-- and more statements per exchange that makes steps ready. _complete_tasks now decides, per run, what
-- _advance_runs would: a started run none of whose newly ready steps needs the cascade (_needs_cascade), and
-- with no step that was ready and waiting before, takes the plain start, and its newly ready steps start in
-- the releasing update itself. Their events and tasks follow as before (step:started in run and step order,
-- then _create_step_tasks). Every other run with newly ready steps still goes through _advance_runs. A run
-- whose steps are all done completes through _complete_runs directly (_advance_runs found nothing to start
-- in it and did only that). Rows, values, events and messages are those of the previous path; the lock
-- order is unchanged (step states under their run rows).

-- As in 0021, with the dependents started in the releasing update.
create or replace function pgflow._complete_tasks(
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
  v_start_runs uuid[];
  v_start_steps text[];
  v_start_ats timestamptz[];
  v_start_tasks int[];
  v_i int;
  v_finished_runs uuid[];
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

    -- Dependents: one dependency fewer to wait for; a map dependent learns its task count. In a run whose
    -- newly ready steps take the plain start of _advance_runs (the run is started, none of its ready steps
    -- needs the cascade, and no step was ready before this release), those steps start in the same update;
    -- their tasks are created below. Other runs with ready steps go through _advance_runs.
    with rel as (
      select dn.run_id, d.step_slug as child, count(*)::int as n, max(dn.child_tasks) as child_tasks
      from unnest(v_done_runs, v_done_steps, v_done_flows, v_done_children)
             as dn(run_id, step_slug, flow_slug, child_tasks)
      join pgflow.deps d on d.flow_slug = dn.flow_slug and d.dep_slug = dn.step_slug
      group by dn.run_id, d.step_slug
    ),
    next as (
      select rel.run_id, rel.child, rel.n, x.initial_tasks, x.ready,
             x.ready and c.status = 'created' as startable,
             x.ready and c.status = 'created'
               and pgflow._needs_cascade(x.initial_tasks, cs.required_input_pattern, cs.forbidden_input_pattern)
               as cascade,
             r.status = 'started' as run_started
      from rel
      join pgflow.runs r on r.run_id = rel.run_id
      join pgflow.step_states c on c.run_id = rel.run_id and c.step_slug = rel.child
      join pgflow.steps cs on cs.flow_slug = c.flow_slug and cs.step_slug = c.step_slug
      cross join lateral (
        select case when cs.step_type = 'map' and c.initial_tasks is null then rel.child_tasks
                    else c.initial_tasks end as initial_tasks,
               c.remaining_deps - rel.n = 0 as ready
      ) x
    ),
    -- Per run: whether its newly ready steps take the plain start.
    plain as materialized (
      select n.run_id,
             bool_or(n.ready) and bool_and(n.run_started) and not bool_or(n.cascade)
               and not exists (select 1 from pgflow.step_states w
                               where w.run_id = n.run_id and w.status = 'created' and w.remaining_deps = 0)
               as plain
      from next n
      group by n.run_id
    ),
    -- Per step: whether it starts now (a created step with tasks, newly ready in a plain run).
    decided as (
      select n.run_id, n.child, n.n, n.initial_tasks, n.ready, p.plain,
             p.plain and n.startable and n.initial_tasks > 0 as start
      from next n
      join plain p on p.run_id = n.run_id
    ),
    released as (
      update pgflow.step_states c
      set remaining_deps = c.remaining_deps - d.n,
          initial_tasks = d.initial_tasks,
          status = case when d.start then 'started' else c.status end,
          started_at = case when d.start then now() else c.started_at end,
          remaining_tasks = case when d.start then d.initial_tasks else c.remaining_tasks end
      from decided d
      where c.run_id = d.run_id and c.step_slug = d.child
      returning c.run_id, c.step_slug, d.ready, d.plain, d.start, c.started_at, c.remaining_tasks
    )
    select array_agg(r.run_id order by r.run_id, r.step_slug) filter (where r.start),
           array_agg(r.step_slug order by r.run_id, r.step_slug) filter (where r.start),
           array_agg(r.started_at order by r.run_id, r.step_slug) filter (where r.start),
           array_agg(r.remaining_tasks order by r.run_id, r.step_slug) filter (where r.start),
           array_agg(distinct r.run_id) filter (where r.ready and not r.plain)
    into v_start_runs, v_start_steps, v_start_ats, v_start_tasks, v_ready_runs
    from released r;

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

    -- The steps started above: their events, in run and step order, then their tasks (as _start_ready_steps).
    if v_start_runs is not null then
      if v_events then
        for v_i in 1 .. cardinality(v_start_runs) loop
          perform pgflow._emit_step_started(v_start_runs[v_i], v_start_steps[v_i], v_start_ats[v_i],
                                            v_start_tasks[v_i], 0);
        end loop;
      end if;
      perform pgflow._create_step_tasks(v_start_runs, v_start_steps);
    end if;

    -- The other runs with newly ready steps go through _advance_runs. Runs whose steps are all done have
    -- nothing to start (_advance_runs would only complete them) and complete directly.
    if v_ready_runs is not null then
      perform pgflow._advance_runs(v_ready_runs);
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

revoke execute on all functions in schema pgflow from public;
