-- pgflow-rs SQL core, migration 0007: the task lifecycle (the worker API).
--
-- Upstream interface: start_tasks, complete_task, fail_task, _archive_task_message, set_vt_batch,
-- poll_for_tasks (deprecated stub). Addition: the queue-aware start_tasks(flow_slug, msg_ids, worker_id,
-- queue_name), and _fail_task shared by fail_task and the operator's stalled-task resolution.
--
-- Every queue operation on a task uses the task's own (queue_name, message_id).

------------------------------------------------------------------------------------------------------------
-- Claiming
------------------------------------------------------------------------------------------------------------

-- Claims the queued tasks behind `msg_ids` read from queue `queue_name` and returns them ready to run.
--
-- * Only tasks that are `queued`, of a started run and a started step are claimed; other messages are ignored
--   (a started task's message seen again, or a terminal task's, is not an error).
-- * The claim locks the task rows, then runs one guarded UPDATE; rows come from its RETURNING, so of two
--   overlapping claims of one message exactly one returns the task (the other blocks on the row, re-checks
--   `status = 'queued'` and skips it).
-- * Before returning, every claimed message gets visibility = effective step timeout + claim buffer
--   (pgflow._claim_visibility_buffer_seconds()). If any claimed message could not be updated, the whole claim
--   fails with `start_tasks(): visibility updated N of M claimed messages` and nothing is claimed.
-- * flow_slug NULL claims tasks of any flow in that queue.
create function pgflow.start_tasks(flow_slug text, msg_ids bigint[], worker_id uuid, queue_name text)
returns setof pgflow.step_task_record
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_queue text := lower(start_tasks.queue_name);
  v_run_ids uuid[];
  v_step_slugs text[];
  v_task_indexes int[];
  v_msg_ids bigint[];
  v_flow_slugs text[];
  v_secs int[];
  v_updated int;
begin
  if msg_ids is null or cardinality(msg_ids) = 0 then
    return;
  end if;

  -- Task rows are locked in (queue_name, message_id) order, the order every other multi-task writer
  -- (_terminate_tasks) uses too, so concurrent claims and cancellations cannot deadlock.
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
    returning t.run_id, t.step_slug, t.task_index, t.message_id, t.flow_slug
  )
  select array_agg(c.run_id order by c.message_id),
         array_agg(c.step_slug order by c.message_id),
         array_agg(c.task_index order by c.message_id),
         array_agg(c.message_id order by c.message_id),
         array_agg(c.flow_slug order by c.message_id),
         array_agg(coalesce(s.opt_timeout, f.opt_timeout) + pgflow._claim_visibility_buffer_seconds()
                   order by c.message_id)
  into v_run_ids, v_step_slugs, v_task_indexes, v_msg_ids, v_flow_slugs, v_secs
  from claimed c
  join pgflow.steps s on s.flow_slug = c.flow_slug and s.step_slug = c.step_slug
  join pgflow.flows f on f.flow_slug = c.flow_slug;

  if v_msg_ids is null then
    return;
  end if;

  execute format(
    'update pgmq.%I q set vt = clock_timestamp() + make_interval(secs => v.secs)
       from unnest($1::bigint[], $2::int[]) as v(id, secs)
      where q.msg_id = v.id',
    pgmq.format_table_name(v_queue, 'q'))
  using v_msg_ids, v_secs;
  get diagnostics v_updated = row_count;

  if v_updated <> cardinality(v_msg_ids) then
    raise exception 'start_tasks(): visibility updated % of % claimed messages', v_updated, cardinality(v_msg_ids)
      using detail = format('queue %s, messages %s', v_queue, v_msg_ids::text),
            hint = 'A claimed message is missing from its queue; no task was claimed.';
  end if;

  return query
  select c.flow_slug,
         c.run_id,
         c.step_slug,
         case
           when s.step_type = 'map' and s.deps_count = 0 then r.input -> c.task_index
           when s.step_type = 'map' then (
             select ds.output -> c.task_index
             from pgflow.deps d
             join pgflow.step_states ds on ds.run_id = c.run_id and ds.step_slug = d.dep_slug
             where d.flow_slug = c.flow_slug and d.step_slug = c.step_slug
             limit 1)
           else coalesce((
             select jsonb_object_agg(d.dep_slug, ds.output)
             from pgflow.deps d
             join pgflow.step_states ds on ds.run_id = c.run_id and ds.step_slug = d.dep_slug
             where d.flow_slug = c.flow_slug and d.step_slug = c.step_slug and ds.status = 'completed'),
             '{}'::jsonb)
         end,
         c.msg_id,
         c.task_index,
         case when s.step_type = 'single' and s.deps_count = 0 then r.input end
  from unnest(v_run_ids, v_step_slugs, v_task_indexes, v_msg_ids, v_flow_slugs)
         with ordinality as c(run_id, step_slug, task_index, msg_id, flow_slug, ord)
  join pgflow.steps s on s.flow_slug = c.flow_slug and s.step_slug = c.step_slug
  join pgflow.runs r on r.run_id = c.run_id
  order by c.ord;
