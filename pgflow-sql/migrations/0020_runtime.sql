-- pgflow-rs SQL core, migration 0020: entry points for the Rust runtime (fewer round trips, richer failures).
--
-- Additions only; upstream's functions are untouched:
--   * read_and_start_tasks: read from PGMQ and claim in one call (honours the worker-function fence);
--   * complete_tasks: record several outputs in one transaction;
--   * fail_task(..., retry_delay_seconds, terminal): a handler-chosen retry delay, or no retry at all;
--   * release_worker_tasks: a stopping worker hands back the tasks it could not finish.

-- Reads up to `qty` visible messages from `queue_name` (hiding them for `vt` seconds) and claims their queued
-- tasks with start_tasks(flow_slug, msg_ids, worker_id, queue_name). Never sleeps. Returns nothing when the
-- worker function `function_name` exists and is disabled (the enable fence), without reading.
-- Rows carry the claimed attempt number (attempts_count after the claim).
create function pgflow.read_and_start_tasks(
  queue_name text,
  flow_slug text,
  qty int,
  vt int,
  worker_id uuid,
  function_name text default null
)
returns table (
  run_id uuid,
  step_slug text,
  task_index int,
  msg_id bigint,
  input jsonb,
  flow_input jsonb,
  attempts_count int
)
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_ids bigint[];
  v_claimed pgflow.step_task_record[];
begin
  if read_and_start_tasks.function_name is not null and exists (
    select 1 from pgflow.worker_functions wf
    where wf.function_name = read_and_start_tasks.function_name and not wf.enabled
  ) then
    return;
  end if;

  select array_agg(m.msg_id) into v_ids
  from pgmq.read(read_and_start_tasks.queue_name, read_and_start_tasks.vt, read_and_start_tasks.qty) m;
  if v_ids is null then
    return;
  end if;

  select array_agg(t) into v_claimed
  from pgflow.start_tasks(read_and_start_tasks.flow_slug, v_ids, read_and_start_tasks.worker_id,
                          read_and_start_tasks.queue_name) t;
  if v_claimed is null then
    return;
  end if;

  -- A separate statement, so the claim's own updates (attempts_count) are visible.
  return query
  select c.run_id, c.step_slug, c.task_index, c.msg_id, c.input, c.flow_input, st.attempts_count
  from unnest(v_claimed) with ordinality as c
  join pgflow.step_tasks st
    on st.run_id = c.run_id and st.step_slug = c.step_slug and st.task_index = c.task_index
  order by c.ordinality;
end;
$$;

-- Records several task outputs in one transaction: complete_task for each (run_ids[i], step_slugs[i],
-- task_indexes[i], outputs[i]), in run-id order so concurrent batches lock runs in one order. Returns how many
-- calls were made. A task that is not `started` is left unchanged, exactly as complete_task does.
create function pgflow.complete_tasks(run_ids uuid[], step_slugs text[], task_indexes int[], outputs jsonb[])
returns int
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_row record;
  v_count int := 0;
begin
  if cardinality(run_ids) is distinct from cardinality(step_slugs)
     or cardinality(run_ids) is distinct from cardinality(task_indexes)
     or cardinality(run_ids) is distinct from cardinality(outputs) then
    raise exception 'complete_tasks(): array lengths differ (run_ids %, step_slugs %, task_indexes %, outputs %)',
      cardinality(run_ids), cardinality(step_slugs), cardinality(task_indexes), cardinality(outputs);
  end if;

  for v_row in
    select u.run_id, u.step_slug, u.task_index, u.output
    from unnest(complete_tasks.run_ids, complete_tasks.step_slugs, complete_tasks.task_indexes,
                complete_tasks.outputs) with ordinality as u(run_id, step_slug, task_index, output, ord)
    order by u.run_id, u.ord
  loop
    perform pgflow.complete_task(v_row.run_id, v_row.step_slug, v_row.task_index, v_row.output);
    v_count := v_count + 1;
  end loop;
  return v_count;
end;
$$;

-- fail_task with two handler decisions:
--   * retry_delay_seconds (not null): when the task is retried, its message becomes visible after this many
--     seconds instead of the step's exponential backoff;
--   * terminal (true): no retry; the task fails as if its attempts were exhausted and the step's
--     when_exhausted applies.
-- Otherwise identical to fail_task(run_id, step_slug, task_index, error_message).
create function pgflow.fail_task(
  run_id uuid,
  step_slug text,
  task_index int,
  error_message text,
  retry_delay_seconds int,
  terminal boolean
)
returns setof pgflow.step_tasks
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_before text;
  v_task pgflow.step_tasks;
begin
  select t.status into v_before
  from pgflow.step_tasks t
  where t.run_id = fail_task.run_id and t.step_slug = fail_task.step_slug and t.task_index = fail_task.task_index;

  v_task := pgflow._fail_task(fail_task.run_id, fail_task.step_slug, fail_task.task_index,
                              fail_task.error_message, coalesce(fail_task.terminal, false));

  if v_before = 'started' and v_task.status = 'queued' and fail_task.retry_delay_seconds is not null then
    perform pgmq.set_vt(v_task.queue_name, v_task.message_id, greatest(fail_task.retry_delay_seconds, 0));
  end if;

  if v_task.run_id is not null then
    return next v_task;
  end if;
end;
$$;

-- Hands back every task the worker still has `started` (a graceful shutdown that could not finish them):
-- the task is `queued` again with its attempt given back, and its message is visible at once, so another
-- worker picks it up without waiting for stalled-task recovery. Returns the number of tasks released.
create function pgflow.release_worker_tasks(worker_id uuid)
returns int
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_group record;
  v_count int := 0;
begin
  for v_group in
    with mine as (
      select t.run_id, t.step_slug, t.task_index
      from pgflow.step_tasks t
      where t.last_worker_id = release_worker_tasks.worker_id
        and t.status = 'started'
        and t.permanently_stalled_at is null
      order by t.queue_name, t.message_id
      for update
    ),
    released as (
      update pgflow.step_tasks t
      set status = 'queued',
          started_at = null,
          last_worker_id = null,
          attempts_count = greatest(t.attempts_count - 1, 0)
      from mine m
      where t.run_id = m.run_id and t.step_slug = m.step_slug and t.task_index = m.task_index
        and t.status = 'started'
      returning t.queue_name, t.message_id
    )
    select r.queue_name, array_agg(r.message_id) as ids
    from released r
    where r.message_id is not null
    group by r.queue_name
  loop
    perform pgmq.set_vt(v_group.queue_name, v_group.ids, 0);
    v_count := v_count + cardinality(v_group.ids);
  end loop;
  return v_count;
end;
$$;
