-- pgflow-rs SQL core, migration 0028: the queue-aware start_tasks takes the hot path's two rules.
--
-- start_tasks(flow_slug, msg_ids, worker_id, queue_name) is the claim behind upstream's three-argument form
-- too. It was left with two things the other claims no longer do:
--   - its visibility update was built as text and planned on every call; it now goes through the queue's
--     own statements (pgflow._queue_op, migration 0024), planned once per session, like every other claim;
--   - only the three-argument form replanned a session whose tables had grown (migration 0026); the check now
--     sits in the four-argument form, which both reach, so a caller of either is covered once.
-- Results, errors, locks and lock order are unchanged: the same rows are claimed in the same order and each
-- claimed message's visibility is set exactly as before (its read count and last read time untouched).
--
-- Planning that statement cost about 0.09 ms per call (measured for the same update in 0024). The bench's
-- upstream-style driver, whose time is mostly its per-task complete_task calls and commits, drains the diamond
-- at the same rate within noise (two alternating pairs, K = 1 / 4 / 16: 882 / 1,248 / 1,155 and 881 / 1,258 /
-- 1,151 tasks/s before, 928 / 1,339 / 1,189 and 861 / 1,203 / 1,086 after).

create or replace function pgflow.start_tasks(flow_slug text, msg_ids bigint[], worker_id uuid, queue_name text)
returns setof pgflow.step_task_record
language plpgsql
volatile
security definer
set search_path = ''
set plan_cache_mode = force_generic_plan
set enable_seqscan = off
as $$
declare
  v_queue text := lower(start_tasks.queue_name);
  v_claimed bigint[];
  v_vts timestamptz[];
  v_updated int;
begin
  if msg_ids is null or cardinality(msg_ids) = 0 then
    return;
  end if;
  perform pgflow._replan_if_grown();

  perform pgflow._lock_messages(v_queue, start_tasks.msg_ids);

  with candidates as (
    select t.run_id, t.step_slug, t.task_index
    from pgflow.step_tasks t
    where t.queue_name = v_queue
      and t.message_id = any (start_tasks.msg_ids)
      and (start_tasks.flow_slug is null or t.flow_slug = start_tasks.flow_slug)
      and t.status = 'queued'
    order by t.message_id
    for update
  ),
  claimed as (
    update pgflow.step_tasks t
    set status = 'started',
        attempts_count = t.attempts_count + 1,
        -- A claim whose transaction began before the task was queued still starts it no earlier
        -- than it was queued (started_at_is_after_queued_at).
        started_at = greatest(now(), t.queued_at),
        last_worker_id = start_tasks.worker_id
    from candidates c, pgflow.runs r, pgflow.step_states ss
    where t.run_id = c.run_id and t.step_slug = c.step_slug and t.task_index = c.task_index
      and t.status = 'queued'
      and r.run_id = t.run_id and r.status = 'started'
      and ss.run_id = t.run_id and ss.step_slug = t.step_slug and ss.status = 'started'
    returning t.message_id, t.flow_slug, t.step_slug
  )
  select array_agg(c.message_id order by c.message_id),
         array_agg(clock_timestamp() + make_interval(secs => coalesce(s.opt_timeout, f.opt_timeout)::float8
                                                             + pgflow._claim_visibility_buffer_seconds())
                   order by c.message_id)
  into v_claimed, v_vts
  from claimed c
  join pgflow.steps s on s.flow_slug = c.flow_slug and s.step_slug = c.step_slug
  join pgflow.flows f on f.flow_slug = c.flow_slug;

  if v_claimed is null then
    return;
  end if;

  -- Visibility only: read count and last read time as they were (p_n = 0).
  v_updated := coalesce(cardinality(pgflow._queue_op(v_queue, 'visibility', v_claimed, v_vts, 0)), 0);
  if v_updated <> cardinality(v_claimed) then
    raise exception 'start_tasks(): visibility updated % of % claimed messages', v_updated, cardinality(v_claimed)
      using detail = format('queue %s, messages %s', v_queue, v_claimed::text),
            hint = 'A claimed message is missing from its queue; no task was claimed.';
  end if;

  return query
  select t.flow_slug, t.run_id, t.step_slug, i.input, t.message_id, t.task_index, i.flow_input
  from unnest(v_claimed) with ordinality as c(msg_id, ord)
  join pgflow.step_tasks t on t.queue_name = v_queue and t.message_id = c.msg_id
  join pgflow.steps s on s.flow_slug = t.flow_slug and s.step_slug = t.step_slug
  join pgflow.runs r on r.run_id = t.run_id
  cross join lateral pgflow._task_inputs(t.run_id, t.flow_slug, t.step_slug, s.step_type, s.deps_count,
                                         t.element, r.input) i
  order by c.ord;
end;
$$;

-- Upstream's form: the flow's one queue, then the form above (which replans when needed).
create or replace function pgflow.start_tasks(flow_slug text, msg_ids bigint[], worker_id uuid)
returns setof pgflow.step_task_record
language plpgsql
volatile
security definer
set search_path = ''
set plan_cache_mode = force_generic_plan
set enable_seqscan = off
as $$
declare
  v_queues text[];
begin
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

revoke execute on all functions in schema pgflow from public;
