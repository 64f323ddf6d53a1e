-- pgflow-rs SQL core, migration 0026: a session rebuilds its cached plans once the tables have doubled, and
-- task creation finds runs by key whatever the tables' statistics say.
--
-- The hot functions run on generic plans that each session builds once and keeps (0019). The planner sizes a
-- table by its current number of pages, so a plan built while runs, step_states and step_tasks were nearly
-- empty (a fresh installation, or tables emptied and vacuumed) takes them for a few rows: its joins read them
-- whole, or loop over them, where a key lookup was wanted. Nothing rebuilt such a plan until autovacuum next
-- analysed the tables, which can be a minute or more later, and meanwhile every call grew dearer with the
-- tables. Measured with the bench at 900 diamond runs per second on fresh tables (8 s), the worker fell into
-- sustained overload: run latency p50 2.7 s and 21 s in two runs. With this migration: p50 16 and 17 ms.
--
-- pgflow._replan_if_grown() compares the pages of those three tables with their pages when the session last
-- planned (a session setting, pgflow.planned_pages). Once they have more than doubled (and grown by more than
-- 16 pages, so that an empty start does not replan every call), it discards the session's cached plans
-- (DISCARD PLANS) and records the new size. The next statements plan again with the tables' real size. While
-- the tables grow steadily from empty a session replans a dozen or so times; at a steady size, never. It costs
-- three relation-size lookups per call. pgflow.exchange, start_tasks, complete_task and complete_tasks call it
-- first. It discards every cached plan of the session, which the session's other statements rebuild on their
-- next use. Behaviour is unchanged.

create or replace function pgflow._replan_if_grown()
returns void
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_pages bigint := (pg_relation_size('pgflow.runs'::regclass) + pg_relation_size('pgflow.step_states'::regclass)
                     + pg_relation_size('pgflow.step_tasks'::regclass)) / current_setting('block_size')::int;
  v_planned bigint := nullif(current_setting('pgflow.planned_pages', true), '')::bigint;
begin
  if v_planned is not null and v_pages > 2 * v_planned + 16 then
    discard plans;
  elsif v_planned is not null and v_pages >= v_planned then
    return;
  end if;
  -- First call of the session (its plans are about to be built), a replan, or tables that shrank (plans
  -- built on larger tables stay good; growth is measured from the smaller size).
  perform set_config('pgflow.planned_pages', v_pages::text, false);
end;
$$;

-- As in 0025, calling pgflow._replan_if_grown() first.
create or replace function pgflow.exchange(
  queue_name text,
  worker_id uuid,
  flow_slugs text[],
  step_slugs text[],
  qty int,
  vt int,
  run_ids uuid[],
  done_step_slugs text[],
  task_indexes int[],
  outputs jsonb[],
  attempts int[]
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
  report jsonb,
  status text
)
language plpgsql
volatile
security definer
set search_path = ''
set plan_cache_mode = force_generic_plan
set enable_seqscan = off
as $$
begin
  perform pgflow._replan_if_grown();
  if coalesce(cardinality(exchange.run_ids), 0) > 0 then
    if array_position(exchange.attempts, null) is not null
       or cardinality(exchange.attempts) is distinct from cardinality(exchange.run_ids) then
      raise exception 'exchange(): every completion needs the attempt its claim returned'
        using errcode = 'invalid_parameter_value';
    end if;
    perform set_config('pgflow.signal_source', 'exchange', true);
    return query
    select case when c.applied then 'applied' else 'stale' end, null::bigint, (c.task).flow_slug,
           (c.task).run_id, (c.task).step_slug, (c.task).task_index, null::jsonb, null::jsonb,
           (c.task).attempts_count, null::int, null::jsonb, (c.task).status
    from pgflow._complete_tasks(exchange.run_ids, exchange.done_step_slugs, exchange.task_indexes,
                                exchange.outputs, exchange.attempts, exchange.worker_id) c
    order by c.ord;
    perform set_config('pgflow.signal_source', '', true);
  end if;
  if coalesce(exchange.qty, 0) > 0 then
    return query
    select c.outcome, c.msg_id, c.flow_slug, c.run_id, c.step_slug, c.task_index, c.input, c.flow_input,
           c.attempts_count, c.timeout, c.report, null::text
    from pgflow.read_and_claim_tasks(exchange.queue_name, exchange.qty, exchange.vt, exchange.worker_id,
                                     exchange.flow_slugs, exchange.step_slugs) c;
  end if;
