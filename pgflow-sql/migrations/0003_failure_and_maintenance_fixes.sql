-- pgflow-rs SQL core: failure, recovery and retention fixes.
--
-- * A final failure (fail_task, the dead-worker recovery, resolve_stalled_task 'fail') and a completion that
--   can fail its run lock the messages of the run's live tasks together with their own, in the one order,
--   before holding any: a claim by explicit ids holding a sibling's message no longer deadlocks with them.
-- * A late failure with attempts left whose task's message is gone (a permanently stalled task, a purge)
--   requeues it with a fresh message instead of leaving it `queued` with none.
-- * requeue_stalled_tasks recovers a started task whose message is gone.
-- * run_maintenance prunes first and recovers after, never waiting for a run row or a message while it holds
--   messages of stalled tasks; the dead-worker failures take their run row and messages SKIP LOCKED.
-- * prune_history deletes the watcher rows of the runs it prunes.
--
-- WHO LOCKS WHAT, in the one lock order (advisory locks; runs in run-id order; messages per queue in message-id
-- order, queues in name order; tasks; step states and run counters). "skip" = SKIP LOCKED, never waits.
--   ensure_flow_compiled, activate_alias   advisory: slug compile lock, queue-name locks (sorted), alias lock
--   run_maintenance                        advisory maintenance lock (try only); then prune_history, then
--                                          requeue_stalled_tasks, then requeue_dead_worker_tasks
--   watch_run                              one run FOR SHARE
--   claim_tasks, read_and_claim_tasks,     messages (pgmq.read / lock_visible: skip; explicit ids: waits, in
--   start_tasks (both forms)               message-id order), then their tasks FOR UPDATE in message order
--   complete_task(s) (_complete_tasks)     runs of the batch; the batch's messages plus, when an item can fail
--                                          its run, the messages of that run's live tasks; then tasks, step
--                                          states, run counters (_complete_task_exception, _advance_runs,
--                                          cascade_resolve_conditions, _fail_run, _terminate_tasks re-take only
--                                          locks already held)
--   exchange                               _complete_tasks, then a claim whose messages are taken skip
--   fail_task (both forms, _fail_task)     run; the task's message plus, when the failure can be final, the
--                                          messages of the run's live tasks; then tasks, step states
--   resolve_stalled_task                   run; the task's message plus, for 'fail', the run's live messages;
--                                          task FOR UPDATE; then as _fail_task
--   release_worker_tasks                   the worker's messages (per queue, message order), then tasks
--   requeue_stalled_tasks                  messages skip, tasks skip; tasks whose message is gone: skip
--   requeue_dead_worker_tasks              worker rows; per last attempt: run skip, its messages skip, then
--                                          _fail_task; others: messages skip, tasks skip
--   prune_history                          finished runs skip; their messages (deleted, waits), tasks, step
--                                          states, watcher rows, runs; archived messages; worker rows skip
--   worker_heartbeat                       its worker row

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

revoke execute on function pgflow._lock_task_messages(uuid, text, int, boolean, boolean) from public;

create or replace function pgflow._fail_task(
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
  select coalesce(s.opt_max_attempts, f.opt_max_attempts) into v_max_attempts
  from pgflow.steps s
  join pgflow.flows f on f.flow_slug = s.flow_slug
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
    v_delay := case when p_retry_delay is null then pgflow.calculate_retry_delay(v_base_delay, task.attempts_count)
                    else least(greatest(p_retry_delay, 0), pgflow._max_retry_delay_seconds()) end;
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
            'task_index', task.task_index), v_delay))
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
    perform pgflow._queue_op(g.queue_name, 'archive', g.ids)
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

create or replace function pgflow.requeue_stalled_tasks()
returns int
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_requeued int := 0;
  v_group record;
  v_locked bigint[];
  v_result record;
  v_gone bigint[];
  v_task record;
