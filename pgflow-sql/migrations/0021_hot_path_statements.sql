-- pgflow-rs SQL core, migration 0021: fewer statements and fewer writes per exchange and per started run.
--
-- Profiled with perf on one session driving a diamond flow hop by hop, the server spent more time preparing
-- statements than running them, and a claim wrote every message twice. Behaviour is unchanged:
--   * SQL-language functions with a SET clause are never inlined, and PostgreSQL 15 parses and plans their
--     body on every call. _step_events_enabled (twice per exchange) and resolve_flow_slug (every start)
--     become PL/pgSQL, whose plans are cached per session; _advance_run calls the set-based functions
--     directly instead of through the SQL wrappers start_ready_steps and maybe_complete_run; new tasks go
--     out through pgmq.send_batch's PL/pgSQL form instead of its SQL overload.
--   * Whether a run's ready steps need the cascade (a condition, or no tasks) is decided in one place,
--     _advance_runs, for completions and, now, for start_flow too: a new run's root steps start directly
--     unless they need it. start_flow reads the flow's steps once.
--   * The queue signal of 0017 is one statement, sent by the function that creates tasks instead of by a
--     statement trigger with a transition table.
--   * read_and_claim_tasks (and so pgflow.exchange) locks the oldest visible messages as pgmq.read does but
--     leaves them untouched; the claim then writes each message once (visibility, read_ct, last_read_at).
--     pgmq.read wrote them first and the claim again, and the claim locked them a second time.
--   * Every task row is updated twice after its insert (claimed, then finished). The finishing update changes
--     no indexed column, so with free space on the page PostgreSQL keeps it there without new index entries
--     (a HOT update). step_tasks gets that space, as runs did in 0019.
-- Single session, diamond runs hop by hop: about 15 % less server time per run, and start_flow about a third
-- less. Functions replaced here keep the settings 0014, 0019 and 0020 gave them.

------------------------------------------------------------------------------------------------------------
-- Planned once per session, not per call
------------------------------------------------------------------------------------------------------------

create or replace function pgflow._step_events_enabled()
returns boolean
language plpgsql
stable
set search_path = ''
as $$
begin
  return to_regprocedure('realtime.send(jsonb,text,text,boolean)') is not null
      or coalesce(nullif(current_setting('pgflow.notify', true), ''), 'run') = 'all';
end;
$$;

-- As in 0006, calling the set-based forms directly.
create or replace function pgflow._advance_run(p_run_id uuid)
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
  perform pgflow._start_ready_steps(array[p_run_id]);
  perform pgflow._complete_runs(array[p_run_id]);
  return true;
end;
$$;

-- As in 0016, sending through pgmq.send_batch's PL/pgSQL form, and signalling the queues it sent to (the
-- statement trigger of 0017 did that for every insert into step_tasks; this function is the only one that
-- creates tasks).
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
  v_counts int[];
  v_group record;
  v_queues text[];
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

-- The signal of 0017 in one statement: due queues whose row no other transaction holds are stamped, and a
-- queue without a row (created outside compilation) gets one; each of them is notified.
create or replace function pgflow._signal_queues(p_queues text[])
returns void
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_queue text;
begin
  for v_queue in
    with wanted as (
      select distinct q.name from unnest(p_queues) as q(name) where q.name is not null
    ),
    due as (
      select s.queue_name
      from pgflow.queue_signals s
      where s.queue_name in (select w.name from wanted w)
        and s.signaled_at < clock_timestamp() - pgflow._signal_interval()
      order by s.queue_name
      for update skip locked
    ),
    stamped as (
      update pgflow.queue_signals s
      set signaled_at = clock_timestamp()
      from due
      where s.queue_name = due.queue_name
      returning s.queue_name
    ),
    added as (
      insert into pgflow.queue_signals (queue_name, signaled_at)
      select w.name, clock_timestamp()
      from wanted w
      where not exists (select 1 from pgflow.queue_signals s where s.queue_name = w.name)
      on conflict do nothing
      returning queue_name
    )
    select x.queue_name from stamped x
    union all
    select a.queue_name from added a
  loop
    perform pg_notify('pgflow_queue_signal', v_queue);
  end loop;
end;
$$;

drop trigger step_tasks_signal_queues on pgflow.step_tasks;
drop function pgflow._signal_new_tasks();

------------------------------------------------------------------------------------------------------------
-- Starting a run
------------------------------------------------------------------------------------------------------------

