-- pgflow-rs SQL core, migration 0007: the task lifecycle (the worker API).
--
-- Upstream interface: start_tasks, complete_task, fail_task, _archive_task_message, set_vt_batch,
-- poll_for_tasks (deprecated stub). Additions: the queue-aware start_tasks(flow_slug, msg_ids, worker_id,
-- queue_name); results fenced to their attempt (complete_task / fail_task with `attempt`, complete_tasks for a
-- batch); the task-input assembly shared by every claim path.
--
-- Every queue operation on a task uses the task's own (queue_name, message_id). Every function here follows
-- the one lock order of the SQL core, written down at the top of 0011_claims.sql: the run row, then the task's
-- message, then the task row.
--
-- Fencing. A claim hands the worker the task's attempt number (attempts_count after the claim) and records the
-- worker in last_worker_id. A fenced result (`attempt` given, optionally `worker_id`) is applied only while the
-- task is still `started` with that attempt (and that worker). Anything else, a result from an attempt that
-- timed out and was requeued, a retried call whose first reply was lost, a task cancelled meanwhile, changes
-- nothing and comes back with outcome 'stale' and the task's current status and attempt. The upstream
-- four-argument complete_task and fail_task stay unfenced, exactly as upstream.

-- The result of a fenced completion or failure.
create type pgflow.task_outcome as (
  run_id uuid,
  step_slug text,
  task_index int,
  -- 'applied': this call recorded the result; 'stale': it changed nothing (see the fencing note above).
  outcome text,
  -- The task's status and attempt afterwards (NULL when there is no such task), and its last worker.
  status text,
  attempts_count int,
  last_worker_id uuid
);

------------------------------------------------------------------------------------------------------------
-- Task input
------------------------------------------------------------------------------------------------------------

-- What a claimed task's handler receives, the one definition every claim path uses:
--   input       a map task: its array element (copied onto the task when the step started);
--               a single step: {dep_slug: output} over its completed dependencies ({} for a root step);
--   flow_input  the run input for a root single step, NULL otherwise.
-- Plain SQL without SET options, so the planner can inline it into the claim statements.
create function pgflow._task_inputs(
  p_run_id uuid,
  p_flow_slug text,
  p_step_slug text,
  p_step_type text,
  p_deps_count int,
  p_element jsonb,
  p_run_input jsonb
)
returns table (input jsonb, flow_input jsonb)
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

