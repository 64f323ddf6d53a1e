-- pgflow-rs SQL core: fewer statements per exchange.
-- - pgflow.exchange reads its queue for the rest of its free slots only when that read has something to
--   find (06_runs.sql, CLAIMED AT CREATION): when counting the queue's visible messages found some, or when a
--   task on its queue was created queued. After it created dependents already claimed on an otherwise empty
--   queue, it used to read that queue for nothing.
-- - _complete_tasks archives the completed tasks' messages in the statement that completes the tasks, and
--   counts the runs' steps down in the statement that releases the dependents.
-- - pgflow.exchange sets its two signal settings in one statement, and clears its three settings in one.

-- ---- as in schema/06_runs.sql : pgflow._create_step_tasks ----
create or replace function pgflow._create_step_tasks(p_run_ids uuid[], p_step_slugs text[])
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
-- ---- end pgflow._create_step_tasks ----

-- ---- as in schema/08_completion.sql : pgflow._complete_tasks ----
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
  v_archived int;
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

  -- Lock order 3: the tasks' messages, per queue in message order. A completion that can fail its run cancels
  -- the run's other live tasks: their messages are locked here too, in the same order, never after the
  -- batch's own. It can when a single step's non-array output feeds a map that has no task count yet, or when
  -- it completes its step in a flow with a step that fails the run on an unmet condition.
  for v_group in
    with item as (
      select t.run_id, t.flow_slug, t.step_slug, t.queue_name, t.message_id, i.output,
             count(*) over (partition by t.run_id, t.step_slug) as n
      from unnest(p_run_ids, p_step_slugs, p_task_indexes, p_outputs) as i(run_id, step_slug, task_index, output)
      join pgflow.step_tasks t
        on t.run_id = i.run_id and t.step_slug = i.step_slug and t.task_index = i.task_index
    ),
    failing as (
      select distinct it.run_id
      from item it
      join pgflow.steps s on s.flow_slug = it.flow_slug and s.step_slug = it.step_slug
      where (s.step_type = 'single' and jsonb_typeof(it.output) is distinct from 'array'
             and exists (
               select 1
               from pgflow.deps d
               join pgflow.steps cs on cs.flow_slug = d.flow_slug and cs.step_slug = d.step_slug
               join pgflow.step_states cst on cst.run_id = it.run_id and cst.step_slug = d.step_slug
               where d.flow_slug = it.flow_slug and d.dep_slug = it.step_slug
                 and cs.step_type = 'map' and cst.initial_tasks is null))
         or (exists (select 1 from pgflow.step_states ss
                     where ss.run_id = it.run_id and ss.step_slug = it.step_slug and ss.remaining_tasks <= it.n)
             and exists (select 1 from pgflow.steps fs
                         where fs.flow_slug = it.flow_slug and fs.when_unmet = 'fail'
                           and (fs.required_input_pattern is not null or fs.forbidden_input_pattern is not null)))
    ),
    msg as (
      select it.queue_name, it.message_id from item it where it.message_id is not null
      union
      select o.queue_name, o.message_id
      from failing f
      join pgflow.step_tasks o on o.run_id = f.run_id
      where o.status in ('queued', 'started') and o.message_id is not null
    )
    select m.queue_name, array_agg(m.message_id order by m.message_id) as ids
    from msg m
    group by m.queue_name
    order by m.queue_name
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
    -- Tasks, then their messages, in one statement.
    with done as (
      update pgflow.step_tasks t
      set status = 'completed', completed_at = now(), output = i.output
      from unnest(p_run_ids, p_step_slugs, p_task_indexes, p_outputs)
             with ordinality as i(run_id, step_slug, task_index, output, ord)
      where i.ord = any (v_normal)
        and t.run_id = i.run_id and t.step_slug = i.step_slug and t.task_index = i.task_index
      returning t.queue_name, t.message_id
    )
    select count(pgflow._queue_op(g.queue_name, 'archive', g.ids)) into v_archived
    from (select d.queue_name, array_agg(d.message_id) as ids
          from done d
          where d.message_id is not null
          group by d.queue_name) g;
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
    ),
    -- The runs' step counters, in the same statement.
    runs_counted_down as (
      update pgflow.runs r
      set remaining_steps = r.remaining_steps - c.n
      from (select d.run_id, count(*)::int as n from unnest(v_done_runs) as d(run_id) group by d.run_id) c
      where r.run_id = c.run_id
      returning r.run_id, r.remaining_steps
    )
    select array_agg(r.run_id order by r.run_id, r.step_slug) filter (where r.start),
           array_agg(r.step_slug order by r.run_id, r.step_slug) filter (where r.start),
           array_agg(r.started_at order by r.run_id, r.step_slug) filter (where r.start),
           array_agg(r.remaining_tasks order by r.run_id, r.step_slug) filter (where r.start),
           array_agg(distinct r.run_id) filter (where r.ready and not r.plain),
           (select array_agg(c.run_id) filter (where c.remaining_steps = 0) from runs_counted_down c)
    into v_start_runs, v_start_steps, v_start_ats, v_start_tasks, v_ready_runs, v_finished_runs
    from released r;

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

  -- Results that changed nothing leave a trace in the event log.
  if coalesce(cardinality(v_applied), 0) < cardinality(p_run_ids) then
    perform pgflow._log_stale_results(p_run_ids, p_step_slugs, p_task_indexes, p_attempts, p_worker_id, v_applied);
  end if;

  return query
  select i.ord::int, i.ord = any (v_applied), t
  from unnest(p_run_ids, p_step_slugs, p_task_indexes) with ordinality as i(run_id, step_slug, task_index, ord)
  join pgflow.step_tasks t on t.run_id = i.run_id and t.step_slug = i.step_slug and t.task_index = i.task_index
  order by i.ord;
