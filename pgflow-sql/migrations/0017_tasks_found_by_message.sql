-- pgflow-rs SQL core: every statement that goes from messages to their tasks looks each one up by its key.
-- - The claim (_claim_tasks, behind claim_tasks, read_and_claim_tasks and exchange), upstream's start_tasks,
--   flow control (_apply_limits, _park_key_backlog), the log of deferred reads, release_worker_tasks and the
--   two requeues found a batch's tasks with `queue_name = q and message_id = any (ids)`. A generic plan made
--   on small tables, or on tables without statistics, scanned the queue's tasks by name alone and filtered
--   them by id: on a new installation one claim of one message read all 2,000 tasks of its queue, and the
--   cost grew with the queue's history until the next analysis. Each task is now found by a lookup per
--   message on (queue_name, message_id), with the row lock inside it and the ids sorted, so the locks are
--   still taken in message order (07_claims.sql, FINDING A MESSAGE'S TASK).

-- ---- as in schema/07_claims.sql : pgflow._claim_tasks ----
create or replace function pgflow._claim_tasks(queue_name text, msg_ids bigint[], worker_id uuid, flow_slugs text[], step_slugs text[], read_vt integer)
returns table(outcome text, msg_id bigint, flow_slug text, run_id uuid, step_slug text, task_index integer, input jsonb, flow_input jsonb, attempts_count integer, timeout integer, report jsonb)
language plpgsql
set search_path = ''
as $$
declare
  v_queue text := lower(_claim_tasks.queue_name);
  v_ids bigint[];
  v_table text;
  v_claim_ids bigint[];
  v_defer_ids bigint[];
  v_defer_vts timestamptz[];
  v_archive_ids bigint[];
  v_wait_ids bigint[];
  v_unsupported_ids bigint[];
  v_run_ids uuid[];
  v_step_slugs text[];
  v_task_indexes int[];
  v_secs float8[];
  v_updated int;
  v_disabled jsonb;
  v_report jsonb;
  v_vis_ids bigint[];
  v_vis_vts timestamptz[];
  v_hold_ids bigint[];
  v_hold_vts timestamptz[];
  -- After a locking read, every message is counted as read once, as pgmq.read would have.
  v_read int := case when _claim_tasks.read_vt is null then 0 else 1 end;
begin
  if cardinality(_claim_tasks.flow_slugs) is distinct from cardinality(_claim_tasks.step_slugs) then
    raise exception 'claim_tasks(): flow_slugs and step_slugs differ in length (% and %)',
      cardinality(_claim_tasks.flow_slugs), cardinality(_claim_tasks.step_slugs)
      using errcode = 'invalid_parameter_value';
  end if;
  select coalesce(array_agg(distinct i order by i), '{}') into v_ids
  from unnest(_claim_tasks.msg_ids) as i where i is not null;
  if cardinality(v_ids) = 0 then
    return;
  end if;
  v_table := pgmq.format_table_name(v_queue, 'q');

  -- Lock order step 3: the batch's messages, unless this transaction's locking read holds them already.
  if _claim_tasks.read_vt is null then
    perform pgflow._lock_messages(v_queue, v_ids);
  end if;

  -- The fence: a worker of a disabled function claims nothing.
  select jsonb_build_object('function_name', wf.function_name, 'reason', wf.disabled_reason,
                            'disabled_at', wf.disabled_at)
  into v_disabled
  from pgflow.workers w
  join pgflow.worker_functions wf on wf.function_name = w.function_name
  where w.worker_id = _claim_tasks.worker_id and not wf.enabled;

  -- Lock order step 4: every task of the batch, in message order (v_ids is sorted), classified in the same
  -- statement. Each task is found by its message's key (FINDING A MESSAGE'S TASK, above).
  with pairs as (
    select p.flow_slug, p.step_slug
    from unnest(_claim_tasks.flow_slugs, _claim_tasks.step_slugs) as p(flow_slug, step_slug)
  ),
  locked as (
    select t.message_id as id,
           t.run_id, t.step_slug, t.task_index, t.started_at,
           coalesce(s.opt_timeout, f.opt_timeout) as timeout,
           case
             when not exists (select 1 from pairs p where p.flow_slug = t.flow_slug and p.step_slug = t.step_slug)
               then 'unsupported'
             when t.status = 'queued' and r.status = 'started' and ss.status = 'started' then 'claim'
             when t.status = 'queued' then 'wait'
             when t.status = 'started' then 'defer'
             else 'archive'
           end as kind
    from unnest(v_ids) as m(id)
    cross join lateral (
      select t.* from pgflow.step_tasks t where t.queue_name = v_queue and t.message_id = m.id for update
    ) t
    join pgflow.runs r on r.run_id = t.run_id
    join pgflow.step_states ss on ss.run_id = t.run_id and ss.step_slug = t.step_slug
    join pgflow.steps s on s.flow_slug = t.flow_slug and s.step_slug = t.step_slug
    join pgflow.flows f on f.flow_slug = t.flow_slug
  ),
  classified as (
    select m.id, l.run_id, l.step_slug, l.task_index, l.started_at, l.timeout,
           coalesce(l.kind, 'unsupported') as kind
    from unnest(v_ids) as m(id)
    left join locked l on l.id = m.id
  )
  select array_agg(c.id order by c.id) filter (where c.kind = 'claim'),
         array_agg(c.run_id order by c.id) filter (where c.kind = 'claim'),
         array_agg(c.step_slug order by c.id) filter (where c.kind = 'claim'),
         array_agg(c.task_index order by c.id) filter (where c.kind = 'claim'),
         array_agg(c.timeout::float8 + pgflow._claim_visibility_buffer_seconds() order by c.id)
           filter (where c.kind = 'claim'),
         array_agg(c.id order by c.id) filter (where c.kind = 'defer'),
         array_agg(greatest(pgflow._recovery_boundary(c.started_at, c.timeout),
                            clock_timestamp() + make_interval(secs => pgflow._claim_visibility_buffer_seconds()))
                   order by c.id) filter (where c.kind = 'defer'),
         array_agg(c.id order by c.id) filter (where c.kind = 'archive'),
         array_agg(c.id order by c.id) filter (where c.kind = 'wait'),
         array_agg(c.id order by c.id) filter (where c.kind = 'unsupported')
  into v_claim_ids, v_run_ids, v_step_slugs, v_task_indexes, v_secs,
       v_defer_ids, v_defer_vts, v_archive_ids, v_wait_ids, v_unsupported_ids
  from classified c;

  if v_unsupported_ids is not null or v_disabled is not null then
    -- No mutation except making the whole batch visible again.
    perform pgflow._queue_op(v_queue, 'visibility', v_ids,
                             array(select clock_timestamp() from unnest(v_ids)), v_read);

    if v_disabled is not null then
      return query select 'disabled'::text, null::bigint, null::text, null::uuid, null::text, null::int,
                          null::jsonb, null::jsonb, null::int, null::int, v_disabled;
      return;
    end if;

    execute format($q$
      with msgs as (
        select u.id,
               t.flow_slug as t_flow, t.step_slug as t_step,
               q.message ->> 'flow_slug' as b_flow, q.message ->> 'step_slug' as b_step,
               q.message ->> 'run_id' as b_run, q.message ->> 'task_index' as b_index
        from unnest($1::bigint[]) as u(id)
        left join pgflow.step_tasks t on t.queue_name = $2 and t.message_id = u.id
        left join pgmq.%I q on q.msg_id = u.id
      ),
      reasons as (
        select m.id, coalesce(m.t_flow, m.b_flow) as flow_slug, coalesce(m.t_step, m.b_step) as step_slug,
               case
                 when m.t_flow is not null then 'unsupported_route'
                 when m.b_run ~ '^[0-9a-fA-F-]{36}$' and m.b_index ~ '^[0-9]+$' and exists (
                        select 1 from pgflow.step_tasks o
                        where o.run_id = m.b_run::uuid and o.step_slug = m.b_step
                          and o.task_index = m.b_index::int and o.queue_name <> $2) then 'wrong_queue'
                 else 'no_task'
               end as reason
        from msgs m
      )
      select jsonb_build_object(
        'queue_name', $2,
        'msg_ids', to_jsonb($3::bigint[]),
        'unsupported_msg_ids', to_jsonb($1::bigint[]),
        'flows', coalesce((select jsonb_agg(distinct r.flow_slug) from reasons r where r.flow_slug is not null), '[]'),
        'steps', coalesce((select jsonb_agg(distinct r.step_slug) from reasons r where r.step_slug is not null), '[]'),
        'messages', (select jsonb_agg(jsonb_build_object('msg_id', r.id, 'reason', r.reason,
                                      'flow_slug', r.flow_slug, 'step_slug', r.step_slug) order by r.id)
                     from reasons r),
        'supported', coalesce((select jsonb_agg(jsonb_build_array(p.flow_slug, p.step_slug))
                               from unnest($4::text[], $5::text[]) as p(flow_slug, step_slug)), '[]'))
    $q$, v_table)
    into v_report
    using v_unsupported_ids, v_queue, v_ids, _claim_tasks.flow_slugs, _claim_tasks.step_slugs;
    perform pgflow._log_event('unsupported_stop', 'claim', worker_id => _claim_tasks.worker_id,
                              queue_name => v_queue, detail => v_report);

    return query select 'unsupported'::text, null::bigint, null::text, null::uuid, null::text, null::int,
                        null::jsonb, null::jsonb, null::int, null::int, v_report;
    return;
  end if;

  -- Flow control (16_flow_control.sql), only on a queue with a limit: tasks over a concurrency or rate limit
  -- are held (not claimed, no attempt spent, reported 'waiting'), their messages hidden until a slot frees
  -- or a token comes; the others are admitted with a slot. Lock order step 6: the limit rows, last.
  if v_claim_ids is not null and pgflow._queue_limited(v_queue) then
    select array_agg(h.msg_id order by h.msg_id), array_agg(h.hide_until order by h.msg_id)
    into v_hold_ids, v_hold_vts
    from pgflow._apply_limits(v_queue, v_claim_ids) h;
    if v_hold_ids is not null then
      select array_agg(c.id order by c.id), array_agg(c.run_id order by c.id), array_agg(c.step_slug order by c.id),
             array_agg(c.task_index order by c.id), array_agg(c.secs order by c.id)
      into v_claim_ids, v_run_ids, v_step_slugs, v_task_indexes, v_secs
      from unnest(v_claim_ids, v_run_ids, v_step_slugs, v_task_indexes, v_secs)
             as c(id, run_id, step_slug, task_index, secs)
      where c.id <> all (v_hold_ids);
      v_wait_ids := coalesce(v_wait_ids, '{}') || v_hold_ids;
    end if;
  end if;

  -- Fully supported batch: claim, defer, archive.
  if v_claim_ids is not null then
    update pgflow.step_tasks t
    set status = 'started',
        attempts_count = t.attempts_count + 1,
        -- A claim whose transaction began before the task was queued still starts it no earlier
        -- than it was queued (started_at_is_after_queued_at).
        started_at = greatest(now(), t.queued_at),
        last_worker_id = _claim_tasks.worker_id
    from unnest(v_run_ids, v_step_slugs, v_task_indexes) as c(run_id, step_slug, task_index)
    where t.run_id = c.run_id and t.step_slug = c.step_slug and t.task_index = c.task_index
      and t.status = 'queued';
  end if;

  -- Each message's visibility, in one update: claimed ones for the step timeout plus the claim buffer,
  -- deferred ones until their recovery boundary; after a locking read, the others from now for read_vt
  -- seconds, as pgmq.read leaves them (archived ones are archived next).
  if v_claim_ids is not null or v_defer_ids is not null or v_hold_ids is not null
     or _claim_tasks.read_vt is not null then
    select array_agg(v.id), array_agg(v.vt) into v_vis_ids, v_vis_vts
    from (
      select c.id, clock_timestamp() + make_interval(secs => c.secs) as vt
      from unnest(v_claim_ids, v_secs) as c(id, secs)
      union all
      select d.id, d.vt from unnest(v_defer_ids, v_defer_vts) as d(id, vt)
      union all
      -- Held by a limit: hidden until the time flow control chose.
      select h.id, h.vt from unnest(v_hold_ids, v_hold_vts) as h(id, vt)
      union all
      select o.id, clock_timestamp() + make_interval(secs => _claim_tasks.read_vt)
      from unnest(coalesce(v_wait_ids, '{}') || coalesce(v_archive_ids, '{}')) as o(id)
      where _claim_tasks.read_vt is not null and o.id <> all (coalesce(v_hold_ids, '{}'))
    ) v;
    select count(*) into v_updated
    from unnest(pgflow._queue_op(v_queue, 'visibility', v_vis_ids, v_vis_vts, v_read)) as u(id)
    where u.id = any (v_claim_ids);
    if v_updated <> coalesce(cardinality(v_claim_ids), 0) then
      raise exception 'claim_tasks(): visibility updated % of % claimed messages', v_updated, cardinality(v_claim_ids)
        using detail = format('queue %s, messages %s', v_queue, v_claim_ids::text),
              hint = 'A claimed message is missing from its queue; no task was claimed.';
    end if;
  end if;

  if v_archive_ids is not null then
    perform pgflow._queue_op(v_queue, 'archive', v_archive_ids);
  end if;
  if v_defer_ids is not null then
    perform pgflow._log_deferred_reads(v_queue, v_defer_ids, _claim_tasks.worker_id);
  end if;

  if v_claim_ids is not null then
    return query
    select 'claimed'::text, c.msg_id, t.flow_slug, t.run_id, t.step_slug, t.task_index, i.input, i.flow_input,
           t.attempts_count, coalesce(s.opt_timeout, f.opt_timeout), r.trace_context
    from unnest(v_run_ids, v_step_slugs, v_task_indexes, v_claim_ids)
           with ordinality as c(run_id, step_slug, task_index, msg_id, ord)
    join pgflow.step_tasks t on t.run_id = c.run_id and t.step_slug = c.step_slug and t.task_index = c.task_index
    join pgflow.steps s on s.flow_slug = t.flow_slug and s.step_slug = t.step_slug
    join pgflow.flows f on f.flow_slug = t.flow_slug
    join pgflow.runs r on r.run_id = t.run_id
    cross join lateral pgflow._task_inputs(t.run_id, t.flow_slug, t.step_slug, s.step_type, s.deps_count,
                                           t.element, r.input) i
    order by c.ord;
  end if;
  return query
  select x.kind, x.id, null::text, null::uuid, null::text, null::int, null::jsonb, null::jsonb, null::int,
         null::int, null::jsonb
  from (
    select 'deferred'::text as kind, d.id from unnest(v_defer_ids) as d(id)
    union all
    select 'archived', a.id from unnest(v_archive_ids) as a(id)
    union all
    select 'waiting', w.id from unnest(v_wait_ids) as w(id)
  ) x
  order by x.id;