------------------------------------------------------------------------------------------------------------
-- Claiming (upstream's protocol: pgmq.read, then start_tasks)
------------------------------------------------------------------------------------------------------------

-- Claims the queued tasks behind `msg_ids` read from queue `queue_name` and returns them ready to run.
--
-- * Only tasks that are `queued`, of a started run and a started step are claimed; other messages are ignored
--   (a started task's message seen again, or a terminal task's, is not an error).
-- * The messages are locked first, then the task rows, then one guarded UPDATE claims them; rows come from its
--   RETURNING, so of two overlapping claims of one message exactly one returns the task.
-- * Before returning, every claimed message gets visibility = effective step timeout + claim buffer
--   (pgflow._claim_visibility_buffer_seconds()). If any claimed message could not be updated (it is missing
--   from its queue), the whole claim fails with `start_tasks(): visibility updated N of M claimed messages` and
--   nothing is claimed.
-- * flow_slug NULL claims tasks of any flow in that queue.
create function pgflow.start_tasks(flow_slug text, msg_ids bigint[], worker_id uuid, queue_name text)
returns setof pgflow.step_task_record
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_queue text := lower(start_tasks.queue_name);
  v_claimed bigint[];
  v_secs float8[];
  v_updated int;
begin
  if msg_ids is null or cardinality(msg_ids) = 0 then
    return;
  end if;

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
         array_agg(coalesce(s.opt_timeout, f.opt_timeout)::float8 + pgflow._claim_visibility_buffer_seconds()
                   order by c.message_id)
  into v_claimed, v_secs
  from claimed c
  join pgflow.steps s on s.flow_slug = c.flow_slug and s.step_slug = c.step_slug
  join pgflow.flows f on f.flow_slug = c.flow_slug;

  if v_claimed is null then
    return;
  end if;

  execute format(
    'update pgmq.%I q set vt = clock_timestamp() + make_interval(secs => v.secs)
       from unnest($1::bigint[], $2::float8[]) as v(id, secs)
      where q.msg_id = v.id',
    pgmq.format_table_name(v_queue, 'q'))
  using v_claimed, v_secs;
  get diagnostics v_updated = row_count;

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

-- Records a started task's output; the one implementation behind every completion function.
--
-- p_attempt / p_worker_id NULL: unfenced (upstream's complete_task). Otherwise the result is applied only while
-- the task is `started` with attempts_count = p_attempt (and last_worker_id = p_worker_id when given).
-- Returns whether this call applied the result, and the task row afterwards (NULL when there is no such task
-- or run). A result that is not applied changes nothing, except that the message of a task whose step already
-- ended is archived.
create function pgflow._complete_task(
  p_run_id uuid,
  p_step_slug text,
  p_task_index int,
  p_output jsonb,
  p_attempt int,
  p_worker_id uuid,
  out applied boolean,
  out task pgflow.step_tasks
)
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_run_status text;
  v_flow_slug text;
  v_queue text;
  v_msg_id bigint;
  v_read record;
  v_step_status text;
  v_step_type text;
  v_remaining int;
  v_initial int;
  v_child text;
  v_type text;
  v_error text;
  v_step_output jsonb;
  v_completed_at timestamptz;
  v_child_tasks int;
  v_ready_children int;
  v_remaining_steps int;
begin
  applied := false;

  -- 1. The run row: every state change of a run is serialised on it.
  select r.status, r.flow_slug into v_run_status, v_flow_slug
  from pgflow.runs r
  where r.run_id = p_run_id
  for no key update;
  if not found then
    return;
  end if;

  -- 2. The task's message (its identity never changes while the run row is held).
  select t.queue_name, t.message_id into v_queue, v_msg_id
  from pgflow.step_tasks t
  where t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index;
  if not found then
    return;
  end if;
  if v_msg_id is not null then
    perform pgflow._lock_messages(v_queue, array[v_msg_id]);
  end if;

  -- 3. Only now read the task and its step, in a statement of their own, so every decision below uses what
  -- concurrent transactions committed before this one got its locks.
  select t as task, ss.status as step_status, ss.remaining_tasks, ss.initial_tasks, s.step_type
  into v_read
  from pgflow.step_tasks t
  join pgflow.step_states ss on ss.run_id = t.run_id and ss.step_slug = t.step_slug
  join pgflow.steps s on s.flow_slug = ss.flow_slug and s.step_slug = ss.step_slug
  where t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index;
  task := v_read.task;
  v_step_status := v_read.step_status;
  v_remaining := v_read.remaining_tasks;
  v_initial := v_read.initial_tasks;
  v_step_type := v_read.step_type;

  if v_run_status is distinct from 'started' or task.status <> 'started'
     or (p_attempt is not null and task.attempts_count is distinct from p_attempt)
     or (p_worker_id is not null and task.last_worker_id is distinct from p_worker_id) then
    return;
  end if;

  if v_step_status <> 'started' then
    -- Late callback for a step that already ended: nothing to record, make sure the message is gone.
    perform pgmq.archive(task.queue_name, task.message_id);
    return;
  end if;

  applied := true;

  -- A single step feeding a map must produce an array: anything else fails the run.
  if v_step_type = 'single' and (p_output is null or jsonb_typeof(p_output) <> 'array') then
    select d.step_slug into v_child
    from pgflow.deps d
    join pgflow.steps cs on cs.flow_slug = d.flow_slug and cs.step_slug = d.step_slug
    join pgflow.step_states cst on cst.run_id = p_run_id and cst.step_slug = d.step_slug
    where d.flow_slug = v_flow_slug and d.dep_slug = p_step_slug
      and cs.step_type = 'map' and cst.initial_tasks is null
    order by cs.step_index
    limit 1;

    if found then
      v_type := coalesce(jsonb_typeof(p_output), 'null');
      v_error := format('[TYPE_VIOLATION] Map step %s expects array input but dependency %s produced %s',
                        v_child, p_step_slug, v_type);
      update pgflow.step_tasks t
      set status = 'failed', failed_at = now(), output = p_output,
          error_message = format('[TYPE_VIOLATION] Produced %s instead of array', v_type)
      where t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index
      returning t.* into task;
      perform pgmq.archive(task.queue_name, task.message_id);

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
      return;
    end if;
  end if;

  update pgflow.step_tasks t
  set status = 'completed', completed_at = now(), output = p_output
  where t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index
    and t.status = 'started'
  returning t.* into task;

  perform pgmq.archive(task.queue_name, task.message_id);

  if v_remaining > 1 then
    update pgflow.step_states ss
    set remaining_tasks = ss.remaining_tasks - 1
    where ss.run_id = p_run_id and ss.step_slug = p_step_slug;
    return;
  end if;

  -- Last task: the step completes with its output (map: task outputs ordered by task_index).
  if v_step_type = 'map' then
    select jsonb_agg(t.output order by t.task_index) into v_step_output
    from pgflow.step_tasks t
    where t.run_id = p_run_id and t.step_slug = p_step_slug;
  else
    v_step_output := p_output;
  end if;

  update pgflow.step_states ss
  set remaining_tasks = 0, status = 'completed', completed_at = now(), output = v_step_output
  where ss.run_id = p_run_id and ss.step_slug = p_step_slug
  returning ss.completed_at into v_completed_at;

  -- Map dependents learn their task count: a map parent's task count, or a single parent's array length.
  v_child_tasks := case
    when v_step_type = 'map' then v_initial
    when jsonb_typeof(p_output) = 'array' then jsonb_array_length(p_output)
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
    where d.flow_slug = v_flow_slug and d.dep_slug = p_step_slug
      and c.run_id = p_run_id and c.step_slug = d.step_slug
    returning c.remaining_deps
  )
  select count(*) filter (where remaining_deps = 0) into v_ready_children from released;

  update pgflow.runs r
  set remaining_steps = r.remaining_steps - 1
  where r.run_id = p_run_id
  returning r.remaining_steps into v_remaining_steps;

  perform pgflow._emit('step:' || p_step_slug || ':completed', p_run_id,
    jsonb_build_object(
      'event_type', 'step:completed',
      'run_id', p_run_id,
      'step_slug', p_step_slug,
      'status', 'completed',
      'output', v_step_output,
      'completed_at', v_completed_at
    ));

  -- Only dependents that just became ready can start, skip or complete taskless; with none, the run can
  -- only have finished.
  if v_ready_children > 0 then
    perform pgflow._advance_run(p_run_id);
  elsif v_remaining_steps = 0 then
    perform pgflow.maybe_complete_run(p_run_id);
  end if;
end;
$$;

-- Upstream's completion: records a started task's output, unfenced. Always returns the task row; for a task
-- that is not `started` (queued, completed, failed, skipped, cancelled), or of a run that is not started,
-- nothing changes.
create function pgflow.complete_task(run_id uuid, step_slug text, task_index int, output jsonb)
returns setof pgflow.step_tasks
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_task pgflow.step_tasks;
begin
  select (c.task).* into v_task
  from pgflow._complete_task(complete_task.run_id, complete_task.step_slug, complete_task.task_index,
                             complete_task.output, null, null) c;
  if v_task.run_id is not null then
    return next v_task;
  end if;
end;
$$;

-- The fenced completion: records the output only while the task is still `started` with this attempt (and,
-- when worker_id is given, claimed by that worker). Returns one task_outcome row: 'applied', or 'stale' with
-- the task's current status and attempt. No row when the task does not exist.
create function pgflow.complete_task(
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
declare
  v_result record;
begin
  if attempt is null then
    raise exception 'complete_task(): attempt is required by the fenced form'
      using errcode = 'invalid_parameter_value',
            hint = 'Pass the attempt the claim returned, or call the four-argument complete_task.';
  end if;
  select c.applied, c.task into v_result
  from pgflow._complete_task(complete_task.run_id, complete_task.step_slug, complete_task.task_index,
                             complete_task.output, complete_task.attempt, complete_task.worker_id) c;
  if (v_result.task).run_id is not null then
    return next ((v_result.task).run_id, (v_result.task).step_slug, (v_result.task).task_index,
                 case when v_result.applied then 'applied' else 'stale' end,
                 (v_result.task).status, (v_result.task).attempts_count,
                 (v_result.task).last_worker_id)::pgflow.task_outcome;
  end if;
end;
$$;

-- Records several fenced task outputs in one transaction: the fenced complete_task for each (run_ids[i],
-- step_slugs[i], task_indexes[i], outputs[i], attempts[i]), all claimed by worker_id (NULL: any worker), in
-- run-id order so concurrent batches lock runs in one order. Returns one task_outcome row per item that names
-- an existing task, in the order given.
create function pgflow.complete_tasks(
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
declare
  v_row record;
  v_out pgflow.task_outcome[] := '{}';
  v_ord bigint[] := '{}';
  v_result record;
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

  for v_row in
    select u.run_id, u.step_slug, u.task_index, u.output, u.attempt, u.ord
    from unnest(complete_tasks.run_ids, complete_tasks.step_slugs, complete_tasks.task_indexes,
                complete_tasks.outputs, complete_tasks.attempts)
           with ordinality as u(run_id, step_slug, task_index, output, attempt, ord)
    order by u.run_id, u.ord
  loop
    if v_row.attempt is null then
      raise exception 'complete_tasks(): attempts[%] is NULL', v_row.ord
        using errcode = 'invalid_parameter_value',
              hint = 'Every item needs the attempt its claim returned.';
    end if;
    select c.applied, c.task into v_result
    from pgflow._complete_task(v_row.run_id, v_row.step_slug, v_row.task_index, v_row.output, v_row.attempt,
                               complete_tasks.worker_id) c;
    if (v_result.task).run_id is not null then
      v_ord := v_ord || v_row.ord;
      v_out := v_out || ((v_result.task).run_id, (v_result.task).step_slug, (v_result.task).task_index,
                         case when v_result.applied then 'applied' else 'stale' end,
                         (v_result.task).status, (v_result.task).attempts_count,
                         (v_result.task).last_worker_id)::pgflow.task_outcome;
    end if;
  end loop;

  return query
  select u.run_id, u.step_slug, u.task_index, u.outcome, u.status, u.attempts_count, u.last_worker_id
  from unnest(v_out) with ordinality
         as u(run_id, step_slug, task_index, outcome, status, attempts_count, last_worker_id, pos)
  order by v_ord[u.pos];
end;
$$;

------------------------------------------------------------------------------------------------------------
-- Failing
------------------------------------------------------------------------------------------------------------

-- Records a started task's failure; the one implementation behind fail_task (every form) and the operator's
-- resolve_stalled_task.
--
--   p_force_exhausted   no retry: the task fails as if its attempts were used up (the step's when_exhausted
--                       applies)
--   p_attempt/p_worker_id  NULL: unfenced (upstream's fail_task); otherwise the fence of _complete_task
--   p_retry_delay       seconds before the retry instead of the exponential backoff (NULL: the backoff);
--                       capped at pgflow._max_retry_delay_seconds()
-- Retry while attempts remain: back to `queued`, the message visible again after the delay. Otherwise the step's
-- when_exhausted: fail the step and the run, or skip the step (and, with skip-cascade, its dependents).
-- Returns whether this call applied the failure, and the task row afterwards.
create function pgflow._fail_task(
  p_run_id uuid,
  p_step_slug text,
  p_task_index int,
  p_error_message text,
  p_force_exhausted boolean,
  p_attempt int,
  p_worker_id uuid,
  p_retry_delay int,
  out applied boolean,
  out task pgflow.step_tasks
)
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_run_status text;
  v_flow_slug text;
  v_queue text;
  v_msg_id bigint;
  v_step_status text;
  v_max_attempts int;
  v_base_delay int;
  v_when_exhausted text;
  v_at timestamptz;
begin
  applied := false;

  -- 1. The run row.
  select r.status, r.flow_slug into v_run_status, v_flow_slug
  from pgflow.runs r
  where r.run_id = p_run_id
  for no key update;
  if not found then
    return;
  end if;

  -- 2. The task's message.
  select t.queue_name, t.message_id into v_queue, v_msg_id
  from pgflow.step_tasks t
  where t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index;
  if not found then
    return;
  end if;
  if v_msg_id is not null then
    perform pgflow._lock_messages(v_queue, array[v_msg_id]);
  end if;

  -- 3. Then read the task, its step and the options, after the locks.
  select t.* into task
  from pgflow.step_tasks t
  where t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index;

  if v_run_status is distinct from 'started' or task.status <> 'started'
     or (p_attempt is not null and task.attempts_count is distinct from p_attempt)
     or (p_worker_id is not null and task.last_worker_id is distinct from p_worker_id) then
    return;
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
    perform pgmq.archive(task.queue_name, task.message_id);
    return;
  end if;

  applied := true;

  -- Retry: back to the queue, visible again after the backoff (or the handler's delay), never more than the cap.
  if not p_force_exhausted and task.attempts_count < v_max_attempts then
    update pgflow.step_tasks t
    set status = 'queued', started_at = null, error_message = p_error_message
    where t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index
    returning t.* into task;
    perform pgmq.set_vt(task.queue_name, task.message_id,
      case when p_retry_delay is null then pgflow.calculate_retry_delay(v_base_delay, task.attempts_count)
           else least(greatest(p_retry_delay, 0), pgflow._max_retry_delay_seconds()) end);
    return;
  end if;

  -- Exhausted.
  update pgflow.step_tasks t
  set status = 'failed', failed_at = now(), error_message = p_error_message, permanently_stalled_at = null
  where t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index
  returning t.* into task;
  perform pgmq.archive(task.queue_name, task.message_id);

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
    return;
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
end;
$$;

-- Upstream's failure: records a started task's failure, unfenced: retry with exponential backoff while attempts
-- remain, otherwise apply the step's when_exhausted (fail the run, or skip the step / skip it with its
-- dependents). Always returns the task row; for a task that is not `started`, or of a run that is not started,
-- nothing changes.
create function pgflow.fail_task(run_id uuid, step_slug text, task_index int, error_message text)
returns setof pgflow.step_tasks
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_task pgflow.step_tasks;
begin
  select (f.task).* into v_task
  from pgflow._fail_task(fail_task.run_id, fail_task.step_slug, fail_task.task_index, fail_task.error_message,
                         false, null, null, null) f;
  if v_task.run_id is not null then
    return next v_task;
  end if;
end;
$$;

-- The fenced failure, with the handler's two decisions:
--   attempt, worker_id     the fence (see the top of this file)
--   retry_delay_seconds    when the task is retried, its message becomes visible after this many seconds instead
--                          of the step's exponential backoff (capped at one day)
--   terminal               no retry: the task fails as if its attempts were used up; when_exhausted applies
-- Returns one task_outcome row ('applied' or 'stale'); no row when the task does not exist.
create function pgflow.fail_task(
  run_id uuid,
  step_slug text,
  task_index int,
  error_message text,
  attempt int,
  worker_id uuid default null,
  retry_delay_seconds int default null,
  terminal boolean default false
)
returns setof pgflow.task_outcome
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_result record;
begin
  if attempt is null then
    raise exception 'fail_task(): attempt is required by the fenced form'
      using errcode = 'invalid_parameter_value',
            hint = 'Pass the attempt the claim returned, or call the four-argument fail_task.';
  end if;
  select f.applied, f.task into v_result
  from pgflow._fail_task(fail_task.run_id, fail_task.step_slug, fail_task.task_index, fail_task.error_message,
                         coalesce(fail_task.terminal, false), fail_task.attempt, fail_task.worker_id,
                         fail_task.retry_delay_seconds) f;
  if (v_result.task).run_id is not null then
    return next ((v_result.task).run_id, (v_result.task).step_slug, (v_result.task).task_index,
                 case when v_result.applied then 'applied' else 'stale' end,
                 (v_result.task).status, (v_result.task).attempts_count,
                 (v_result.task).last_worker_id)::pgflow.task_outcome;
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
