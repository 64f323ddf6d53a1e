-- Completion and failure: recording results, fenced to their attempt, and the exchange.
--
-- Owns: complete_task, complete_tasks, fail_task (upstream's forms and the fenced forms), the terminal paths
-- of a run (failing it, terminating its other tasks), and pgflow.exchange, which records a worker's finished
-- results and claims its next tasks in one round trip.
--
-- Fencing: a result carries the attempt it belongs to (and the worker that claimed it). It is applied only
-- when the task is still started at that attempt (by that worker); otherwise it is 'stale' and changes
-- nothing. Each item's outcome is a pgflow.task_outcome row.

-- Locks the messages a failure of one task holds: the task's own and, with p_whole_run, those of every live
-- (queued or started) task of its run, which a final failure cancels or skips. Per queue in message order,
-- queues in name order, so that a final failure never locks a sibling's message after its own. With
-- p_skip_locked (recovery, which never waits): returns false as soon as a message that still exists is held
-- by another transaction; messages that are gone are not waited for either way.
create function pgflow._lock_task_messages(
  p_run_id uuid,
  p_step_slug text,
  p_task_index int,
  p_whole_run boolean,
  p_skip_locked boolean
)
returns boolean
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_group record;
  v_locked bigint[];
  v_busy boolean;
begin
  for v_group in
    select t.queue_name, array_agg(t.message_id order by t.message_id) as ids
    from pgflow.step_tasks t
    where t.run_id = p_run_id and t.message_id is not null
      and ((t.step_slug = p_step_slug and t.task_index = p_task_index)
           or (p_whole_run and t.status in ('queued', 'started')))
    group by t.queue_name
    order by t.queue_name
  loop
    v_locked := pgflow._lock_messages(v_group.queue_name, v_group.ids, p_skip_locked);
    if p_skip_locked and cardinality(v_locked) < cardinality(v_group.ids)
       and to_regclass(format('pgmq.%I', pgmq.format_table_name(v_group.queue_name, 'q'))) is not null then
      execute format('select exists (select 1 from pgmq.%I q where q.msg_id = any ($1) and q.msg_id <> all ($2))',
                     pgmq.format_table_name(v_group.queue_name, 'q'))
      into v_busy
      using v_group.ids, v_locked;
      if v_busy then
        return false;
      end if;
    end if;
  end loop;
  return true;
end;
$$;

create function pgflow._archive_task_message(p_run_id uuid, p_step_slug text, p_task_index integer)
returns void
language sql
set search_path = ''
as $$
  select pgmq.archive(t.queue_name, t.message_id)
  from pgflow.step_tasks t
  where t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index
    and t.message_id is not null;
$$;

-- Moves the unfinished (queued or started) tasks of some steps of a run, or of the whole run when
-- p_step_slugs is NULL, to a terminal status (`skipped` or `cancelled`) and archives their messages, each in
-- the queue recorded on the task. Returns the number of tasks changed. The caller holds the run row; the
-- messages are locked before the task rows (the lock order of 0011_claims.sql), so a concurrent claim of one
-- of these messages either finishes first (its task is then cancelled too) or waits for this transaction.
create function pgflow._terminate_tasks(p_run_id uuid, p_step_slugs text[], p_status text)
returns integer
language plpgsql
set search_path = ''
as $$
declare
  v_count int := 0;
  v_group record;
begin
  for v_group in
    select t.queue_name, array_agg(t.message_id order by t.message_id) as ids
    from pgflow.step_tasks t
    where t.run_id = p_run_id
      and (p_step_slugs is null or t.step_slug = any (p_step_slugs))
      and t.status in ('queued', 'started')
    group by t.queue_name
    order by t.queue_name
  loop
    perform pgflow._lock_messages(v_group.queue_name, array_remove(v_group.ids, null));
  end loop;

  for v_group in
    with changed as (
      update pgflow.step_tasks t
      set status = p_status
      where t.run_id = p_run_id
        and (p_step_slugs is null or t.step_slug = any (p_step_slugs))
        and t.status in ('queued', 'started')
      returning t.queue_name, t.message_id
    )
    select c.queue_name, array_agg(c.message_id) filter (where c.message_id is not null) as ids,
           count(*)::int as n
    from changed c
    group by c.queue_name
  loop
    v_count := v_count + v_group.n;
    if v_group.ids is not null then
      perform pgmq.archive(v_group.queue_name, v_group.ids);
    end if;
  end loop;
  return v_count;
end;
$$;

-- Fails a started run: status `failed`, every unfinished task `cancelled` with its message archived, and a
-- `run:failed` event (with error_message when given). No-op for a run that is not started.
create function pgflow._fail_run(p_run_id uuid, p_error_message text)
returns boolean
language plpgsql
set search_path = ''
as $$
declare
  v_run pgflow.runs;
begin
  update pgflow.runs r
  set status = 'failed', failed_at = now()
  where r.run_id = p_run_id and r.status = 'started'
  returning r.* into v_run;
  if not found then
    return false;
  end if;

  perform pgflow._terminate_tasks(p_run_id, null, 'cancelled');

  perform pgflow._emit('run:failed', p_run_id, jsonb_strip_nulls(jsonb_build_object(
    'event_type', 'run:failed',
    'run_id', v_run.run_id,
    'flow_slug', v_run.flow_slug,
    'status', 'failed',
    'error_message', p_error_message,
    'failed_at', v_run.failed_at
  )));
  return true;
end;
$$;

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
  v_step_status text;
  v_max_attempts int;
  v_base_delay int;
  v_when_exhausted text;
  v_at timestamptz;
  v_attempts int;
  v_final boolean;
  v_delay int;
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

  -- 2. The messages: the task's own and, when this failure can be final (no attempt left, or forced), those of
  --    every live task of the run, which a final failure cancels or skips. All of them in the one order
  --    (queue name, message id), before any is held: never a sibling's message after the task's own.
  select t.attempts_count into v_attempts
  from pgflow.step_tasks t
  where t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index;
  if not found then
    return;
  end if;
  -- The attempt budget counts from the task's attempts_base (the attempts used before its last retry_run).
  select coalesce(s.opt_max_attempts, f.opt_max_attempts) + t.attempts_base into v_max_attempts
  from pgflow.steps s
  join pgflow.flows f on f.flow_slug = s.flow_slug
  join pgflow.step_tasks t on t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index
  where s.flow_slug = v_flow_slug and s.step_slug = p_step_slug;
  v_final := coalesce(p_force_exhausted or v_attempts >= v_max_attempts, false);
  perform pgflow._lock_task_messages(p_run_id, p_step_slug, p_task_index, v_final, false);

  -- 3. Then read the task, its step and the options, after the locks.
  select t.* into task
  from pgflow.step_tasks t
  where t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index;

  if v_run_status is distinct from 'started' or task.status <> 'started'
     or (p_attempt is not null and task.attempts_count is distinct from p_attempt)
     or (p_worker_id is not null and task.last_worker_id is distinct from p_worker_id)
     -- A claim started another attempt between the first read and the locks: the failure is of an earlier one.
     or task.attempts_count is distinct from v_attempts then
    return;
  end if;

  select ss.status,
         coalesce(s.opt_max_attempts, f.opt_max_attempts) + task.attempts_base,
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
    v_delay := case when p_retry_delay is null
                    then pgflow.calculate_retry_delay(v_base_delay, task.attempts_count - task.attempts_base)
                    else least(greatest(p_retry_delay, 0), pgflow._max_retry_delay_seconds()) end;
    perform pgflow._record_attempts('failed', array[p_run_id], array[p_step_slug], array[p_task_index],
                                    p_error_message);
    update pgflow.step_tasks t
    set status = 'queued', started_at = null, error_message = p_error_message, permanently_stalled_at = null
    where t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index
    returning t.* into task;
    perform pgmq.set_vt(task.queue_name, task.message_id, v_delay);
    -- The message is gone (archived when the task was marked permanently stalled, or purged): a fresh one,
    -- visible after the same delay, so that the queued task can be claimed again.
    if not found and to_regclass(format('pgmq.%I', pgmq.format_table_name(task.queue_name, 'q'))) is not null then
      update pgflow.step_tasks t
      set message_id = (select pgmq.send(task.queue_name, jsonb_build_object(
            'flow_slug', task.flow_slug,
            'run_id', task.run_id,
            'step_slug', task.step_slug,
            'task_index', task.task_index), pgflow._run_rank_headers(task.queue_name, task.run_id), v_delay))
      where t.run_id = p_run_id and t.step_slug = p_step_slug and t.task_index = p_task_index
      returning t.* into task;
    end if;
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

-- The two rare outcomes of a completion that is current (task `started` with its attempt), handled one by one:
--   * the task's step already ended (not `started`): nothing to record, the message is archived;
--   * a single step feeding a map that is not sized yet produced something other than an array: a type
--     violation, which fails the task, the step and the run.
-- The caller holds the run row and the task's message. Returns whether the output was applied.
create function pgflow._complete_task_exception(p_run_id uuid, p_step_slug text, p_task_index integer, p_output jsonb)
returns boolean
language plpgsql
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

-- Upstream's completion, unfenced, through the one implementation. Always returns the task row; for a task that
-- is not `started`, or of a run that is not started, nothing changes.
create function pgflow.complete_task(run_id uuid, step_slug text, task_index integer, output jsonb)
returns setof pgflow.step_tasks
language sql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
as $$
  select pgflow._replan_if_grown();
  select (c.task).*
  from pgflow._complete_tasks(array[complete_task.run_id], array[complete_task.step_slug],
                              array[complete_task.task_index], array[complete_task.output], array[null::int],
                              null) c;
$$;

-- The fenced completion of one task (see the top of this file), through the one implementation.
create function pgflow.complete_task(run_id uuid, step_slug text, task_index integer, output jsonb, attempt integer, worker_id uuid default NULL::uuid)
returns setof pgflow.task_outcome
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
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

-- The fenced batch, set-based: one outcome row per item that names an existing task, in the order given.
create function pgflow.complete_tasks(run_ids uuid[], step_slugs text[], task_indexes integer[], outputs jsonb[], attempts integer[], worker_id uuid default NULL::uuid)
returns setof pgflow.task_outcome
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
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

-- Upstream's failure: records a started task's failure, unfenced: retry with exponential backoff while attempts
-- remain, otherwise apply the step's when_exhausted (fail the run, or skip the step / skip it with its
-- dependents). Always returns the task row; for a task that is not `started`, or of a run that is not started,
-- nothing changes.
create function pgflow.fail_task(run_id uuid, step_slug text, task_index integer, error_message text)
returns setof pgflow.step_tasks
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
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
create function pgflow.fail_task(run_id uuid, step_slug text, task_index integer, error_message text, attempt integer, worker_id uuid default NULL::uuid, retry_delay_seconds integer default NULL::integer, terminal boolean default false)
returns setof pgflow.task_outcome
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
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
  if (v_result.task).run_id is not null and not v_result.applied then
    perform pgflow._log_stale_results(array[fail_task.run_id], array[fail_task.step_slug],
                                      array[fail_task.task_index], array[fail_task.attempt], fail_task.worker_id,
                                      '{}');
  end if;
  if (v_result.task).run_id is not null then
    return next ((v_result.task).run_id, (v_result.task).step_slug, (v_result.task).task_index,
                 case when v_result.applied then 'applied' else 'stale' end,
                 (v_result.task).status, (v_result.task).attempts_count,
                 (v_result.task).last_worker_id)::pgflow.task_outcome;
  end if;