-- As in 0015, planned once per session.
create or replace function pgflow.resolve_flow_slug(flow_slug text)
returns text
language plpgsql
stable
set search_path = ''
as $$
begin
  return coalesce(
    (select a.flow_slug from pgflow.flow_aliases a where a.alias = resolve_flow_slug.flow_slug),
    resolve_flow_slug.flow_slug);
end;
$$;

-- As in 0015, reading the flow's steps once and advancing the new run through _advance_runs.
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

  insert into pgflow.step_states (flow_slug, run_id, step_slug, remaining_deps, initial_tasks)
  select s.flow_slug, v_run.run_id, s.step_slug, s.deps_count,
         case when s.step_type = 'single' then 1
              when s.deps_count = 0 then v_root_len
         end
  from pgflow.steps s
  where s.flow_slug = v_slug;

  perform pgflow._emit('run:started', v_run.run_id, jsonb_build_object(
    'event_type', 'run:started',
    'run_id', v_run.run_id,
    'flow_slug', v_run.flow_slug,
    'input', v_run.input,
    'status', 'started',
    'remaining_steps', v_run.remaining_steps,
    'started_at', v_run.started_at
  ));

  perform pgflow._advance_runs(array[v_run.run_id]);

  return query select r.* from pgflow.runs r where r.run_id = v_run.run_id;
end;
$$;

------------------------------------------------------------------------------------------------------------
-- Advancing runs
------------------------------------------------------------------------------------------------------------

-- Advances the runs `p_run_ids` after their steps changed: the one place that decides how. Runs none of whose
-- ready steps needs the cascade (a condition to evaluate, or no tasks) start those steps together, set-based;
-- the others go through the full cascade of _advance_run (which completes its run when it can). The fast runs
-- whose steps are all done complete.
create function pgflow._advance_runs(p_run_ids uuid[])
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
        and (ss.initial_tasks = 0 or s.required_input_pattern is not null
             or s.forbidden_input_pattern is not null)) as needs_cascade
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

-- As in 0016, advancing the runs through _advance_runs.
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

    -- Runs with newly ready steps start them; runs whose steps are all done complete.
    if v_ready_runs is not null or v_finished_runs is not null then
      perform pgflow._advance_runs(coalesce(v_ready_runs, '{}') || coalesce(v_finished_runs, '{}'));
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

------------------------------------------------------------------------------------------------------------
-- Claims: the messages pgmq.read locked are not locked again
------------------------------------------------------------------------------------------------------------

-- The claim of 0015. read_vt NULL: the caller read the messages in an earlier transaction, so they are locked
-- here first. read_vt set: this transaction's locking read holds them; each is counted as read (read_ct,
-- last_read_at) and the ones not claimed, deferred or released stay invisible for read_vt seconds, as after
-- pgmq.read.
create function pgflow._claim_tasks(
  queue_name text,
  msg_ids bigint[],
  worker_id uuid,
  flow_slugs text[],
  step_slugs text[],
  read_vt int
)
returns table (
  outcome text,
  msg_id bigint,
  flow_slug text,
  run_id uuid,
  step_slug text,
  task_index int,
  input jsonb,
  flow_input jsonb,
  attempts_count int,
  timeout int,
  report jsonb
)
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_queue text := lower(_claim_tasks.queue_name);
  v_ids bigint[];
  v_table text;
  v_claim_ids bigint[];
  v_defer_ids bigint[];
  v_defer_vts timestamptz[];
  v_archive_ids bigint[];
  v_wait_ids bigint[];
  v_unsupported_ids bigint[];
  v_run_ids uuid[];
  v_step_slugs text[];
  v_task_indexes int[];
  v_secs float8[];
  v_updated int;
  v_disabled jsonb;
  v_report jsonb;
  -- After a locking read, every message is counted as read once, as pgmq.read would have.
  v_read int := case when _claim_tasks.read_vt is null then 0 else 1 end;