end;
$$;
-- ---- end pgflow._claim_tasks ----

-- ---- as in schema/07_claims.sql : pgflow.start_tasks ----
create or replace function pgflow.start_tasks(flow_slug text, msg_ids bigint[], worker_id uuid, queue_name text)
returns setof pgflow.step_task_record
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
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

  -- Each task found by its message's key, locked in message order (FINDING A MESSAGE'S TASK, above).
  with candidates as (
    select t.run_id, t.step_slug, t.task_index
    from unnest(array(select distinct i from unnest(start_tasks.msg_ids) as i where i is not null order by i))
           as m(id)
    cross join lateral (
      select t.* from pgflow.step_tasks t
      where t.queue_name = v_queue and t.message_id = m.id
        and (start_tasks.flow_slug is null or t.flow_slug = start_tasks.flow_slug)
        and t.status = 'queued'
      for update
    ) t
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
  cross join lateral (
    select t.* from pgflow.step_tasks t where t.queue_name = v_queue and t.message_id = c.msg_id offset 0
  ) t
  join pgflow.steps s on s.flow_slug = t.flow_slug and s.step_slug = t.step_slug
  join pgflow.runs r on r.run_id = t.run_id
  cross join lateral pgflow._task_inputs(t.run_id, t.flow_slug, t.step_slug, s.step_type, s.deps_count,
                                         t.element, r.input) i
  order by c.ord;
end;
$$;
-- ---- end pgflow.start_tasks ----

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
    -- One lookup per message, in message order (FINDING A MESSAGE'S TASK in 07_claims.sql).
    from unnest(v_locked) as m(id)
    cross join lateral (
      select t.run_id, t.step_slug, t.task_index
      from pgflow.step_tasks t
      where t.queue_name = v_group.queue_name and t.message_id = m.id
        and t.status = 'started' and t.last_worker_id = release_worker_tasks.worker_id
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
-- ---- end pgflow.requeue_dead_worker_tasks ----

-- ---- as in schema/14_observability.sql : pgflow._log_deferred_reads ----
create or replace function pgflow._log_deferred_reads(p_queue text, p_ids bigint[], p_worker_id uuid)
returns void
language sql
volatile
set search_path = ''
as $$
  insert into pgflow.events (kind, cause, actor, run_id, flow_slug, step_slug, task_index, worker_id, queue_name,
                             detail)
  select 'deferred_read', 'duplicate_visibility', p_worker_id::text, t.run_id, t.flow_slug, t.step_slug,
         t.task_index, p_worker_id, p_queue,
         jsonb_build_object('msg_id', t.message_id, 'attempt', t.attempts_count,
                            'running_worker_id', t.last_worker_id)
  -- One lookup per message (FINDING A MESSAGE'S TASK in 07_claims.sql).
  from unnest(p_ids) as m(id)
  cross join lateral (
    select t.* from pgflow.step_tasks t where t.queue_name = p_queue and t.message_id = m.id offset 0
  ) t
$$;
-- ---- end pgflow._log_deferred_reads ----

-- ---- as in schema/16_flow_control.sql : pgflow._apply_limits ----
create or replace function pgflow._apply_limits(p_queue text, p_ids bigint[])
returns table(msg_id bigint, hide_until timestamptz)
language plpgsql
set search_path = ''
as $$
declare
  v_limit pgflow.queue_limits;
  v_free bigint;
  v_tokens double precision;
  v_now timestamptz := clock_timestamp();
  v_ids bigint[];
  v_runs uuid[];
  v_flows text[];
  v_steps text[];
  v_indexes integer[];
  v_keys text[];
  v_busy boolean[];
  v_slot_keys text[];
  v_key_tokens double precision[];
  v_admitted boolean[];
  v_hide timestamptz[];
  v_full_keys text[];
  v_keyed boolean;
begin
  -- Lock order step 6: the queue's limit row (FOR UPDATE: the claims of a queue with a queue limit take turns),
  -- then the key limits of the queue's steps in (flow, step) order (all of them, which is at most a few rows),
  -- FOR SHARE: claims do not wait for each other there, set_key_limit and clear_key_limit wait for them.
  select * into v_limit from pgflow.queue_limits l where l.queue_name = p_queue for update;
  perform 1 from pgflow.key_limits k
  join pgflow.steps s on s.flow_slug = k.flow_slug and s.step_slug = k.step_slug
  where s.queue_name = p_queue
  order by k.flow_slug, k.step_slug
  for share of k;
  v_keyed := found;

  -- The batch in message order, with each task's key under a key limit, and the end of step 6: a try-lock per
  -- key (advisory key space 4, held to commit, never waited for). A key another claim holds is BUSY: its tasks
  -- are held for _busy_key_seconds(), neither counted nor parked; the keys this claim holds are counted in the
  -- statements below, which see every claim of the key that committed before the lock was taken.
  select array_agg(c.id order by c.id), array_agg(c.run_id order by c.id), array_agg(c.flow_slug order by c.id),
         array_agg(c.step_slug order by c.id), array_agg(c.task_index order by c.id),
         array_agg(c.limit_key order by c.id),
         array_agg(case when c.limit_key is null then false
                        else not pg_try_advisory_xact_lock(4, hashtext(c.limit_key)) end order by c.id)
  into v_ids, v_runs, v_flows, v_steps, v_indexes, v_keys, v_busy
  from (
    select t.message_id as id, t.run_id, t.flow_slug, t.step_slug, t.task_index,
           -- The run's input is looked up only for a task under a key limit (a subplan of this branch).
           case when k.flow_slug is not null
                then pgflow._limit_key(t.flow_slug, t.step_slug,
                                       (select r.input #>> k.key_path from pgflow.runs r where r.run_id = t.run_id))
           end as limit_key
    -- One lookup per message (FINDING A MESSAGE'S TASK in 07_claims.sql).
    from unnest(p_ids) as m(id)
    cross join lateral (
      select t.* from pgflow.step_tasks t where t.queue_name = p_queue and t.message_id = m.id offset 0
    ) t
    left join pgflow.key_limits k on k.flow_slug = t.flow_slug and k.step_slug = t.step_slug
  ) c;
  if v_ids is null then
    return;
  end if;

  if v_limit.max_started is not null then
    select v_limit.max_started - count(*) into v_free from pgflow.limit_slots s where s.queue_name = p_queue;
  end if;
  if v_limit.rate_limit is not null then
    v_tokens := least(v_limit.rate_limit::float8,
                      coalesce(v_limit.tokens, v_limit.rate_limit)
                      + v_limit.rate_limit * extract(epoch from v_now - coalesce(v_limit.refilled_at, v_now))
                        / extract(epoch from v_limit.rate_period));
    v_free := least(coalesce(v_free, floor(v_tokens)::bigint), floor(v_tokens)::bigint);
  end if;

  if not v_keyed and (v_free is null or v_free >= cardinality(v_ids)) then
    -- No key limit on the queue, and its free slots and tokens cover the whole batch: every task is admitted
    -- without the admission query.
    v_admitted := array_fill(true, array[cardinality(v_ids)]);
  else
    select array_agg(a.slot_key order by a.msg_id), array_agg(a.key_tokens order by a.msg_id),
           array_agg(a.admitted order by a.msg_id), array_agg(a.hide_until order by a.msg_id)
    into v_slot_keys, v_key_tokens, v_admitted, v_hide
    from pgflow._limit_admission(v_ids, v_flows, v_steps, v_keys, v_busy, v_limit, v_free, v_tokens, v_now) a;
  end if;

  insert into pgflow.limit_slots (run_id, step_slug, task_index, queue_name, limit_key)
  select a.run_id, a.step_slug, a.task_index, p_queue, a.slot_key
  from unnest(v_runs, v_steps, v_indexes, v_slot_keys, v_admitted) as a(run_id, step_slug, task_index, slot_key, admitted)
  where a.admitted and (v_limit.max_started is not null or a.slot_key is not null)
  on conflict do nothing;

  delete from pgflow.parked_messages pm
  where pm.queue_name = p_queue
    and pm.msg_id in (select a.id from unnest(v_ids, v_admitted) as a(id, admitted) where a.admitted);

  if v_limit.rate_limit is not null then
    update pgflow.queue_limits l
    set tokens = v_tokens - (select count(*) from unnest(v_admitted) as a(admitted) where a.admitted),
        refilled_at = v_now
    where l.queue_name = p_queue;
  end if;
  if v_keyed then
    perform pgflow._spend_key_tokens(v_flows, v_steps, v_keys, v_key_tokens, v_admitted, v_now);
  end if;

  if array_position(v_admitted, false) is null then
    return;
  end if;

  -- Held ones: parked until a slot frees or their token comes (not those of a busy key).
  insert into pgflow.parked_messages as pm (queue_name, msg_id, limit_key)
  select p_queue, a.id, a.limit_key
  from unnest(v_ids, v_keys, v_admitted, v_busy) as a(id, limit_key, admitted, busy)
  where not a.admitted and not a.busy
  on conflict on constraint parked_messages_pkey do update set parked_at = excluded.parked_at;

  -- A key whose slots are all taken: the rest of its visible backlog is parked now as well, so that the next
  -- reads reach the other keys' tasks at once instead of meeting this key's tasks batch by batch.
  select array_agg(distinct a.slot_key) into v_full_keys
  from unnest(v_flows, v_steps, v_slot_keys, v_admitted) as a(flow_slug, step_slug, slot_key, admitted)
  join pgflow.key_limits k on k.flow_slug = a.flow_slug and k.step_slug = a.step_slug
  where not a.admitted and a.slot_key is not null
    and (select count(*) from pgflow.limit_slots s where s.limit_key = a.slot_key) >= k.max_per_key;
  if v_full_keys is not null then
    perform pgflow._park_key_backlog(p_queue, v_full_keys, v_ids,
                                     v_now + make_interval(secs => pgflow._park_seconds()));
  end if;

  return query
  select a.id, a.hide from unnest(v_ids, v_admitted, v_hide) as a(id, admitted, hide) where not a.admitted order by a.id;
end;
$$;
-- ---- end pgflow._apply_limits ----

-- ---- as in schema/16_flow_control.sql : pgflow._park_key_backlog ----
create or replace function pgflow._park_key_backlog(p_queue text, p_keys text[], p_batch bigint[], p_until timestamptz)
returns void
language plpgsql
set search_path = ''
set jit = off
as $$
declare
  v_table text := pgmq.format_table_name(p_queue, 'q');
  v_now timestamptz := clock_timestamp();
  v_ids bigint[];
  v_keys text[];
begin
  -- Visible as of v_now, a parameter, so that the queue's vt index finds them. No JIT: under the claims'
  -- enable_seqscan = off its cost estimate can pass jit_above_cost, and compiling took 400 ms a call.
  execute format($q$
    with visible as (
      select q.msg_id from pgmq.%1$I q
      where q.vt <= $4 and q.msg_id <> all ($2)
      limit pgflow._park_scan_limit()
    ),
    keyed as (
      select v.msg_id, pgflow._limit_key(t.flow_slug, t.step_slug, r.input #>> k.key_path) as limit_key
      from visible v
      -- One lookup per message (FINDING A MESSAGE'S TASK in 07_claims.sql).
      cross join lateral (
        select t.* from pgflow.step_tasks t
        where t.queue_name = $1 and t.message_id = v.msg_id and t.status = 'queued'
        offset 0
      ) t
      join pgflow.key_limits k on k.flow_slug = t.flow_slug and k.step_slug = t.step_slug
      join pgflow.runs r on r.run_id = t.run_id
    ),
    locked as (
      select q.msg_id from pgmq.%1$I q
      where q.msg_id in (select kd.msg_id from keyed kd where kd.limit_key = any ($3))
        and q.vt <= $4
      for update skip locked
    )
    select array_agg(kd.msg_id order by kd.msg_id), array_agg(kd.limit_key order by kd.msg_id)
    from keyed kd
    join locked l on l.msg_id = kd.msg_id
  $q$, v_table)
  into v_ids, v_keys
  using p_queue, p_batch, p_keys, v_now;
  if v_ids is null then
    return;
  end if;
  perform pgflow._queue_op(p_queue, 'visibility', v_ids, array_fill(p_until, array[cardinality(v_ids)]), 0);
  insert into pgflow.parked_messages as pm (queue_name, msg_id, limit_key)
  select p_queue, a.id, a.limit_key
  from unnest(v_ids, v_keys) with ordinality as a(id, limit_key, ord)
  order by a.ord
  on conflict on constraint parked_messages_pkey do update set parked_at = excluded.parked_at;
end;
$$;
-- ---- end pgflow._park_key_backlog ----