begin
  for v_group in
    select c.queue_name, array_agg(c.message_id order by c.message_id) as ids
    from pgflow._started_tasks() c
    where c.permanently_stalled_at is null and c.message_id is not null
      and pgflow._recovery_boundary(c.started_at, c.effective_timeout) < now()
    group by c.queue_name
    order by c.queue_name
  loop
    v_locked := pgflow._lock_messages(v_group.queue_name, v_group.ids, true);
    with stalled as (
      select t.run_id, t.step_slug, t.task_index
      from pgflow.step_tasks t
      where t.queue_name = v_group.queue_name and t.message_id = any (v_locked)
        and t.status = 'started' and t.permanently_stalled_at is null
      order by t.message_id
      for update skip locked
    ),
    changed as (
      update pgflow.step_tasks t
      set status = case when t.requeued_count < 3 then 'queued' else t.status end,
          started_at = case when t.requeued_count < 3 then null else t.started_at end,
          last_worker_id = case when t.requeued_count < 3 then null else t.last_worker_id end,
          requeued_count = case when t.requeued_count < 3 then t.requeued_count + 1 else t.requeued_count end,
          last_requeued_at = case when t.requeued_count < 3 then now() else t.last_requeued_at end,
          permanently_stalled_at = case when t.requeued_count < 3 then null else now() end
      from stalled x
      where t.run_id = x.run_id and t.step_slug = x.step_slug and t.task_index = x.task_index
      returning t.message_id, t.status
    )
    select array_agg(c.message_id) filter (where c.status = 'queued') as requeue,
           array_agg(c.message_id) filter (where c.status <> 'queued') as stalled
    into v_result
    from changed c;
    if v_result.requeue is not null then
      perform pgmq.set_vt(v_group.queue_name, v_result.requeue, 0);
      v_requeued := v_requeued + cardinality(v_result.requeue);
    end if;
    if v_result.stalled is not null then
      perform pgmq.archive(v_group.queue_name, v_result.stalled);
    end if;

    -- Tasks whose message is gone (a purge, an archive by hand) are recovered the same way: requeued with a
    -- fresh message, visible now, or marked permanently stalled. Their rows are taken SKIP LOCKED too.
    if cardinality(v_locked) < cardinality(v_group.ids)
       and to_regclass(format('pgmq.%I', pgmq.format_table_name(v_group.queue_name, 'q'))) is not null then
      execute format(
        'select coalesce(array_agg(i.id), ''{}'') from unnest($1) as i(id)
          where not exists (select 1 from pgmq.%I q where q.msg_id = i.id)',
        pgmq.format_table_name(v_group.queue_name, 'q'))
      into v_gone
      using v_group.ids;
      for v_task in
        select t.run_id, t.step_slug, t.task_index, t.flow_slug, t.requeued_count
        from pgflow.step_tasks t
        where t.queue_name = v_group.queue_name and t.message_id = any (v_gone)
          and t.status = 'started' and t.permanently_stalled_at is null
        order by t.message_id
        for update skip locked
      loop
        if v_task.requeued_count < 3 then
          update pgflow.step_tasks t
          set status = 'queued', started_at = null, last_worker_id = null,
              requeued_count = t.requeued_count + 1, last_requeued_at = now(),
              message_id = (select pgmq.send(v_group.queue_name, jsonb_build_object(
                'flow_slug', v_task.flow_slug,
                'run_id', v_task.run_id,
                'step_slug', v_task.step_slug,
                'task_index', v_task.task_index)))
          where t.run_id = v_task.run_id and t.step_slug = v_task.step_slug and t.task_index = v_task.task_index;
          v_requeued := v_requeued + 1;
        else
          update pgflow.step_tasks t
          set permanently_stalled_at = now()
          where t.run_id = v_task.run_id and t.step_slug = v_task.step_slug and t.task_index = v_task.task_index;
        end if;
      end loop;
    end if;
  end loop;

  return v_requeued;
end;
$$;

create or replace function pgflow.requeue_dead_worker_tasks(dead_after interval)
returns int
language plpgsql
volatile
security definer
set search_path = ''
as $$
declare
  v_dead uuid[];
  v_task record;
  v_group record;
  v_locked bigint[];
  v_count int := 0;
  v_n int;