end;
$$;

-- Upstream's form. The queue is resolved from the flow's persisted steps (never from the slug text); a flow
-- whose steps use several queues needs the queue-aware form.
create function pgflow.start_tasks(flow_slug text, msg_ids bigint[], worker_id uuid)
returns setof pgflow.step_task_record
language plpgsql
volatile
set search_path = ''
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

------------------------------------------------------------------------------------------------------------
-- Completing
------------------------------------------------------------------------------------------------------------

-- Records a started task's output. Always returns the task row; for a task that is not `started` (queued,
-- completed, failed, skipped, cancelled), or of a run that is not started, nothing changes.
create function pgflow.complete_task(run_id uuid, step_slug text, task_index int, output jsonb)
returns setof pgflow.step_tasks
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_run_status text;
  v_flow_slug text;
  v_task pgflow.step_tasks;
  v_step_status text;
  v_step_type text;
  v_remaining int;
  v_initial int;
  v_child text;
  v_type text;
  v_step_output jsonb;
  v_completed_at timestamptz;
  v_child_tasks int;
  v_ready_children int;
  v_remaining_steps int;
  v_read record;
begin
  -- Lock the run first: every state change of a run is serialised on its row.
  select r.status, r.flow_slug into v_run_status, v_flow_slug
  from pgflow.runs r
  where r.run_id = complete_task.run_id
  for no key update;

  if not found then
    return;
  end if;

  -- Then read the task and its step in a statement of its own, so it sees what a concurrent completion
  -- committed while this one waited for the lock. (Reading them in the locking statement would use the
  -- pre-wait versions of these rows: two last completions would each see the other as still running.)
  select t as task, ss.status as step_status, ss.remaining_tasks, ss.initial_tasks, s.step_type
  into v_read
  from pgflow.step_tasks t
  join pgflow.step_states ss on ss.run_id = t.run_id and ss.step_slug = t.step_slug
  join pgflow.steps s on s.flow_slug = ss.flow_slug and s.step_slug = ss.step_slug
  where t.run_id = complete_task.run_id and t.step_slug = complete_task.step_slug
    and t.task_index = complete_task.task_index;

  if not found then
    return;
  end if;
  v_task := v_read.task;
  v_step_status := v_read.step_status;
  v_remaining := v_read.remaining_tasks;
  v_initial := v_read.initial_tasks;
  v_step_type := v_read.step_type;
  if v_run_status is distinct from 'started' or v_task.status <> 'started' then
    return next v_task;
    return;
  end if;

  if v_step_status <> 'started' then
    -- Late callback for a step that already ended: nothing to record, make sure the message is gone.
    perform pgmq.archive(v_task.queue_name, v_task.message_id);
    return next v_task;
    return;
  end if;

  -- A single step feeding a map must produce an array: anything else fails the run.
  if v_step_type = 'single' and (output is null or jsonb_typeof(output) <> 'array') then
    select d.step_slug into v_child
    from pgflow.deps d
    join pgflow.steps cs on cs.flow_slug = d.flow_slug and cs.step_slug = d.step_slug
    join pgflow.step_states cst on cst.run_id = complete_task.run_id and cst.step_slug = d.step_slug
    where d.flow_slug = v_flow_slug and d.dep_slug = complete_task.step_slug
      and cs.step_type = 'map' and cst.initial_tasks is null
    order by cs.step_index
    limit 1;

    if found then
      v_type := coalesce(jsonb_typeof(output), 'null');
      update pgflow.step_tasks t
      set status = 'failed', failed_at = now(), output = complete_task.output,
          error_message = format('[TYPE_VIOLATION] Produced %s instead of array', v_type)
      where t.run_id = complete_task.run_id and t.step_slug = complete_task.step_slug
        and t.task_index = complete_task.task_index
      returning t.* into v_task;
      perform pgmq.archive(v_task.queue_name, v_task.message_id);

      update pgflow.step_states ss
      set status = 'failed', failed_at = now(),
          error_message = format('[TYPE_VIOLATION] Map step %s expects array input but dependency %s produced %s',
                                 v_child, complete_task.step_slug, v_type)
      where ss.run_id = complete_task.run_id and ss.step_slug = complete_task.step_slug;

      perform pgflow._fail_run(complete_task.run_id, null);
      perform pgflow._emit('step:' || complete_task.step_slug || ':failed', complete_task.run_id,
        jsonb_build_object(
          'event_type', 'step:failed',
          'run_id', complete_task.run_id,
          'step_slug', complete_task.step_slug,
          'status', 'failed',
          'error_message', format('[TYPE_VIOLATION] Map step %s expects array input but dependency %s produced %s',
                                  v_child, complete_task.step_slug, v_type),
          'failed_at', now()
        ));
      return next v_task;
      return;
    end if;
  end if;

  update pgflow.step_tasks t
  set status = 'completed', completed_at = now(), output = complete_task.output
  where t.run_id = complete_task.run_id and t.step_slug = complete_task.step_slug
    and t.task_index = complete_task.task_index and t.status = 'started'
  returning t.* into v_task;

  if not found then
    -- Requeued by stalled-task recovery in the meantime.
    return query
    select t.* from pgflow.step_tasks t
    where t.run_id = complete_task.run_id and t.step_slug = complete_task.step_slug
      and t.task_index = complete_task.task_index;
    return;
  end if;

  perform pgmq.archive(v_task.queue_name, v_task.message_id);

  if v_remaining > 1 then
    update pgflow.step_states ss
    set remaining_tasks = ss.remaining_tasks - 1
    where ss.run_id = complete_task.run_id and ss.step_slug = complete_task.step_slug;
    return next v_task;
    return;
  end if;

  -- Last task: the step completes with its output (map: task outputs ordered by task_index).
  if v_step_type = 'map' then
    select jsonb_agg(t.output order by t.task_index) into v_step_output
    from pgflow.step_tasks t
    where t.run_id = complete_task.run_id and t.step_slug = complete_task.step_slug;
  else
    v_step_output := complete_task.output;
  end if;

  update pgflow.step_states ss
  set remaining_tasks = 0, status = 'completed', completed_at = now(), output = v_step_output
  where ss.run_id = complete_task.run_id and ss.step_slug = complete_task.step_slug
  returning ss.completed_at into v_completed_at;

  -- Map dependents learn their task count: a map parent's task count, or a single parent's array length.
  v_child_tasks := case
    when v_step_type = 'map' then v_initial
    when jsonb_typeof(complete_task.output) = 'array' then jsonb_array_length(complete_task.output)
  end;

  with released as (
    update pgflow.step_states c
    set remaining_deps = c.remaining_deps - 1,
        initial_tasks = case
          when cs.step_type = 'map' and c.initial_tasks is null then
            v_child_tasks
          else c.initial_tasks end
    from pgflow.deps d
    join pgflow.steps cs on cs.flow_slug = d.flow_slug and cs.step_slug = d.step_slug
    where d.flow_slug = v_flow_slug and d.dep_slug = complete_task.step_slug
      and c.run_id = complete_task.run_id and c.step_slug = d.step_slug
    returning c.remaining_deps
  )
  select count(*) filter (where remaining_deps = 0) into v_ready_children from released;

  update pgflow.runs r
  set remaining_steps = r.remaining_steps - 1
  where r.run_id = complete_task.run_id
  returning r.remaining_steps into v_remaining_steps;

  perform pgflow._emit('step:' || complete_task.step_slug || ':completed', complete_task.run_id,
    jsonb_build_object(
      'event_type', 'step:completed',
      'run_id', complete_task.run_id,
      'step_slug', complete_task.step_slug,
      'status', 'completed',
      'output', v_step_output,
      'completed_at', v_completed_at
    ));

  -- Only dependents that just became ready can start, skip or complete taskless; with none, the run can
  -- only have finished.
  if v_ready_children > 0 then
    perform pgflow._advance_run(complete_task.run_id);
  elsif v_remaining_steps = 0 then
    perform pgflow.maybe_complete_run(complete_task.run_id);
  end if;

  return next v_task;
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

