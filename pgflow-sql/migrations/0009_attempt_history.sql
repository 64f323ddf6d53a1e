-- pgflow-rs SQL core: the history of earlier attempts, and counting before bulk work.
--
-- * pgflow.task_attempts: one row per attempt that ended without being its task's last state (a failure that
--   is retried, a requeue of a stalled task or of a dead worker's task, a release at a worker's shutdown, a
--   reset by retry_run), written by pgflow._record_attempts on those paths only; claims and completions do not
--   change. prune_history and delete_flow_and_data delete the rows of the runs they delete.
-- * prune_history and cancel_runs take a trailing `dry_run boolean default false`: the count of what calls
--   until done would affect, changing and locking nothing, from the same selection as the real call. The
--   earlier signatures are dropped (calls that leave dry_run out work as before); the client list names the
--   new cancel_runs.

create table pgflow.task_attempts (
  attempt_id bigint generated always as identity primary key,
  run_id uuid not null,
  step_slug text not null,
  task_index int not null,
  attempt int not null,
  queued_at timestamptz not null,
  started_at timestamptz,
  ended_at timestamptz not null,
  worker_id uuid,
  outcome text not null,
  error_message text,
  constraint valid_outcome check (outcome in ('failed', 'stalled', 'worker_lost', 'released', 'run_retried'))
);

create index idx_task_attempts_task on pgflow.task_attempts (run_id, step_slug, task_index);

-- The roles that may call cancel_runs now (pgflow.grant_client_privileges) keep it: noted before the drop,
-- granted the new signature at the end of this file.
create temporary table pgflow_0009_cancel_runs_grantees as
select r.rolname
from pg_catalog.pg_proc p
cross join lateral pg_catalog.aclexplode(p.proacl) a
join pg_catalog.pg_roles r on r.oid = a.grantee
where p.oid = 'pgflow.cancel_runs(text,text,timestamp with time zone,text[],jsonb,text,integer)'::regprocedure
  and a.privilege_type = 'EXECUTE' and a.grantee <> p.proowner;

drop function pgflow.prune_history(interval, integer);
drop function pgflow.cancel_runs(text, text, timestamp with time zone, text[], jsonb, text, integer);

-- ---- as in schema/11_maintenance.sql : pgflow._record_attempts ----
create or replace function pgflow._record_attempts(
  p_outcome text,
  p_run_ids uuid[],
  p_step_slugs text[],
  p_task_indexes int[],
  p_error text default null,
  p_ended_at timestamptz default null
)
returns void
language sql
volatile
set search_path = ''
as $$
  insert into pgflow.task_attempts (run_id, step_slug, task_index, attempt, queued_at, started_at, ended_at,
                                    worker_id, outcome, error_message)
  select t.run_id, t.step_slug, t.task_index, t.attempts_count,
         greatest(t.queued_at, t.last_requeued_at,
                  (select max(a.ended_at) from pgflow.task_attempts a
                   where a.run_id = t.run_id and a.step_slug = t.step_slug and a.task_index = t.task_index)),
         t.started_at, coalesce(t.failed_at, p_ended_at, now()), t.last_worker_id, p_outcome,
         case when p_outcome <> 'run_retried' then p_error when t.status = 'failed' then t.error_message end
  from unnest(p_run_ids, p_step_slugs, p_task_indexes) as i(run_id, step_slug, task_index)
  join pgflow.step_tasks t on t.run_id = i.run_id and t.step_slug = i.step_slug and t.task_index = i.task_index
  where t.started_at is not null
  order by t.run_id, t.step_slug, t.task_index
$$;
-- ---- end pgflow._record_attempts ----

-- ---- as in schema/08_completion.sql : pgflow._fail_task ----
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
-- ---- end pgflow._fail_task ----

-- ---- as in schema/11_maintenance.sql : pgflow.resolve_stalled_task ----
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

  perform pgflow._record_attempts('stalled', array[v_task.run_id], array[v_task.step_slug],
                                  array[v_task.task_index]);
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
-- ---- end pgflow.resolve_stalled_task ----