begin
  if cardinality(_claim_tasks.flow_slugs) is distinct from cardinality(_claim_tasks.step_slugs) then
    raise exception 'claim_tasks(): flow_slugs and step_slugs differ in length (% and %)',
      cardinality(_claim_tasks.flow_slugs), cardinality(_claim_tasks.step_slugs)
      using errcode = 'invalid_parameter_value';
  end if;
  select coalesce(array_agg(distinct i order by i), '{}') into v_ids
  from unnest(_claim_tasks.msg_ids) as i where i is not null;
  if cardinality(v_ids) = 0 then
    return;
  end if;
  v_table := pgmq.format_table_name(v_queue, 'q');

  -- Lock order step 3: the batch's messages, unless this transaction's locking read holds them already.
  if _claim_tasks.read_vt is null then
    perform pgflow._lock_messages(v_queue, v_ids);
  end if;

  -- The fence: a worker of a disabled function claims nothing.
  select jsonb_build_object('function_name', wf.function_name, 'reason', wf.disabled_reason,
                            'disabled_at', wf.disabled_at)
  into v_disabled
  from pgflow.workers w
  join pgflow.worker_functions wf on wf.function_name = w.function_name
  where w.worker_id = _claim_tasks.worker_id and not wf.enabled;

  -- Lock order step 4: every task of the batch, in message order, classified in the same statement.
  with pairs as (
    select p.flow_slug, p.step_slug
    from unnest(_claim_tasks.flow_slugs, _claim_tasks.step_slugs) as p(flow_slug, step_slug)
  ),
  locked as (
    select t.message_id as id,
           t.run_id, t.step_slug, t.task_index, t.started_at,
           coalesce(s.opt_timeout, f.opt_timeout) as timeout,
           case
             when not exists (select 1 from pairs p where p.flow_slug = t.flow_slug and p.step_slug = t.step_slug)
               then 'unsupported'
             when t.status = 'queued' and r.status = 'started' and ss.status = 'started' then 'claim'
             when t.status = 'queued' then 'wait'
             when t.status = 'started' then 'defer'
             else 'archive'
           end as kind
    from pgflow.step_tasks t
    join pgflow.runs r on r.run_id = t.run_id
    join pgflow.step_states ss on ss.run_id = t.run_id and ss.step_slug = t.step_slug
    join pgflow.steps s on s.flow_slug = t.flow_slug and s.step_slug = t.step_slug
    join pgflow.flows f on f.flow_slug = t.flow_slug
    where t.queue_name = v_queue and t.message_id = any (v_ids)
    order by t.message_id
    for update of t
  ),
  classified as (
    select m.id, l.run_id, l.step_slug, l.task_index, l.started_at, l.timeout,
           coalesce(l.kind, 'unsupported') as kind
    from unnest(v_ids) as m(id)
    left join locked l on l.id = m.id
  )
  select array_agg(c.id order by c.id) filter (where c.kind = 'claim'),
         array_agg(c.run_id order by c.id) filter (where c.kind = 'claim'),
         array_agg(c.step_slug order by c.id) filter (where c.kind = 'claim'),
         array_agg(c.task_index order by c.id) filter (where c.kind = 'claim'),
         array_agg(c.timeout::float8 + pgflow._claim_visibility_buffer_seconds() order by c.id)
           filter (where c.kind = 'claim'),
         array_agg(c.id order by c.id) filter (where c.kind = 'defer'),
         array_agg(greatest(pgflow._recovery_boundary(c.started_at, c.timeout),
                            clock_timestamp() + make_interval(secs => pgflow._claim_visibility_buffer_seconds()))
                   order by c.id) filter (where c.kind = 'defer'),
         array_agg(c.id order by c.id) filter (where c.kind = 'archive'),
         array_agg(c.id order by c.id) filter (where c.kind = 'wait'),
         array_agg(c.id order by c.id) filter (where c.kind = 'unsupported')
  into v_claim_ids, v_run_ids, v_step_slugs, v_task_indexes, v_secs,
       v_defer_ids, v_defer_vts, v_archive_ids, v_wait_ids, v_unsupported_ids
  from classified c;

  if v_unsupported_ids is not null or v_disabled is not null then
    -- No mutation except making the whole batch visible again.
    execute format(
      'update pgmq.%I q
          set vt = clock_timestamp(), read_ct = q.read_ct + $2,
              last_read_at = case when $2 = 1 then clock_timestamp() else q.last_read_at end
        where q.msg_id = any ($1)',
      v_table)
    using v_ids, v_read;

    if v_disabled is not null then
      return query select 'disabled'::text, null::bigint, null::text, null::uuid, null::text, null::int,
                          null::jsonb, null::jsonb, null::int, null::int, v_disabled;
      return;
    end if;

    execute format($q$
      with msgs as (
        select u.id,
               t.flow_slug as t_flow, t.step_slug as t_step,
               q.message ->> 'flow_slug' as b_flow, q.message ->> 'step_slug' as b_step,
               q.message ->> 'run_id' as b_run, q.message ->> 'task_index' as b_index
        from unnest($1::bigint[]) as u(id)
        left join pgflow.step_tasks t on t.queue_name = $2 and t.message_id = u.id
        left join pgmq.%I q on q.msg_id = u.id
      ),
      reasons as (
        select m.id, coalesce(m.t_flow, m.b_flow) as flow_slug, coalesce(m.t_step, m.b_step) as step_slug,
               case
                 when m.t_flow is not null then 'unsupported_route'
                 when m.b_run ~ '^[0-9a-fA-F-]{36}$' and m.b_index ~ '^[0-9]+$' and exists (
                        select 1 from pgflow.step_tasks o
                        where o.run_id = m.b_run::uuid and o.step_slug = m.b_step
                          and o.task_index = m.b_index::int and o.queue_name <> $2) then 'wrong_queue'
                 else 'no_task'
               end as reason
        from msgs m
      )
      select jsonb_build_object(
        'queue_name', $2,
        'msg_ids', to_jsonb($3::bigint[]),
        'unsupported_msg_ids', to_jsonb($1::bigint[]),
        'flows', coalesce((select jsonb_agg(distinct r.flow_slug) from reasons r where r.flow_slug is not null), '[]'),
        'steps', coalesce((select jsonb_agg(distinct r.step_slug) from reasons r where r.step_slug is not null), '[]'),
        'messages', (select jsonb_agg(jsonb_build_object('msg_id', r.id, 'reason', r.reason,
                                      'flow_slug', r.flow_slug, 'step_slug', r.step_slug) order by r.id)
                     from reasons r),
        'supported', coalesce((select jsonb_agg(jsonb_build_array(p.flow_slug, p.step_slug))
                               from unnest($4::text[], $5::text[]) as p(flow_slug, step_slug)), '[]'))
    $q$, v_table)
    into v_report
    using v_unsupported_ids, v_queue, v_ids, _claim_tasks.flow_slugs, _claim_tasks.step_slugs;

    return query select 'unsupported'::text, null::bigint, null::text, null::uuid, null::text, null::int,
                        null::jsonb, null::jsonb, null::int, null::int, v_report;
    return;
  end if;

  -- Fully supported batch: claim, defer, archive.
  if v_claim_ids is not null then
    update pgflow.step_tasks t
    set status = 'started',
        attempts_count = t.attempts_count + 1,
        -- A claim whose transaction began before the task was queued still starts it no earlier
        -- than it was queued (started_at_is_after_queued_at).
        started_at = greatest(now(), t.queued_at),
        last_worker_id = _claim_tasks.worker_id
    from unnest(v_run_ids, v_step_slugs, v_task_indexes) as c(run_id, step_slug, task_index)
    where t.run_id = c.run_id and t.step_slug = c.step_slug and t.task_index = c.task_index
      and t.status = 'queued';
  end if;

  -- Each message's visibility, in one update: claimed ones for the step timeout plus the claim buffer,
  -- deferred ones until their recovery boundary; after a locking read, the others from now for read_vt
  -- seconds, as pgmq.read leaves them (archived ones are archived next).
  if v_claim_ids is not null or v_defer_ids is not null or _claim_tasks.read_vt is not null then
    execute format($q$
      with v(id, vt) as (
        select c.id, clock_timestamp() + make_interval(secs => c.secs)
        from unnest($1::bigint[], $2::float8[]) as c(id, secs)
        union all
        select d.id, d.vt from unnest($3::bigint[], $4::timestamptz[]) as d(id, vt)
        union all
        select o.id, clock_timestamp() + make_interval(secs => $5) from unnest($6::bigint[]) as o(id)
        where $5 is not null
      ),
      updated as (
        update pgmq.%I q
        set vt = v.vt, read_ct = q.read_ct + $7,
            last_read_at = case when $7 = 1 then clock_timestamp() else q.last_read_at end
        from v
        where q.msg_id = v.id
        returning q.msg_id
      )
      select count(*) filter (where u.msg_id = any ($1)) from updated u
    $q$, v_table)
    into v_updated
    using v_claim_ids, v_secs, v_defer_ids, v_defer_vts, _claim_tasks.read_vt,
          coalesce(v_wait_ids, '{}') || coalesce(v_archive_ids, '{}'), v_read;
    if v_updated <> coalesce(cardinality(v_claim_ids), 0) then
      raise exception 'claim_tasks(): visibility updated % of % claimed messages', v_updated, cardinality(v_claim_ids)
        using detail = format('queue %s, messages %s', v_queue, v_claim_ids::text),
              hint = 'A claimed message is missing from its queue; no task was claimed.';
    end if;
  end if;

  if v_archive_ids is not null then
    perform pgmq.archive(v_queue, v_archive_ids);
  end if;

  if v_claim_ids is not null then
    return query
    select 'claimed'::text, c.msg_id, t.flow_slug, t.run_id, t.step_slug, t.task_index, i.input, i.flow_input,
           t.attempts_count, coalesce(s.opt_timeout, f.opt_timeout), null::jsonb
    from unnest(v_run_ids, v_step_slugs, v_task_indexes, v_claim_ids)
           with ordinality as c(run_id, step_slug, task_index, msg_id, ord)
    join pgflow.step_tasks t on t.run_id = c.run_id and t.step_slug = c.step_slug and t.task_index = c.task_index
    join pgflow.steps s on s.flow_slug = t.flow_slug and s.step_slug = t.step_slug
    join pgflow.flows f on f.flow_slug = t.flow_slug
    join pgflow.runs r on r.run_id = t.run_id
    cross join lateral pgflow._task_inputs(t.run_id, t.flow_slug, t.step_slug, s.step_type, s.deps_count,
                                           t.element, r.input) i
    order by c.ord;
  end if;
  return query
  select x.kind, x.id, null::text, null::uuid, null::text, null::int, null::jsonb, null::jsonb, null::int,
         null::int, null::jsonb
  from (
    select 'deferred'::text as kind, d.id from unnest(v_defer_ids) as d(id)
    union all
    select 'archived', a.id from unnest(v_archive_ids) as a(id)
    union all
    select 'waiting', w.id from unnest(v_wait_ids) as w(id)
  ) x
  order by x.id;