------------------------------------------------------------------------------------------------------------
-- Failing
------------------------------------------------------------------------------------------------------------

-- Shared by fail_task (p_force_exhausted false) and resolve_stalled_task (true: no retry left).
create function pgflow._fail_task(
  p_run_id uuid,
  p_step_slug text,
  p_task_index int,
  p_error_message text,
  p_force_exhausted boolean
)
returns pgflow.step_tasks
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_run_status text;
  v_flow_slug text;
  v_task pgflow.step_tasks;
  v_step_status text;
  v_max_attempts int;
  v_base_delay int;
  v_when_exhausted text;
  v_at timestamptz;
begin
  select r.status, r.flow_slug into v_run_status, v_flow_slug
  from pgflow.runs r
  where r.run_id = p_run_id
  for no key update;

  select t.* into v_task
  from pgflow.step_tasks t
  where t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index;

  if v_task.run_id is null or v_run_status is distinct from 'started' or v_task.status <> 'started' then
    return v_task;
  end if;

  select ss.status,
         coalesce(s.opt_max_attempts, f.opt_max_attempts),
         coalesce(s.opt_base_delay, f.opt_base_delay),
         s.when_exhausted
  into v_step_status, v_max_attempts, v_base_delay, v_when_exhausted
  from pgflow.step_states ss
  join pgflow.steps s on s.flow_slug = ss.flow_slug and s.step_slug = ss.step_slug
  join pgflow.flows f on f.flow_slug = ss.flow_slug
  where ss.run_id = p_run_id and ss.step_slug = p_step_slug;

  if v_step_status <> 'started' then
    perform pgmq.archive(v_task.queue_name, v_task.message_id);
    return v_task;
  end if;

  -- Retry: back to the queue, visible again after the backoff.
  if not p_force_exhausted and v_task.attempts_count < v_max_attempts then
    update pgflow.step_tasks t
    set status = 'queued', started_at = null, error_message = p_error_message
    where t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index
    returning t.* into v_task;
    perform pgmq.set_vt(v_task.queue_name, v_task.message_id,
                        pgflow.calculate_retry_delay(v_base_delay, v_task.attempts_count));
    return v_task;
  end if;

  -- Exhausted.
  update pgflow.step_tasks t
  set status = 'failed', failed_at = now(), error_message = p_error_message, permanently_stalled_at = null
  where t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index
  returning t.* into v_task;
  perform pgmq.archive(v_task.queue_name, v_task.message_id);

  if v_when_exhausted = 'fail' then
    update pgflow.step_states ss
    set status = 'failed', failed_at = now(), error_message = p_error_message
    where ss.run_id = p_run_id and ss.step_slug = p_step_slug
    returning ss.failed_at into v_at;
    perform pgflow._emit('step:' || p_step_slug || ':failed', p_run_id, jsonb_build_object(
      'event_type', 'step:failed',
      'run_id', p_run_id,
      'step_slug', p_step_slug,
      'status', 'failed',
      'error_message', p_error_message,
      'failed_at', v_at
    ));
    perform pgflow._fail_run(p_run_id, p_error_message);
    return v_task;
  end if;

  -- when_exhausted skip / skip-cascade: the step is skipped, its other tasks too.
  update pgflow.step_states ss
  set status = 'skipped', skip_reason = 'handler_failed', skipped_at = now(),
      error_message = p_error_message, remaining_tasks = null
  where ss.run_id = p_run_id and ss.step_slug = p_step_slug
  returning ss.skipped_at into v_at;
  perform pgflow._terminate_tasks(p_run_id, array[p_step_slug], 'skipped');
  update pgflow.runs r set remaining_steps = r.remaining_steps - 1 where r.run_id = p_run_id;

  perform pgflow._emit('step:' || p_step_slug || ':skipped', p_run_id, jsonb_build_object(
    'event_type', 'step:skipped',
    'run_id', p_run_id,
    'step_slug', p_step_slug,
    'status', 'skipped',
    'skip_reason', 'handler_failed',
    'error_message', p_error_message,
    'skipped_at', v_at
  ));

  if v_when_exhausted = 'skip-cascade' then
    perform pgflow._cascade_force_skip_steps(p_run_id, p_step_slug, 'handler_failed');
  else
    perform pgflow._release_dependents(p_run_id, v_flow_slug, array[p_step_slug]);
  end if;

  perform pgflow._advance_run(p_run_id);
  return v_task;