begin
  if dead_after is null or dead_after <= interval '0' then
    raise exception 'requeue_dead_worker_tasks(): dead_after must be a positive interval, got %', dead_after
      using errcode = 'invalid_parameter_value';
  end if;

  -- Mark newly silent workers stopped (monitoring then stops counting them; a worker that was only slow sees
  -- it at its next heartbeat and registers again).
  update pgflow.workers w
  set stopped_at = clock_timestamp()
  where w.stopped_at is null and w.last_heartbeat_at < clock_timestamp() - dead_after;

  -- Every silent worker that still holds started tasks, found through the work in flight.
  select array_agg(distinct c.last_worker_id) into v_dead
  from pgflow._started_tasks() c
  join pgflow.workers w on w.worker_id = c.last_worker_id
  where c.permanently_stalled_at is null and w.last_heartbeat_at < clock_timestamp() - dead_after;

  if v_dead is null then
    return 0;
  end if;

  -- The last attempt died with its worker: fail it (run row, then messages, then task, in run order). Recovery
  -- never waits: the run row and every message the failure locks (those of the run's live tasks, which a
  -- final failure cancels or skips) are taken SKIP LOCKED first, and a task whose run or messages another
  -- transaction holds is left to the next sweep.
  for v_task in
    select c.run_id, c.step_slug, c.task_index, c.attempts_count, c.max_attempts, c.last_worker_id
    from pgflow._started_tasks() c
    where c.last_worker_id = any (v_dead) and c.permanently_stalled_at is null
      and c.attempts_count >= c.max_attempts
    order by c.run_id, c.step_slug, c.task_index
  loop
    perform 1 from pgflow.runs r where r.run_id = v_task.run_id for no key update skip locked;
    continue when not found;
    continue when not pgflow._lock_task_messages(v_task.run_id, v_task.step_slug, v_task.task_index, true, true);
    if (select f.applied from pgflow._fail_task(v_task.run_id, v_task.step_slug, v_task.task_index,
          format('worker %s stopped responding during the last attempt (%s of %s)', v_task.last_worker_id,
                 v_task.attempts_count, v_task.max_attempts),
          true, v_task.attempts_count, v_task.last_worker_id, null) f) then
      v_count := v_count + 1;
    end if;
  end loop;

  -- The others go back to the queue (message, then task).
  for v_group in
    select c.queue_name, array_agg(c.message_id order by c.message_id) as ids
    from pgflow._started_tasks() c
    where c.last_worker_id = any (v_dead) and c.permanently_stalled_at is null and c.message_id is not null
      and c.attempts_count < c.max_attempts
    group by c.queue_name
    order by c.queue_name
  loop
    v_locked := pgflow._lock_messages(v_group.queue_name, v_group.ids, true);
    with orphaned as (
      select t.run_id, t.step_slug, t.task_index
      from pgflow.step_tasks t
      where t.queue_name = v_group.queue_name and t.message_id = any (v_locked)
        and t.status = 'started' and t.last_worker_id = any (v_dead)
      order by t.message_id
      for update skip locked
    ),
    requeued as (
      update pgflow.step_tasks t
      set status = 'queued', started_at = null, last_worker_id = null,
          requeued_count = t.requeued_count + 1, last_requeued_at = now()
      from orphaned o
      where t.run_id = o.run_id and t.step_slug = o.step_slug and t.task_index = o.task_index
      returning t.message_id
    )
    select coalesce(array_agg(r.message_id), '{}') into v_locked from requeued r;
    v_n := cardinality(v_locked);
    if v_n > 0 then
      perform pgmq.set_vt(v_group.queue_name, v_locked, 0);
      v_count := v_count + v_n;
    end if;
  end loop;

  return v_count;
end;
$$;

create or replace function pgflow.resolve_stalled_task(
  run_id uuid,
  step_slug text,
  task_index int,
  action text,
  error_message text default 'Task stalled permanently'
)
returns setof pgflow.step_tasks
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_task pgflow.step_tasks;
  v_msg_id bigint;
begin
  if action is null or action not in ('fail', 'retry') then
    raise exception 'resolve_stalled_task(): action must be ''fail'' or ''retry'', got %', coalesce(quote_literal(action), 'NULL');
  end if;

  perform 1 from pgflow.runs r where r.run_id = resolve_stalled_task.run_id for no key update;

  -- The messages before the task row, as everywhere: the task's own (normally archived already) and, for
  -- 'fail', those of the run's live tasks, which the failure cancels or skips, all in the one order.
  perform pgflow._lock_task_messages(resolve_stalled_task.run_id, resolve_stalled_task.step_slug,
                                     resolve_stalled_task.task_index, action = 'fail', false);
  select t.* into v_task
  from pgflow.step_tasks t
  where t.run_id = resolve_stalled_task.run_id and t.step_slug = resolve_stalled_task.step_slug
    and t.task_index = resolve_stalled_task.task_index
  for update;

  if v_task.run_id is null then
    raise exception 'resolve_stalled_task(): no task (run_id %, step %, task_index %)',
      resolve_stalled_task.run_id, resolve_stalled_task.step_slug, resolve_stalled_task.task_index;
  end if;
  if v_task.status <> 'started' or v_task.permanently_stalled_at is null then
    raise exception 'resolve_stalled_task(): task (run_id %, step %, task_index %) is not permanently stalled (status %)',
      v_task.run_id, v_task.step_slug, v_task.task_index, v_task.status
      using hint = 'Only tasks marked by requeue_stalled_tasks() (permanently_stalled_at set) can be resolved.';
  end if;

  if action = 'fail' then
    return query
    select (f.task).* from pgflow._fail_task(v_task.run_id, v_task.step_slug, v_task.task_index, error_message,
                                             true, null, null, null) f;
    return;
  end if;

  select pgmq.send(v_task.queue_name, jsonb_build_object(
    'flow_slug', v_task.flow_slug,
    'run_id', v_task.run_id,
    'step_slug', v_task.step_slug,
    'task_index', v_task.task_index)) into v_msg_id;

  update pgflow.step_tasks t
  set status = 'queued', started_at = null, last_worker_id = null, message_id = v_msg_id,
      requeued_count = 0, permanently_stalled_at = null, last_requeued_at = now()
  where t.run_id = v_task.run_id and t.step_slug = v_task.step_slug and t.task_index = v_task.task_index
  returning t.* into v_task;

  return next v_task;