end;
$$;

-- The claim of 0015 for messages read in an earlier transaction: locks them first.
create or replace function pgflow.claim_tasks(
  queue_name text,
  msg_ids bigint[],
  worker_id uuid,
  flow_slugs text[],
  step_slugs text[]
)
returns table (
  outcome text,
  msg_id bigint,
  flow_slug text,
  run_id uuid,
  step_slug text,
  task_index int,
  input jsonb,
  flow_input jsonb,
  attempts_count int,
  timeout int,
  report jsonb
)
language plpgsql
volatile
security definer
set search_path = ''
set plan_cache_mode = force_generic_plan
set enable_seqscan = off
as $$
begin
  return query
  select * from pgflow._claim_tasks(claim_tasks.queue_name, claim_tasks.msg_ids, claim_tasks.worker_id,
                                    claim_tasks.flow_slugs, claim_tasks.step_slugs, null);
end;
$$;

-- The read and claim of 0015, in one transaction. The read locks the oldest visible messages exactly as
-- pgmq.read does (in message order, skipping those another transaction holds) but leaves their visibility to
-- the claim, which sets it once: pgmq.read would set it first to `vt` seconds, and the claim again.
create or replace function pgflow.read_and_claim_tasks(
  queue_name text,
  qty int,
  vt int,
  worker_id uuid,
  flow_slugs text[],
  step_slugs text[]
)
returns table (
  outcome text,
  msg_id bigint,
  flow_slug text,
  run_id uuid,
  step_slug text,
  task_index int,
  input jsonb,
  flow_input jsonb,
  attempts_count int,
  timeout int,
  report jsonb
)
language plpgsql
volatile
security definer
set search_path = ''
set plan_cache_mode = force_generic_plan
set enable_seqscan = off
as $$
declare
  v_ids bigint[];
begin
  -- Lock order step 3: the messages.
  execute format(
    'select array_agg(x.msg_id order by x.msg_id) from (
       select q.msg_id from pgmq.%I q where q.vt <= clock_timestamp()
       order by q.msg_id limit $1 for update skip locked) x',
    pgmq.format_table_name(read_and_claim_tasks.queue_name, 'q'))
  into v_ids
  using read_and_claim_tasks.qty;
  if v_ids is null then
    return;
  end if;
  return query
  select * from pgflow._claim_tasks(read_and_claim_tasks.queue_name, v_ids, read_and_claim_tasks.worker_id,
                                    read_and_claim_tasks.flow_slugs, read_and_claim_tasks.step_slugs,
                                    coalesce(read_and_claim_tasks.vt, 0));
end;
$$;

------------------------------------------------------------------------------------------------------------
-- Room for HOT updates of tasks
------------------------------------------------------------------------------------------------------------

-- Applies to pages written from now on.
alter table pgflow.step_tasks set (fillfactor = 80);

revoke execute on all functions in schema pgflow from public;