end;
$$;

-- Records a started task's failure: retry with exponential backoff while attempts remain, otherwise apply the
-- step's when_exhausted (fail the run, or skip the step / skip it with its dependents). Always returns the
-- task row; for a task that is not `started`, or of a run that is not started, nothing changes.
create function pgflow.fail_task(run_id uuid, step_slug text, task_index int, error_message text)
returns setof pgflow.step_tasks
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_task pgflow.step_tasks;
begin
  v_task := pgflow._fail_task(fail_task.run_id, fail_task.step_slug, fail_task.task_index,
                              fail_task.error_message, false);
  if v_task.run_id is not null then
    return next v_task;
  end if;
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

------------------------------------------------------------------------------------------------------------
-- Queue helpers
------------------------------------------------------------------------------------------------------------

create function pgflow._archive_task_message(p_run_id uuid, p_step_slug text, p_task_index int)
returns void
language sql
volatile
set search_path = ''
as $$
  select pgmq.archive(t.queue_name, t.message_id)
  from pgflow.step_tasks t
  where t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index
    and t.message_id is not null;
$$;

-- Batched set_vt: message msg_ids[i] becomes visible vt_offsets[i] seconds from now.
create function pgflow.set_vt_batch(queue_name text, msg_ids bigint[], vt_offsets integer[])
returns table (msg_id bigint, read_ct integer, enqueued_at timestamptz, vt timestamptz, message jsonb, headers jsonb)
language plpgsql
volatile
set search_path = ''
as $$
begin
  if msg_ids is null or vt_offsets is null or coalesce(array_length(msg_ids, 1), 0) = 0 then
    return;
  end if;
  if coalesce(array_length(msg_ids, 1), 0) <> coalesce(array_length(vt_offsets, 1), 0) then
    raise exception 'msg_ids length (%) must equal vt_offsets length (%)',
      coalesce(array_length(msg_ids, 1), 0), coalesce(array_length(vt_offsets, 1), 0);
  end if;

  return query execute format(
    'update pgmq.%I q set vt = clock_timestamp() + make_interval(secs => v.off)
       from unnest($1::bigint[], $2::int[]) as v(id, off)
      where q.msg_id = v.id
      returning q.msg_id, q.read_ct, q.enqueued_at, q.vt, q.message, q.headers',
    pgmq.format_table_name(set_vt_batch.queue_name, 'q'))
  using msg_ids, vt_offsets;
end;
$$;

-- Deprecated upstream since the two-phase protocol (read, then start_tasks); kept so old callers get a clear
-- notice instead of a missing function.
create function pgflow.poll_for_tasks(
  queue_name text,
  vt integer,
  qty integer,
  max_poll_seconds integer default 5,
  poll_interval_ms integer default 100
)
returns setof pgflow.step_task_record
language plpgsql
volatile
set search_path = ''
as $$
begin
  raise notice 'pgflow.poll_for_tasks() is deprecated and returns nothing: read messages with pgmq.read() and claim them with pgflow.start_tasks()';
  return;
end;
$$;