-- ---- as in schema/11_maintenance.sql : pgflow.requeue_stalled_tasks ----
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
  v_run_ids uuid[];
  v_step_slugs text[];
  v_task_indexes int[];
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
    select coalesce(array_agg(x.run_id), '{}'), coalesce(array_agg(x.step_slug), '{}'),
           coalesce(array_agg(x.task_index), '{}')
    into v_run_ids, v_step_slugs, v_task_indexes
    from (
      select t.run_id, t.step_slug, t.task_index
      from pgflow.step_tasks t
      where t.queue_name = v_group.queue_name and t.message_id = any (v_locked)
        and t.status = 'started' and t.permanently_stalled_at is null
      order by t.message_id
      for update skip locked
    ) x;
    -- The attempts of the tasks requeued below end here (those marked permanently stalled stay started).
    perform pgflow._record_attempts('stalled', array_agg(t.run_id), array_agg(t.step_slug),
                                    array_agg(t.task_index))
    from unnest(v_run_ids, v_step_slugs, v_task_indexes) as x(run_id, step_slug, task_index)
    join pgflow.step_tasks t on t.run_id = x.run_id and t.step_slug = x.step_slug and t.task_index = x.task_index
    where t.requeued_count < 3;
    with changed as (
      update pgflow.step_tasks t
      set status = case when t.requeued_count < 3 then 'queued' else t.status end,
          started_at = case when t.requeued_count < 3 then null else t.started_at end,
          last_worker_id = case when t.requeued_count < 3 then null else t.last_worker_id end,
          requeued_count = case when t.requeued_count < 3 then t.requeued_count + 1 else t.requeued_count end,
          last_requeued_at = case when t.requeued_count < 3 then now() else t.last_requeued_at end,
          permanently_stalled_at = case when t.requeued_count < 3 then null else now() end
      from unnest(v_run_ids, v_step_slugs, v_task_indexes) as x(run_id, step_slug, task_index)
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
          perform pgflow._record_attempts('stalled', array[v_task.run_id], array[v_task.step_slug],
                                          array[v_task.task_index]);
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
-- ---- end pgflow.requeue_stalled_tasks ----

-- ---- as in schema/11_maintenance.sql : pgflow.requeue_dead_worker_tasks ----
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
  v_run_ids uuid[];
  v_step_slugs text[];
  v_task_indexes int[];
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
    select coalesce(array_agg(x.run_id), '{}'), coalesce(array_agg(x.step_slug), '{}'),
           coalesce(array_agg(x.task_index), '{}')
    into v_run_ids, v_step_slugs, v_task_indexes
    from (
      select t.run_id, t.step_slug, t.task_index
      from pgflow.step_tasks t
      where t.queue_name = v_group.queue_name and t.message_id = any (v_locked)
        and t.status = 'started' and t.last_worker_id = any (v_dead)
      order by t.message_id
      for update skip locked
    ) x;
    perform pgflow._record_attempts('worker_lost', v_run_ids, v_step_slugs, v_task_indexes);
    with requeued as (
      update pgflow.step_tasks t
      set status = 'queued', started_at = null, last_worker_id = null,
          requeued_count = t.requeued_count + 1, last_requeued_at = now()
      from unnest(v_run_ids, v_step_slugs, v_task_indexes) as o(run_id, step_slug, task_index)
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
-- ---- end pgflow.requeue_dead_worker_tasks ----

-- ---- as in schema/10_workers.sql : pgflow.release_worker_tasks ----
create or replace function pgflow.release_worker_tasks(worker_id uuid)
returns integer
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_group record;
  v_locked bigint[];
  v_count int := 0;
  v_run_ids uuid[];
  v_step_slugs text[];
  v_task_indexes int[];
begin
  for v_group in
    select c.queue_name, array_agg(c.message_id order by c.message_id) as ids
    from pgflow._started_tasks() c
    where c.last_worker_id = release_worker_tasks.worker_id
      and c.permanently_stalled_at is null and c.message_id is not null
    group by c.queue_name
    order by c.queue_name
  loop
    v_locked := pgflow._lock_messages(v_group.queue_name, v_group.ids);
    select coalesce(array_agg(x.run_id), '{}'), coalesce(array_agg(x.step_slug), '{}'),
           coalesce(array_agg(x.task_index), '{}')
    into v_run_ids, v_step_slugs, v_task_indexes
    from (
      select t.run_id, t.step_slug, t.task_index
      from pgflow.step_tasks t
      where t.queue_name = v_group.queue_name and t.message_id = any (v_locked)
        and t.status = 'started' and t.last_worker_id = release_worker_tasks.worker_id
      order by t.message_id
      for update
    ) x;
    perform pgflow._record_attempts('released', v_run_ids, v_step_slugs, v_task_indexes);
    with released as (
      update pgflow.step_tasks t
      set status = 'queued',
          started_at = null,
          last_worker_id = null,
          attempts_count = greatest(t.attempts_count - 1, 0)
      from unnest(v_run_ids, v_step_slugs, v_task_indexes) as m(run_id, step_slug, task_index)
      where t.run_id = m.run_id and t.step_slug = m.step_slug and t.task_index = m.task_index
      returning t.message_id
    )
    select coalesce(array_agg(r.message_id), '{}') into v_locked from released r;
    if cardinality(v_locked) > 0 then
      perform pgmq.set_vt(v_group.queue_name, v_locked, 0);
      v_count := v_count + cardinality(v_locked);
    end if;
  end loop;
  return v_count;
end;
$$;
-- ---- end pgflow.release_worker_tasks ----

-- ---- as in schema/13_run_control.sql : pgflow.retry_run ----
create or replace function pgflow.retry_run(run_id uuid, retried_by text default NULL::text)
returns pgflow.runs
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_run pgflow.runs;
  v_steps text[];
  v_task_steps text[];
  v_task_indexes int[];
  v_errors jsonb;
begin
  -- Lock order 2: the run row.
  select r.* into v_run
  from pgflow.runs r
  where r.run_id = retry_run.run_id
  for no key update;
  if not found then
    raise exception 'retry_run(%): no such run', retry_run.run_id
      using errcode = 'PF031',
            hint = 'Check the run id; a finished run is removed by retention (prune_history) after its window.';
  end if;
  if v_run.status = 'started' then
    raise exception 'retry_run(%): run of flow % is still started; its tasks may still be running',
      retry_run.run_id, v_run.flow_slug
      using errcode = 'PF032',
            hint = 'Wait until it fails, or cancel it (cancel_run), then retry it.';
  elsif v_run.status = 'completed' then
    raise exception 'retry_run(%): run of flow % completed; there is nothing to retry', retry_run.run_id,
      v_run.flow_slug
      using errcode = 'PF032',
            hint = 'To run steps of a completed run again, replay it from a step (replay_run).';
  end if;

  select array_agg(ss.step_slug order by ss.step_slug) into v_steps
  from pgflow.step_states ss
  where ss.run_id = retry_run.run_id and ss.status not in ('completed', 'skipped');
  perform pgflow._assert_version_present('retry_run', retry_run.run_id, v_run.flow_slug, v_steps);

  -- History first, from the earlier try's task rows.
  select coalesce(jsonb_agg(jsonb_build_object('step_slug', t.step_slug, 'task_index', t.task_index,
                                               'attempts', t.attempts_count - t.attempts_base,
                                               'error_message', t.error_message)
                            order by t.step_slug, t.task_index), '[]')
  into v_errors
  from pgflow.step_tasks t
  where t.run_id = retry_run.run_id and t.status = 'failed';
  insert into pgflow.run_retries (run_id, retry_number, retried_by, previous_status, previous_failed_at,
                                  previous_cancelled_at, previous_cancel_reason, errors)
  values (retry_run.run_id, v_run.retry_count + 1, coalesce(retry_run.retried_by, pgflow._caller_role()),
          v_run.status, v_run.failed_at, v_run.cancelled_at, v_run.cancel_reason, v_errors);

  -- The run back to started: nothing of the steps below may start before it is.
  update pgflow.runs r
  set status = 'started', failed_at = null, cancelled_at = null, cancel_reason = null, output = null,
      retry_count = r.retry_count + 1,
      remaining_steps = coalesce(cardinality(v_steps), 0)
  where r.run_id = retry_run.run_id;

  -- Lock order 4: the tasks to run again (their messages were archived when they ended), in message order.
  -- Their last attempts go to the attempt history first (pgflow.task_attempts). Fresh attempts from the
  -- attempts used so far; a new message each, below.
  select coalesce(array_agg(a.step_slug), '{}'), coalesce(array_agg(a.task_index), '{}')
  into v_task_steps, v_task_indexes
  from (
    select t.step_slug, t.task_index
    from pgflow.step_tasks t
    where t.run_id = retry_run.run_id and t.step_slug = any (v_steps) and t.status <> 'completed'
    order by t.queue_name, t.message_id
    for update
  ) a;
  perform pgflow._record_attempts('run_retried', array_fill(retry_run.run_id, array[cardinality(v_task_steps)]),
                                  v_task_steps, v_task_indexes, null,
                                  coalesce(v_run.cancelled_at, v_run.failed_at));
  with reset as (
    update pgflow.step_tasks t
    set status = 'queued', attempts_base = t.attempts_count, error_message = null, output = null,
        started_at = null, failed_at = null, queued_at = greatest(now(), t.queued_at), permanently_stalled_at = null,
        requeued_count = 0, last_requeued_at = null
    from unnest(v_task_steps, v_task_indexes) as a(step_slug, task_index)
    where t.run_id = retry_run.run_id and t.step_slug = a.step_slug and t.task_index = a.task_index
    returning t.step_slug, t.task_index
  )
  select array_agg(r.step_slug order by r.step_slug, r.task_index),
         array_agg(r.task_index order by r.step_slug, r.task_index)
  into v_task_steps, v_task_indexes
  from reset r;

  -- Step states (lock order 5): a step with tasks is started again with the count of its unfinished tasks; a
  -- step without tasks goes back to created.
  update pgflow.step_states ss
  set status = case when x.n_tasks > 0 then 'started' else 'created' end,
      started_at = case when x.n_tasks > 0 then coalesce(ss.started_at, now()) end,
      remaining_tasks = case when x.n_tasks > 0 then x.n_open end,
      failed_at = null, error_message = null, output = null, completed_at = null
  from (
    select s.step_slug,
           (select count(*) from pgflow.step_tasks t
            where t.run_id = retry_run.run_id and t.step_slug = s.step_slug)::int as n_tasks,
           (select count(*) from pgflow.step_tasks t
            where t.run_id = retry_run.run_id and t.step_slug = s.step_slug and t.status <> 'completed')::int as n_open
    from unnest(v_steps) as s(step_slug)
  ) x
  where ss.run_id = retry_run.run_id and ss.step_slug = x.step_slug;

  if v_task_steps is not null then
    perform pgflow._resend_tasks(retry_run.run_id, v_task_steps, v_task_indexes);
  end if;

  perform pgflow._emit('run:retried', retry_run.run_id, jsonb_build_object(
    'event_type', 'run:retried',
    'run_id', retry_run.run_id,
    'flow_slug', v_run.flow_slug,
    'status', 'started',
    'retry_count', v_run.retry_count + 1,
    'previous_status', v_run.status
  ));

  -- Steps that became ready (a created step whose dependencies are done) start; a run with nothing left
  -- completes.
  perform pgflow._advance_runs(array[retry_run.run_id]);
  perform pgflow._complete_runs(array[retry_run.run_id]);

  select r.* into v_run from pgflow.runs r where r.run_id = retry_run.run_id;
  return v_run;
end;
$$;
-- ---- end pgflow.retry_run ----

-- ---- as in schema/11_maintenance.sql : pgflow.prune_history ----
create or replace function pgflow.prune_history(older_than interval, max_runs int default 1000, dry_run boolean default false)
returns jsonb
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_cutoff timestamptz := now() - older_than;
  v_runs constant text := 'select r.run_id from pgflow.runs r
    where r.status <> ''started'' and coalesce(r.completed_at, r.failed_at, r.cancelled_at) < $1';
  v_run_ids uuid[];
  v_group record;
  v_queue text;
  v_n int;
  v_archived bigint := 0;
  v_workers int;
begin
  if older_than is null or older_than < interval '0' or coalesce(max_runs, 0) < 1 or dry_run is null then
    raise exception 'prune_history(): older_than must be a non-negative interval, max_runs at least 1 and dry_run true or false (got %, %, %)',
      older_than, max_runs, dry_run
      using errcode = 'invalid_parameter_value';
  end if;

  if dry_run then
    execute 'select count(*) from (' || v_runs || ') x' into v_n using v_cutoff;
    return jsonb_build_object('runs', v_n, 'dry_run', true);
  end if;

  execute 'select array_agg(x.run_id) from (' || v_runs
          || ' order by coalesce(r.completed_at, r.failed_at, r.cancelled_at) limit $2 for update skip locked) x'
  into v_run_ids
  using v_cutoff, max_runs;
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
  delete from pgflow.task_attempts a where a.run_id = any (v_run_ids);
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

  -- Idempotency keys past their window (the keys of the runs deleted above went with them).
  delete from pgflow.idempotency_keys k
  where (k.flow_name, k.idempotency_key) in (
    select o.flow_name, o.idempotency_key from pgflow.idempotency_keys o
    where o.expires_at < now()
    order by o.expires_at
    limit max_runs * 10);

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

  -- The event log: oldest first, at most max_runs * 10 per call, like archived messages.
  delete from pgflow.events e
  where e.event_id in (
    select o.event_id from pgflow.events o where o.occurred_at < v_cutoff
    order by o.occurred_at limit max_runs * 10);
  get diagnostics v_n = row_count;

  return jsonb_build_object('runs', cardinality(v_run_ids), 'archived_messages', v_archived,
                            'workers', v_workers, 'events', v_n);
end;
$$;
-- ---- end pgflow.prune_history ----

-- ---- as in schema/13_run_control.sql : pgflow.cancel_runs ----
create or replace function pgflow.cancel_runs(
  flow_slug text default NULL::text,
  status text default 'started'::text,
  started_before timestamp with time zone default NULL::timestamp with time zone,
  input_path text[] default NULL::text[],
  input_value jsonb default NULL::jsonb,
  reason text default NULL::text,
  max_runs integer default 1000,
  dry_run boolean default false
)
returns integer
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_slug text;
  v_ids uuid[];
  v_id uuid;
  v_count int := 0;
  v_select constant text := 'select r.run_id from pgflow.runs r
    where r.status = ''started''
      and ($1 is null or r.flow_slug = $2 or lower(r.flow_slug) = lower($1))
      and ($3 is null or r.started_at < $3)
      and ($4 is null or r.input #> $4 = $5)';
begin
  if cancel_runs.dry_run is null then
    raise exception 'cancel_runs(): dry_run must be true or false, not NULL'
      using errcode = 'invalid_parameter_value';
  end if;
  if cancel_runs.status is not null and cancel_runs.status <> 'started' then
    raise exception 'cancel_runs(): only started runs can be cancelled (status filter %)', cancel_runs.status
      using errcode = 'invalid_parameter_value',
            hint = 'Pass status => ''started'' or NULL; completed, failed and cancelled runs are already finished.';
  end if;
  if (cancel_runs.input_path is null) <> (cancel_runs.input_value is null) then
    raise exception 'cancel_runs(): input_path and input_value go together (got path %, value %)',
      cancel_runs.input_path, cancel_runs.input_value
      using errcode = 'invalid_parameter_value',
            hint = 'Pass both, e.g. input_path => ''{customer,id}'', input_value => ''42''.';
  end if;
  if coalesce(cancel_runs.max_runs, 0) < 1 then
    raise exception 'cancel_runs(): max_runs must be at least 1 (got %)', cancel_runs.max_runs
      using errcode = 'invalid_parameter_value';
  end if;
  if cancel_runs.flow_slug is not null then
    v_slug := coalesce((select a.flow_slug from pgflow.flow_aliases a
                        where lower(a.alias) = lower(cancel_runs.flow_slug)), cancel_runs.flow_slug);
  end if;

  if cancel_runs.dry_run then
    execute 'select count(*) from (' || v_select || ') x'
    into v_count
    using cancel_runs.flow_slug, v_slug, cancel_runs.started_before, cancel_runs.input_path,
          cancel_runs.input_value;
    return v_count;
  end if;

  execute 'select array_agg(x.run_id order by x.run_id) from (' || v_select
          || ' order by r.run_id limit $6 for no key update skip locked) x'
  into v_ids
  using cancel_runs.flow_slug, v_slug, cancel_runs.started_before, cancel_runs.input_path,
        cancel_runs.input_value, cancel_runs.max_runs;

  foreach v_id in array coalesce(v_ids, '{}') loop
    if pgflow._cancel_run(v_id, cancel_runs.reason) then
      v_count := v_count + 1;
    end if;
  end loop;
  return v_count;
end;
$$;
-- ---- end pgflow.cancel_runs ----

-- ---- as in schema/05_definitions.sql : pgflow.delete_flow_and_data ----
create or replace function pgflow.delete_flow_and_data(p_flow_slug text)
returns void
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_queue text;
  v_meta_name text;
  v_ids bigint[];
begin
  -- The messages of the flow's tasks go with the tasks, on every queue (a queue that stays, shared or
  -- another flow's, would otherwise keep messages that no task records).
  for v_queue, v_ids in
    select t.queue_name, array_agg(t.message_id order by t.message_id)
    from pgflow.step_tasks t join pgflow.runs r on r.run_id = t.run_id
    where r.flow_slug = p_flow_slug and t.message_id is not null
    group by t.queue_name
    order by t.queue_name
  loop
    v_meta_name := pgflow._queue_meta_name(v_queue);
    if v_meta_name is not null then
      perform pgmq.delete(v_meta_name, v_ids);
    end if;
  end loop;

  for v_queue in
    select distinct q from (
      select s.queue_name as q from pgflow.steps s where s.flow_slug = p_flow_slug
      union all
      select t.queue_name from pgflow.step_tasks t join pgflow.runs r on r.run_id = t.run_id
      where r.flow_slug = p_flow_slug
      union all
      select lower(f.flow_slug) from pgflow.flows f where f.flow_slug = p_flow_slug and f.queue_mode = 'flow'
    ) x
    where not exists (select 1 from pgflow.steps o where o.queue_name = x.q and o.flow_slug <> p_flow_slug)
      and not exists (select 1 from pgflow.shared_queues sq where sq.queue_name = x.q)
  loop
    v_meta_name := pgflow._queue_meta_name(v_queue);
    if v_meta_name is null then
      raise notice 'pgmq queue `%` does not exist', v_queue;
    else
      perform pgmq.drop_queue(v_meta_name);
      perform pgflow._drop_queue_ops(v_queue);
    end if;
  end loop;

  delete from pgflow.task_attempts a using pgflow.runs r
    where r.flow_slug = p_flow_slug and a.run_id = r.run_id;
  delete from pgflow.step_tasks t using pgflow.runs r
    where r.flow_slug = p_flow_slug and t.run_id = r.run_id;
  delete from pgflow.step_states ss using pgflow.runs r
    where r.flow_slug = p_flow_slug and ss.run_id = r.run_id;
  delete from pgflow.runs r where r.flow_slug = p_flow_slug;
  delete from pgflow.flow_aliases a where a.flow_slug = p_flow_slug;
  delete from pgflow.deps d where d.flow_slug = p_flow_slug;
  delete from pgflow.steps s where s.flow_slug = p_flow_slug;
  delete from pgflow.flows f where f.flow_slug = p_flow_slug;
end;
$$;
-- ---- end pgflow.delete_flow_and_data ----

-- ---- as in schema/12_privileges.sql : pgflow._client_api ----
create or replace function pgflow._client_api()
returns text[]
language sql
immutable
as $$
  select array[
    'pgflow.start_flow(text,jsonb,uuid)',
    'pgflow.start_flows(text,jsonb[],uuid[])',
    'pgflow.start_flow_with_states(text,jsonb,uuid)',
    'pgflow.get_run_with_states(uuid)',
    'pgflow.run_channel(uuid)',
    'pgflow.resolve_flow_slug(text)',
    'pgflow.watch_run(uuid)',
    'pgflow.unwatch_run(uuid)',
    'pgflow.start_flows_with_keys(text,jsonb[],text[],uuid[],interval)',
    'pgflow.cancel_run(uuid,text)',
    'pgflow.cancel_runs(text,text,timestamp with time zone,text[],jsonb,text,integer,boolean)',
    'pgflow.retry_run(uuid,text)',
    'pgflow.replay_run(uuid,text)',
    'pgflow.queue_stats()'
  ]
$$;
-- ---- end pgflow._client_api ----

-- New functions are executable by PUBLIC until revoked (schema-level default privileges cannot take EXECUTE
-- away from PUBLIC).
revoke execute on function pgflow._record_attempts(text, uuid[], text[], int[], text, timestamptz) from public;
revoke execute on function pgflow.prune_history(interval, int, boolean) from public;
revoke execute on function pgflow.cancel_runs(text, text, timestamptz, text[], jsonb, text, int, boolean) from public;

do $$
declare
  v_role text;
begin
  for v_role in select g.rolname from pgflow_0009_cancel_runs_grantees g order by 1 loop
    execute format('grant execute on function pgflow.cancel_runs(text,text,timestamp with time zone,text[],jsonb,text,integer,boolean) to %I',
                   v_role);
  end loop;
end;
$$;
drop table pgflow_0009_cancel_runs_grantees;