end;
$$;

-- As in 0024, with each run's row found by its key. The join of the batch to runs and steps could also be
-- planned from steps to every run of the flow (through idx_runs_flow_slug), and was, whenever runs had not been
-- analysed since it grew: the planner then assumes a few runs per flow, and a start read one index entry per
-- run the flow had ever had (3,000 in the test that found it). The lateral lookup (kept apart by offset 0)
-- leaves the planner no such choice.
create or replace function pgflow._create_step_tasks(p_run_ids uuid[], p_step_slugs text[])
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
    cross join lateral (select r.flow_slug, r.input from pgflow.runs r where r.run_id = x.run_id offset 0) r
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
    from unnest(pgflow._queue_op(
           v_group.queue_name, 'send', null,
           array[clock_timestamp() + make_interval(secs => v_group.delay)], null,
           (select array_agg(jsonb_build_object(
                     'flow_slug', u.flow_slug,
                     'run_id', u.run_id,
                     'step_slug', u.step_slug,
                     'task_index', u.task_index) order by u.ord)
            from unnest(v_group.flow_slugs, v_group.run_ids, v_group.step_slugs, v_group.task_indexes)
                   with ordinality as u(flow_slug, run_id, step_slug, task_index, ord))))
           with ordinality as sent(msg_id, ord)
    join unnest(v_group.flow_slugs, v_group.run_ids, v_group.step_slugs, v_group.task_indexes, v_group.elements)
           with ordinality as m(flow_slug, run_id, step_slug, task_index, element, ord)
      on m.ord = sent.ord;
    v_queues := array_append(v_queues, v_group.queue_name);
  end loop;
  perform pgflow._signal_queues(v_queues);
end;
$$;

-- Upstream's entry points for claiming and completing (as in 0007 and 0016) replan the same way, so that a
-- worker in any language that claims with start_tasks and completes with complete_task, on sessions of its
-- own, gets the same protection (one diamond run on such sessions read over 100,000 index entries in the test
-- that planned them on empty tables and then added 3,000 runs). CREATE OR REPLACE resets the options that
-- later migrations set on these functions; they are set again below.
create or replace function pgflow.start_tasks(flow_slug text, msg_ids bigint[], worker_id uuid)
returns setof pgflow.step_task_record
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_queues text[];
begin
  perform pgflow._replan_if_grown();
  select array_agg(distinct s.queue_name) into v_queues
  from pgflow.steps s
  where s.flow_slug = start_tasks.flow_slug;

  if v_queues is null then
    return;
  elsif cardinality(v_queues) > 1 then
    raise exception 'start_tasks(): flow "%" sends its tasks to % queues (%)',
        start_tasks.flow_slug, cardinality(v_queues), array_to_string(v_queues, ', ')
      using hint = 'Call start_tasks(flow_slug, msg_ids, worker_id, queue_name) with the queue the messages were read from.';
  end if;

  return query
  select * from pgflow.start_tasks(start_tasks.flow_slug, start_tasks.msg_ids, start_tasks.worker_id, v_queues[1]);
end;
$$;

create or replace function pgflow.complete_task(run_id uuid, step_slug text, task_index int, output jsonb)
returns setof pgflow.step_tasks
language sql
volatile
set search_path = ''
as $$
  select pgflow._replan_if_grown();
  select (c.task).*
  from pgflow._complete_tasks(array[complete_task.run_id], array[complete_task.step_slug],
                              array[complete_task.task_index], array[complete_task.output], array[null::int],
                              null) c;
$$;

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
  perform pgflow._replan_if_grown();
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
  perform pgflow._replan_if_grown();
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

alter function pgflow.start_tasks(text, bigint[], uuid)
  security definer set plan_cache_mode = force_generic_plan set enable_seqscan = off;
alter function pgflow.complete_task(uuid, text, integer, jsonb)
  security definer set plan_cache_mode = force_generic_plan set enable_seqscan = off;
alter function pgflow.complete_task(uuid, text, integer, jsonb, integer, uuid)
  security definer set plan_cache_mode = force_generic_plan set enable_seqscan = off;
alter function pgflow.complete_tasks(uuid[], text[], integer[], jsonb[], integer[], uuid)
  security definer set plan_cache_mode = force_generic_plan set enable_seqscan = off;

revoke execute on all functions in schema pgflow from public;