end;
$$;
-- ---- end pgflow._complete_tasks ----

-- ---- as in schema/08_completion.sql : pgflow.exchange ----
create or replace function pgflow.exchange(queue_name text, worker_id uuid, flow_slugs text[], step_slugs text[], qty integer, vt integer, run_ids uuid[], done_step_slugs text[], task_indexes integer[], outputs jsonb[], attempts integer[])
returns table(outcome text, msg_id bigint, flow_slug text, run_id uuid, step_slug text, task_index integer, input jsonb, flow_input jsonb, attempts_count integer, timeout integer, report jsonb, status text)
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
as $$
declare
  v_qty int := coalesce(exchange.qty, 0);
  v_claim jsonb;
  v_claimed bigint[];
  v_n int;
begin
  perform pgflow._replan_if_grown();
  if coalesce(cardinality(exchange.run_ids), 0) > 0 then
    if array_position(exchange.attempts, null) is not null
       or cardinality(exchange.attempts) is distinct from cardinality(exchange.run_ids) then
      raise exception 'exchange(): every completion needs the attempt its claim returned'
        using errcode = 'invalid_parameter_value';
    end if;
    perform set_config('pgflow.signal_source', 'exchange', true),
            set_config('pgflow.signal_worker', exchange.worker_id::text, true);
    -- Nothing is created claimed for a worker of a disabled function (the claims' fence).
    if v_qty > 0 and cardinality(exchange.flow_slugs) = cardinality(exchange.step_slugs)
       and pgflow._worker_disabled(exchange.worker_id) is null then
      perform set_config('pgflow.exchange_claim',
                         jsonb_build_object('queue', lower(exchange.queue_name), 'worker', exchange.worker_id,
                                            'budget', v_qty,
                                            'pairs', (select jsonb_agg(jsonb_build_array(p.flow_slug, p.step_slug))
                                                      from unnest(exchange.flow_slugs, exchange.step_slugs)
                                                             as p(flow_slug, step_slug)))::text,
                         true);
    end if;
    return query
    select case when c.applied then 'applied' else 'stale' end, null::bigint, (c.task).flow_slug,
           (c.task).run_id, (c.task).step_slug, (c.task).task_index, null::jsonb, null::jsonb,
           (c.task).attempts_count, null::int, null::jsonb, (c.task).status
    from pgflow._complete_tasks(exchange.run_ids, exchange.done_step_slugs, exchange.task_indexes,
                                exchange.outputs, exchange.attempts, exchange.worker_id) c
    order by c.ord;
    v_claim := nullif(current_setting('pgflow.exchange_claim', true), '')::jsonb;
    select array_agg(c.id::bigint order by c.id::bigint) into v_claimed
    from jsonb_array_elements_text(v_claim -> 'claimed') as c(id);
    perform set_config('pgflow.exchange_claim', '', true), set_config('pgflow.signal_source', '', true),
            set_config('pgflow.signal_worker', '', true);
    if v_claimed is not null then
      -- Created claimed; a task the same completions then ended (its run failed) is not returned.
      return query
      select c.outcome, c.msg_id, c.flow_slug, c.run_id, c.step_slug, c.task_index, c.input, c.flow_input,
             c.attempts_count, c.timeout, c.report, null::text
      from pgflow._claimed_rows(lower(exchange.queue_name), v_claimed) c;
      get diagnostics v_n = row_count;
      v_qty := v_qty - v_n;
      -- The read for the rest is skipped when it has nothing to find (CLAIMED AT CREATION, 06_runs.sql).
      if not (v_claim ? 'read') then
        v_qty := 0;
      end if;
    end if;
  end if;
  if v_qty > 0 then
    return query
    select c.outcome, c.msg_id, c.flow_slug, c.run_id, c.step_slug, c.task_index, c.input, c.flow_input,
           c.attempts_count, c.timeout, c.report, null::text
    from pgflow.read_and_claim_tasks(exchange.queue_name, v_qty, exchange.vt, exchange.worker_id,
                                     exchange.flow_slugs, exchange.step_slugs) c;
  end if;
end;
$$;
-- ---- end pgflow.exchange ----