end;
$$;

create or replace function pgflow.prune_history(older_than interval, max_runs int default 1000)
returns jsonb
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_cutoff timestamptz := now() - older_than;
  v_run_ids uuid[];
  v_group record;
  v_queue text;
  v_n int;
  v_archived bigint := 0;
  v_workers int;
begin
  if older_than is null or older_than < interval '0' or coalesce(max_runs, 0) < 1 then
    raise exception 'prune_history(): older_than must be a non-negative interval and max_runs at least 1 (got %, %)',
      older_than, max_runs
      using errcode = 'invalid_parameter_value';
  end if;

  select array_agg(x.run_id) into v_run_ids
  from (
    select r.run_id
    from pgflow.runs r
    where r.status <> 'started' and coalesce(r.completed_at, r.failed_at) < v_cutoff
    order by coalesce(r.completed_at, r.failed_at)
    limit max_runs
    for update skip locked
  ) x;
  v_run_ids := coalesce(v_run_ids, '{}');

  for v_group in
    select t.queue_name, array_agg(t.message_id) as ids
    from pgflow.step_tasks t
    where t.run_id = any (v_run_ids) and t.message_id is not null
    group by t.queue_name
  loop
    if pgflow._queue_meta_name(v_group.queue_name) is not null then
      perform pgmq.delete(v_group.queue_name, v_group.ids);
      execute format('delete from pgmq.%I where msg_id = any ($1)',
                     pgmq.format_table_name(v_group.queue_name, 'a'))
      using v_group.ids;
    end if;
  end loop;

  delete from pgflow.run_watchers w where w.run_id = any (v_run_ids);
  delete from pgflow.step_tasks t where t.run_id = any (v_run_ids);
  delete from pgflow.step_states ss where ss.run_id = any (v_run_ids);
  delete from pgflow.runs r where r.run_id = any (v_run_ids);

  for v_queue in select distinct s.queue_name from pgflow.steps s order by 1 loop
    if pgflow._queue_meta_name(v_queue) is not null then
      execute format(
        'delete from pgmq.%1$I where msg_id in (
           select a.msg_id from pgmq.%1$I a where a.archived_at < $1 order by a.archived_at limit $2)',
        pgmq.format_table_name(v_queue, 'a'))
      using v_cutoff, max_runs * 10;
      get diagnostics v_n = row_count;
      v_archived := v_archived + v_n;
    end if;
  end loop;

  delete from pgflow.workers w
  where w.worker_id in (
    select o.worker_id from pgflow.workers o
    where coalesce(o.stopped_at, o.last_heartbeat_at) < v_cutoff
      -- Still named by a retained task: kept until that task goes, so a deletion never has to touch tasks.
      and not exists (select 1 from pgflow.step_tasks t where t.last_worker_id = o.worker_id)
    order by coalesce(o.stopped_at, o.last_heartbeat_at)
    limit max_runs
    for update skip locked);
  get diagnostics v_workers = row_count;

  return jsonb_build_object('runs', cardinality(v_run_ids), 'archived_messages', v_archived,
                            'workers', v_workers);
end;
$$;

create or replace function pgflow.run_maintenance(
  dead_after interval default null,
  retain_for interval default null,
  prune_batch int default 1000
)
returns jsonb
language plpgsql
volatile
security definer
set search_path = ''
as $$
declare
  v_stalled int;
  v_dead int;
  v_pruned jsonb;
begin
  if not pg_try_advisory_xact_lock(pgflow._maintenance_lock_key()) then
    return jsonb_build_object('skipped', true, 'stalled', 0, 'dead', 0, 'pruned', null);
  end if;
  -- Retention first, while this transaction holds nothing else: it is the one part that waits for the
  -- messages it deletes. Recovery after it takes every row SKIP LOCKED and waits for nothing.
  if retain_for is not null then
    v_pruned := pgflow.prune_history(retain_for, prune_batch);
  end if;
  v_stalled := pgflow.requeue_stalled_tasks();
  v_dead := case when dead_after is null then 0 else pgflow.requeue_dead_worker_tasks(dead_after) end;
  delete from pgflow.run_watchers w
  where not exists (select 1 from pg_catalog.pg_stat_activity a where a.pid = w.backend_pid);
  return jsonb_build_object('skipped', false, 'stalled', v_stalled, 'dead', v_dead, 'pruned', v_pruned);
end;
$$;