end;
$$;

-- Records the worker's finished outputs (fenced, exactly as complete_tasks: item i = run_ids[i],
-- done_step_slugs[i], task_indexes[i], outputs[i], attempts[i]; empty arrays: none), then claims up to `qty`
-- tasks of `queue_name` for the worker's (flow_slugs[j], step_slugs[j]) pairs (qty 0: no claim), in one
-- transaction. Returns the rows of both, completions first:
--   outcome 'applied' | 'stale'   one row per completion item naming an existing task: run_id, step_slug,
--                                 task_index, attempts_count (the task's current attempt) and status
--   the claim's rows              as read_and_claim_tasks
-- The claim has two parts. Dependents that the completions start on the worker's queue, and that its read
-- would take, are created claimed for it (CLAIMED AT CREATION, 06_runs.sql), unless the worker's function is
-- disabled; they come first, as 'claimed' rows in message order. Then read_and_claim_tasks reads and claims
-- the rest of `qty` from the queue, older messages first; after tasks created claimed, only when the queue had
-- visible messages or a completion created a task on it queued (the read would find nothing else). If that
-- read reports the batch 'unsupported' (or the function 'disabled'), the tasks created claimed stay claimed
-- by the worker: a worker stopping on that report hands them back with release_worker_tasks, as any task it
-- claimed ahead.
-- When the claim finds an unsupported batch, the completions are still recorded (they are the worker's own
-- results); only the read's claim changes nothing. The completions' task creation is marked as the
-- exchange's (the transaction-local setting pgflow.signal_source) for pgflow._signal_queues, which also
-- learns the exchange's worker; the marks are cleared before the read. Plans are reset first when the tables
-- have grown (pgflow._replan_if_grown).
create function pgflow.exchange(queue_name text, worker_id uuid, flow_slugs text[], step_slugs text[], qty integer, vt integer, run_ids uuid[], done_step_slugs text[], task_indexes integer[], outputs jsonb[], attempts integer[])
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
