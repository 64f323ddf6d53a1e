-- pgflow-rs SQL core: one lookup of a queue's aging (pgflow._queue_aging_secs) instead of three copies, in the
-- creation of step tasks, the re-send of retried tasks and the recovery paths' single re-sends. No behaviour
-- changes.

-- ---- as in schema/18_priorities.sql : pgflow._queue_aging_secs ----
create or replace function pgflow._queue_aging_secs(p_queue text)
returns double precision
language sql
stable
as $$
  select extract(epoch from qp.aging)::float8 from pgflow.queue_priorities qp where qp.queue_name = p_queue
$$;
-- ---- end pgflow._queue_aging_secs ----

-- ---- as in schema/18_priorities.sql : pgflow._run_rank_headers ----
create or replace function pgflow._run_rank_headers(p_queue text, p_run_id uuid)
returns jsonb
language sql
stable
as $$
  select pgflow._rank_headers(pgflow._queue_aging_secs(lower(p_queue)),
                              (select r.priority from pgflow.runs r where r.run_id = p_run_id))
$$;
-- ---- end pgflow._run_rank_headers ----

-- ---- as in schema/06_runs.sql : pgflow._create_step_tasks ----
create or replace function pgflow._create_step_tasks(p_run_ids uuid[], p_step_slugs text[])
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_group record;
  v_queues text[];
begin
  for v_group in
    select s.queue_name, coalesce(s.opt_start_delay, 0) as delay,
           pgflow._queue_aging_secs(s.queue_name) as aging_secs,
           array_agg(r.priority order by t.run_id, t.step_slug, t.task_index) as priorities,
           array_agg(t.run_id order by t.run_id, t.step_slug, t.task_index) as run_ids,
           array_agg(r.flow_slug order by t.run_id, t.step_slug, t.task_index) as flow_slugs,
           array_agg(t.step_slug order by t.run_id, t.step_slug, t.task_index) as step_slugs,
           array_agg(t.task_index order by t.run_id, t.step_slug, t.task_index) as task_indexes,
           array_agg(t.element order by t.run_id, t.step_slug, t.task_index) as elements
    from unnest(p_run_ids, p_step_slugs) as x(run_id, step_slug)
    cross join lateral (select r.flow_slug, r.input, r.priority from pgflow.runs r where r.run_id = x.run_id offset 0) r
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
                   with ordinality as u(flow_slug, run_id, step_slug, task_index, ord)),
           case when v_group.aging_secs is not null
                then array(select pgflow._rank_headers(v_group.aging_secs, p.priority)
                           from unnest(v_group.priorities) with ordinality as p(priority, ord) order by p.ord) end))
           with ordinality as sent(msg_id, ord)
    join unnest(v_group.flow_slugs, v_group.run_ids, v_group.step_slugs, v_group.task_indexes, v_group.elements)
           with ordinality as m(flow_slug, run_id, step_slug, task_index, element, ord)
      on m.ord = sent.ord;
    v_queues := array_append(v_queues, v_group.queue_name);
  end loop;
  perform pgflow._signal_queues(v_queues);
end;
$$;
-- ---- end pgflow._create_step_tasks ----

-- ---- as in schema/13_run_control.sql : pgflow._resend_tasks ----
create or replace function pgflow._resend_tasks(p_run_id uuid, p_step_slugs text[], p_task_indexes int[])
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_group record;
  v_queues text[];
  v_priority integer := (select r.priority from pgflow.runs r where r.run_id = p_run_id);
begin
  for v_group in
    select t.queue_name,
           pgflow._queue_aging_secs(t.queue_name) as aging_secs,
           array_agg(t.step_slug order by t.step_slug, t.task_index) as step_slugs,
           array_agg(t.task_index order by t.step_slug, t.task_index) as task_indexes,
           array_agg(jsonb_build_object('flow_slug', t.flow_slug, 'run_id', t.run_id, 'step_slug', t.step_slug,
                                        'task_index', t.task_index) order by t.step_slug, t.task_index) as bodies
    from unnest(p_step_slugs, p_task_indexes) as x(step_slug, task_index)
    join pgflow.step_tasks t on t.run_id = p_run_id and t.step_slug = x.step_slug and t.task_index = x.task_index
    group by t.queue_name
    order by t.queue_name
  loop
    update pgflow.step_tasks t
    set message_id = sent.msg_id
    from unnest(pgflow._queue_op(v_group.queue_name, 'send', null, array[clock_timestamp()], null, v_group.bodies,
                                 case when v_group.aging_secs is not null
                                      then array_fill(pgflow._rank_headers(v_group.aging_secs, v_priority),
                                                      array[cardinality(v_group.bodies)]) end))
           with ordinality as sent(msg_id, ord)
    join unnest(v_group.step_slugs, v_group.task_indexes) with ordinality as m(step_slug, task_index, ord)
      on m.ord = sent.ord
    where t.run_id = p_run_id and t.step_slug = m.step_slug and t.task_index = m.task_index;
    v_queues := array_append(v_queues, v_group.queue_name);
  end loop;
  perform pgflow._signal_queues(v_queues);
end;
$$;
-- ---- end pgflow._resend_tasks ----

-- Like every function of the schema, not callable by PUBLIC (default privileges cannot take EXECUTE away).
revoke execute on function pgflow._queue_aging_secs(text) from public;
