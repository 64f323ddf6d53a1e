-- Maintenance: recovery of stalled tasks and dead workers' tasks, and retention.
--
-- Owns: requeueing tasks whose worker stopped answering (stall timeout or dead heartbeat), marking tasks that
-- stalled too often as permanently stalled, recording the attempts that end without being their task's last
-- state (_record_attempts, into pgflow.task_attempts), pruning finished history, and run_maintenance, which
-- workers call one at a time under the maintenance lock (try-only, never waited for).

-- Key of the advisory lock that lets one caller at a time run recovery and retention ("pgflow-rq").
create function pgflow._maintenance_lock_key()
returns bigint
language sql
immutable parallel safe
as $$ select 8099555070761726577::bigint $$;

-- Records the attempts that end now without being their tasks' last state (pgflow.task_attempts), just before
-- the caller resets the task rows for another attempt, while the rows still carry the attempt: one row per
-- named task whose row has a started attempt (started_at set; a task that never started, or whose attempt was
-- recorded already, is skipped). p_outcome is one of the table's outcomes; p_error the failure's error
-- ('failed'), while 'run_retried' keeps the error of a failed task's row. The attempt ended now, or at a
-- failed task's failed_at, or at p_ended_at (retry_run: when the run was cancelled or failed). The attempt was
-- queued at the latest of the task's queued_at, its last requeue and the end of its previous recorded attempt.
-- The caller holds the task rows.
create function pgflow._record_attempts(
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

-- The started tasks, found through started step states (idx_step_states_started), so the cost follows the
-- work in flight, never the task history. With the effective timeout and max_attempts of each task's step
-- (counted from the task's attempts_base, the attempts used before its last retry_run).
create function pgflow._started_tasks()
returns table(queue_name text, message_id bigint, run_id uuid, step_slug text, task_index integer, started_at timestamp with time zone, last_worker_id uuid, attempts_count integer, permanently_stalled_at timestamp with time zone, effective_timeout integer, max_attempts integer)
language sql
stable
set search_path = ''
as $$
  select t.queue_name, t.message_id, t.run_id, t.step_slug, t.task_index, t.started_at, t.last_worker_id,
         t.attempts_count, t.permanently_stalled_at,
         coalesce(s.opt_timeout, f.opt_timeout), coalesce(s.opt_max_attempts, f.opt_max_attempts) + t.attempts_base
  from pgflow.step_states ss
  join pgflow.runs r on r.run_id = ss.run_id and r.status = 'started'
  join pgflow.step_tasks t on t.run_id = ss.run_id and t.step_slug = ss.step_slug and t.status = 'started'
  join pgflow.steps s on s.flow_slug = ss.flow_slug and s.step_slug = ss.step_slug
  join pgflow.flows f on f.flow_slug = ss.flow_slug
  where ss.status = 'started';
$$;

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
    'task_index', v_task.task_index), pgflow._run_rank_headers(v_task.queue_name, v_task.run_id)) into v_msg_id;

  update pgflow.step_tasks t
  set status = 'queued', started_at = null, last_worker_id = null, message_id = v_msg_id,
      requeued_count = 0, permanently_stalled_at = null, last_requeued_at = now()
  where t.run_id = v_task.run_id and t.step_slug = v_task.step_slug and t.task_index = v_task.task_index
  returning t.* into v_task;

  return next v_task;
end;
$$;

create function pgflow.requeue_stalled_tasks()
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
    -- One lookup per message, in message order (FINDING A MESSAGE'S TASK in 07_claims.sql).
    from unnest(v_locked) as m(id)
    cross join lateral (
      select t.run_id, t.step_slug, t.task_index
      from pgflow.step_tasks t
      where t.queue_name = v_group.queue_name and t.message_id = m.id
        and t.status = 'started' and t.permanently_stalled_at is null
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
        -- One lookup per message, in message order (FINDING A MESSAGE'S TASK in 07_claims.sql).
        from unnest(array(select i from unnest(v_gone) as i order by i)) as m(id)
        cross join lateral (
          select t.run_id, t.step_slug, t.task_index, t.flow_slug, t.requeued_count
          from pgflow.step_tasks t
          where t.queue_name = v_group.queue_name and t.message_id = m.id
            and t.status = 'started' and t.permanently_stalled_at is null
          for update skip locked
        ) t
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
                'task_index', v_task.task_index), pgflow._run_rank_headers(v_group.queue_name, v_task.run_id)))
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

create function pgflow.requeue_dead_worker_tasks(dead_after interval)
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
    -- One lookup per message, in message order (FINDING A MESSAGE'S TASK in 07_claims.sql).
    from unnest(v_locked) as m(id)
    cross join lateral (
      select t.run_id, t.step_slug, t.task_index
      from pgflow.step_tasks t
      where t.queue_name = v_group.queue_name and t.message_id = m.id
        and t.status = 'started' and t.last_worker_id = any (v_dead)
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

-- Deletes all finished history older than the retention interval (upstream's maintenance query): calls
-- prune_history until nothing older is left. Prefer prune_history, or the workers' own retention, on a busy
-- database: this one runs in a single transaction however much there is.
create function pgflow.prune_data_older_than(retention_interval interval)
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_result jsonb;
begin
  loop
    v_result := pgflow.prune_history(retention_interval, 1000);
    exit when (v_result ->> 'runs')::int < 1000 and (v_result ->> 'archived_messages')::int < 10000
          and (v_result ->> 'workers')::int < 1000 and (v_result ->> 'events')::int < 10000;
  end loop;
end;
$$;

-- Deletes one batch of finished history older than `older_than`: up to `max_runs` finished runs (oldest
-- first; runs another transaction holds are skipped) with their tasks, attempt history, step states, watcher
-- rows and messages, then up to ten times as many archived messages, expired idempotency keys and events,
-- and up to `max_runs` worker rows that stopped before the cutoff. Returns the counts
-- {"runs", "archived_messages", "workers", "events"}: call it again while a count equals its bound.
--
-- With dry_run it changes and locks nothing and returns {"runs": n, "dry_run": true}: n is every finished run
-- older than the cutoff now, what calls until done would delete (max_runs bounds a real call only). The same
-- selection serves both.
create function pgflow.prune_history(older_than interval, max_runs int default 1000, dry_run boolean default false)
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
  -- A finished run's tasks hold no limit slot (each went when its task left 'started'); this only guards
  -- against a stray one.
  delete from pgflow.limit_slots ls where ls.run_id = any (v_run_ids);
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

create function pgflow.run_maintenance(
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

-- Schedules requeue_stalled_tasks() with pg_cron. Unlike upstream it is not run at install (pg_cron is
-- optional); it needs pg_cron only when called. Workers can instead call requeue_stalled_tasks() themselves.
create function pgflow.setup_requeue_stalled_tasks_cron(cron_interval text default '15 seconds'::text)
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
