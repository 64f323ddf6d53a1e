-- pgflow-rs SQL core, migration 0008: recovery, pruning and worker bookkeeping.
--
-- Upstream interface: requeue_stalled_tasks, mark_worker_stopped (track_worker_function is in 0014),
-- setup_requeue_stalled_tasks_cron (needs pg_cron only when called), prune_data_older_than (upstream ships it
-- as copy-paste SQL). Addition: resolve_stalled_task (operator decision for a permanently stalled task).
-- Not provided (Supabase-only): ensure_workers, setup_ensure_workers_cron, cleanup_ensure_workers_logs.

-- Requeues started tasks whose worker went silent: a task is stalled once it has been started for longer than
-- its effective step timeout (coalesce(step, flow)) plus pgflow._stall_buffer_seconds(). Only tasks of started
-- runs and started steps are considered. Safe to call concurrently: rows another caller holds are skipped.
--   * fewer than 3 requeues so far: back to `queued`, message visible now, requeued_count + 1;
--   * otherwise: permanently_stalled_at is set and the message archived; the task stays `started` until an
--     operator decides with resolve_stalled_task().
-- Returns the number of tasks requeued.
create function pgflow.requeue_stalled_tasks()
returns int
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_requeued int := 0;
  v_group record;
begin
  for v_group in
    with stalled as (
      select t.run_id, t.step_slug, t.task_index
      from pgflow.step_tasks t
      join pgflow.runs r on r.run_id = t.run_id
      join pgflow.step_states ss on ss.run_id = t.run_id and ss.step_slug = t.step_slug
      join pgflow.steps s on s.flow_slug = t.flow_slug and s.step_slug = t.step_slug
      join pgflow.flows f on f.flow_slug = t.flow_slug
      where t.status = 'started'
        and t.permanently_stalled_at is null
        and r.status = 'started'
        and ss.status = 'started'
        and pgflow._recovery_boundary(t.started_at, coalesce(s.opt_timeout, f.opt_timeout)) < now()
      for update of t skip locked
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
      returning t.queue_name, t.message_id, t.status
    )
    select c.queue_name, c.status = 'queued' as requeue, array_agg(c.message_id) as ids
    from changed c
    where c.message_id is not null
    group by c.queue_name, c.status = 'queued'
  loop
    if v_group.requeue then
      perform pgmq.set_vt(v_group.queue_name, v_group.ids, 0);
      v_requeued := v_requeued + cardinality(v_group.ids);
    else
      perform pgmq.archive(v_group.queue_name, v_group.ids);
    end if;
  end loop;

  return v_requeued;
end;
$$;

-- The operator's decision for a permanently stalled task (requeued 3 times, still never finished):
--   * action 'retry': the task goes back to `queued` with a fresh message in its own queue and a new
--     requeue budget; its attempts_count is kept;
--   * action 'fail': the task fails as if it had exhausted its attempts (the step's when_exhausted applies:
--     fail the run, skip the step, or skip it with its dependents).
-- Returns the task row afterwards.
create function pgflow.resolve_stalled_task(
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
    return next pgflow._fail_task(v_task.run_id, v_task.step_slug, v_task.task_index, error_message, true);
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

-- Deletes finished history older than the retention interval:
--   * runs completed or failed before now() - retention_interval, with their step states and tasks, and the
--     tasks' messages (live ones deleted, archived ones removed from the archive), each in the task's queue;
--   * archived messages older than the cutoff in every queue used by a flow;
--   * workers whose last heartbeat is older than the cutoff.
-- Started runs and definitions are never touched.
create function pgflow.prune_data_older_than(retention_interval interval)
returns void
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_cutoff timestamptz := now() - retention_interval;
  v_run_ids uuid[];
  v_group record;
  v_queue text;
begin
  select array_agg(r.run_id) into v_run_ids
  from pgflow.runs r
  where (r.status = 'completed' and r.completed_at < v_cutoff)
     or (r.status = 'failed' and r.failed_at < v_cutoff);
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

  delete from pgflow.step_tasks t where t.run_id = any (v_run_ids);
  delete from pgflow.step_states ss where ss.run_id = any (v_run_ids);
  delete from pgflow.runs r where r.run_id = any (v_run_ids);

  for v_queue in select distinct s.queue_name from pgflow.steps s loop
    if pgflow._queue_meta_name(v_queue) is not null then
      execute format('delete from pgmq.%I where archived_at < $1', pgmq.format_table_name(v_queue, 'a'))
      using v_cutoff;
    end if;
  end loop;

  delete from pgflow.workers w where w.last_heartbeat_at < v_cutoff;
end;
$$;

-- Schedules requeue_stalled_tasks() with pg_cron. Unlike upstream it is not run at install (pg_cron is
-- optional); it needs pg_cron only when called. Workers can instead call requeue_stalled_tasks() themselves.
create function pgflow.setup_requeue_stalled_tasks_cron(cron_interval text default '15 seconds')
returns text
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_job_id bigint;
begin
  if to_regprocedure('cron.schedule(text,text,text)') is null then
    raise exception 'setup_requeue_stalled_tasks_cron(): pg_cron is not installed'
      using hint = 'Install pg_cron, or let workers call pgflow.requeue_stalled_tasks() periodically.';
  end if;
  begin
    execute 'select cron.unschedule($1)' using 'pgflow_requeue_stalled_tasks';
  exception when others then
    null;
  end;
  execute 'select cron.schedule($1, $2, $3)'
    into v_job_id
    using 'pgflow_requeue_stalled_tasks', cron_interval, 'select pgflow.requeue_stalled_tasks()';
  return format('Scheduled pgflow_requeue_stalled_tasks (every %s, job_id=%s)', cron_interval, v_job_id);
end;
$$;
