-- pgflow-rs SQL core: an exchange creates the dependents its own worker would claim already claimed.
-- - pgflow.exchange recorded its outputs, which created the dependents' tasks and sent their messages, and
--   then read those messages back from its own queue, locked and classified their tasks, updated them to
--   `started` and updated their messages' visibility. Now the exchange leaves its claim (queue, worker, free
--   slots, pairs) in a transaction-local setting, and _create_step_tasks creates the tasks it would claim as
--   `started` for that worker, with their messages sent already read and hidden for the claim's visibility
--   (06_runs.sql, CLAIMED AT CREATION). The queue's order, the worker's pairs and the disabled-function fence
--   are kept; queues with flow control or priorities, and steps with a start delay, are claimed as before.
--   The read that follows claims the rest of the worker's free slots.
-- - The queues' statements functions gain `peek_visible` and a `send` with a vt per message and a read count.
--   The installed ones are dropped here and created again in the new form on first use.
-- - The claimed rows' query is one function, pgflow._claimed_rows, for _claim_tasks, exchange and upstream's
--   start_tasks; the disabled-function fence is one, pgflow._worker_disabled, for _claim_tasks and exchange.

do $$
declare
  v_fn regprocedure;
begin
  for v_fn in
    select p.oid::regprocedure from pg_proc p join pg_namespace n on n.oid = p.pronamespace
    where n.nspname = 'pgflow' and p.proname like '\_queue\_ops\_%'
      and pg_get_function_identity_arguments(p.oid)
          = 'p_op text, p_ids bigint[], p_vts timestamp with time zone[], p_n integer, p_msgs jsonb[], p_headers jsonb[]'
  loop
    execute format('drop function %s', v_fn);
  end loop;
end;
$$;

-- ---- as in schema/04_queue_names.sql : pgflow._create_queue_ops ----
create or replace function pgflow._create_queue_ops(p_queue text)
returns void
language plpgsql
set search_path = ''
as $$
begin
  if to_regproc(pgflow._queue_ops_name(p_queue)) is not null then
    return;
  end if;
  execute format($f$
    create function %1$s(p_op text, p_ids bigint[], p_vts timestamptz[], p_n int, p_msgs jsonb[], p_headers jsonb[])
    returns bigint[]
    language plpgsql
    volatile
    as $body$
    declare
      v_ids bigint[];
    begin
      case p_op
      when 'lock' then
        select coalesce(array_agg(x.msg_id order by x.msg_id), '{}') into v_ids
        from (select q.msg_id from pgmq.%2$I q where q.msg_id = any (p_ids) order by q.msg_id for update) x;
      when 'lock_skip_locked' then
        select coalesce(array_agg(x.msg_id order by x.msg_id), '{}') into v_ids
        from (select q.msg_id from pgmq.%2$I q where q.msg_id = any (p_ids)
              order by q.msg_id for update skip locked) x;
      when 'lock_visible' then
        select array_agg(x.msg_id order by x.msg_id) into v_ids
        from (select q.msg_id from pgmq.%2$I q where q.vt <= clock_timestamp()
              order by q.msg_id limit p_n for update skip locked) x;
      when 'lock_visible_ranked' then
        select array_agg(x.msg_id order by x.msg_id) into v_ids
        from (select q.msg_id from pgmq.%2$I q where q.vt <= clock_timestamp()
              order by (q.headers ->> 'pgflow_rank')::float8 nulls first, q.msg_id
              limit p_n for update skip locked) x;
      when 'peek_visible' then
        select array_agg(x.msg_id order by x.msg_id) into v_ids
        from (select q.msg_id from pgmq.%2$I q where q.vt <= clock_timestamp()
              order by q.msg_id limit p_n) x;
      when 'visibility' then
        with updated as (
          update pgmq.%2$I q
          set vt = v.vt, read_ct = q.read_ct + p_n,
              last_read_at = case when p_n = 1 then clock_timestamp() else q.last_read_at end
          from unnest(p_ids, p_vts) as v(id, vt)
          where q.msg_id = v.id
          returning q.msg_id
        )
        select coalesce(array_agg(u.msg_id), '{}') into v_ids from updated u;
      when 'archive' then
        with archived as (
          delete from pgmq.%2$I q where q.msg_id = any (p_ids)
          returning q.msg_id, q.vt, q.read_ct, q.enqueued_at, q.last_read_at, q.message, q.headers
        ),
        moved as (
          insert into pgmq.%3$I (msg_id, vt, read_ct, enqueued_at, last_read_at, message, headers)
          select a.msg_id, a.vt, a.read_ct, a.enqueued_at, a.last_read_at, a.message, a.headers from archived a
          returning msg_id
        )
        select coalesce(array_agg(m.msg_id), '{}') into v_ids from moved m;
      when 'send' then
        with sent as (
          insert into pgmq.%2$I (vt, read_ct, last_read_at, message, headers)
          select coalesce(p_vts[m.ord], p_vts[1]), coalesce(p_n, 0),
                 case when p_n > 0 then clock_timestamp() end, m.message, p_headers[m.ord]
          from unnest(p_msgs) with ordinality as m(message, ord) order by m.ord
          returning msg_id
        )
        select array_agg(s.msg_id order by s.msg_id) into v_ids from sent s;
      else
        raise exception 'pgflow._queue_op(): unknown operation %%', p_op;
      end case;
      return v_ids;
    end;
    $body$
  $f$, pgflow._queue_ops_name(p_queue), pgmq.format_table_name(p_queue, 'q'),
     pgmq.format_table_name(p_queue, 'a'));
  -- Schema-level default privileges cannot take EXECUTE away from PUBLIC, so it is revoked here.
  execute format('revoke execute on function %s(text, bigint[], timestamptz[], int, jsonb[], jsonb[]) from public',
                 pgflow._queue_ops_name(p_queue));
exception
  -- Another transaction created it first.
  when duplicate_function or unique_violation then
    null;
end;
$$;
-- ---- end pgflow._create_queue_ops ----

-- ---- as in schema/07_claims.sql : pgflow._worker_disabled ----
create or replace function pgflow._worker_disabled(p_worker_id uuid)
returns jsonb
language plpgsql
stable
set search_path = ''
as $$
begin
  return (select jsonb_build_object('function_name', wf.function_name, 'reason', wf.disabled_reason,
                                    'disabled_at', wf.disabled_at)
          from pgflow.workers w
          join pgflow.worker_functions wf on wf.function_name = w.function_name
          where w.worker_id = p_worker_id and not wf.enabled);
end;
$$;
-- ---- end pgflow._worker_disabled ----

-- ---- as in schema/07_claims.sql : pgflow._claimed_rows ----
create or replace function pgflow._claimed_rows(p_queue text, p_msg_ids bigint[])
returns table(outcome text, msg_id bigint, flow_slug text, run_id uuid, step_slug text, task_index integer, input jsonb, flow_input jsonb, attempts_count integer, timeout integer, report jsonb)
language plpgsql
set search_path = ''
as $$
begin
  return query
  select 'claimed'::text, m.id, t.flow_slug, t.run_id, t.step_slug, t.task_index, i.input, i.flow_input,
         t.attempts_count, coalesce(s.opt_timeout, f.opt_timeout), r.trace_context
  from unnest(p_msg_ids) with ordinality as m(id, ord)
  cross join lateral (
    select t.* from pgflow.step_tasks t where t.queue_name = p_queue and t.message_id = m.id offset 0
  ) t
  join pgflow.steps s on s.flow_slug = t.flow_slug and s.step_slug = t.step_slug
  join pgflow.flows f on f.flow_slug = t.flow_slug
  join pgflow.runs r on r.run_id = t.run_id
  cross join lateral pgflow._task_inputs(t.run_id, t.flow_slug, t.step_slug, s.step_type, s.deps_count,
                                         t.element, r.input) i
  where t.status = 'started'
  order by m.ord;
end;
$$;
-- ---- end pgflow._claimed_rows ----

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
  v_disabled := pgflow._worker_disabled(_claim_tasks.worker_id);

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
    return query select * from pgflow._claimed_rows(v_queue, v_claim_ids);
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
  select c.flow_slug, c.run_id, c.step_slug, c.input, c.msg_id, c.task_index, c.flow_input
  from pgflow._claimed_rows(v_queue, v_claimed) c;
end;
$$;
-- ---- end pgflow.start_tasks ----

-- ---- as in schema/06_runs.sql : pgflow._create_step_tasks ----
create or replace function pgflow._create_step_tasks(p_run_ids uuid[], p_step_slugs text[])
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_claim jsonb := nullif(current_setting('pgflow.exchange_claim', true), '')::jsonb;
  v_pair_flows text[];
  v_pair_steps text[];
  v_budget int;
  v_take int;
  v_ids bigint[];
  v_group record;
  v_part record;
  v_queues text[];
begin
  if v_claim is not null then
    v_budget := (v_claim ->> 'budget')::int;
    select array_agg(p.pair ->> 0), array_agg(p.pair ->> 1) into v_pair_flows, v_pair_steps
    from jsonb_array_elements(v_claim -> 'pairs') as p(pair);
  end if;
  for v_group in
    select s.queue_name, coalesce(s.opt_start_delay, 0) as delay,
           pgflow._queue_aging_secs(s.queue_name) as aging_secs,
           array_agg(r.priority order by t.run_id, t.step_slug, t.task_index) as priorities,
           array_agg(t.run_id order by t.run_id, t.step_slug, t.task_index) as run_ids,
           array_agg(r.flow_slug order by t.run_id, t.step_slug, t.task_index) as flow_slugs,
           array_agg(t.step_slug order by t.run_id, t.step_slug, t.task_index) as step_slugs,
           array_agg(t.task_index order by t.run_id, t.step_slug, t.task_index) as task_indexes,
           array_agg(t.element order by t.run_id, t.step_slug, t.task_index) as elements,
           array_agg(coalesce(s.opt_timeout, f.opt_timeout) order by t.run_id, t.step_slug, t.task_index)
             as timeouts,
           array_agg(v_claim is not null
                     and exists (select 1 from unnest(v_pair_flows, v_pair_steps) as p(flow_slug, step_slug)
                                 where p.flow_slug = r.flow_slug and p.step_slug = t.step_slug)
                     order by t.run_id, t.step_slug, t.task_index) as claimable
    from unnest(p_run_ids, p_step_slugs) as x(run_id, step_slug)
    cross join lateral (select r.flow_slug, r.input, r.priority from pgflow.runs r where r.run_id = x.run_id offset 0) r
    join pgflow.steps s on s.flow_slug = r.flow_slug and s.step_slug = x.step_slug
    join pgflow.flows f on f.flow_slug = r.flow_slug
    cross join lateral (
      select x.run_id, x.step_slug, 0 as task_index, null::jsonb as element
      where s.step_type = 'single'
      union all
      select x.run_id, x.step_slug, (e.ord - 1)::int, e.value
      from jsonb_array_elements(
             case when s.step_type <> 'map' then '[]'::jsonb
                  when s.deps_count = 0 then r.input
                  else (select ds.output from pgflow.deps d
                        join pgflow.step_states ds on ds.run_id = x.run_id and ds.step_slug = d.dep_slug
                        where d.flow_slug = r.flow_slug and d.step_slug = x.step_slug
                        limit 1)
             end) with ordinality as e(value, ord)
    ) t
    group by s.queue_name, coalesce(s.opt_start_delay, 0)
  loop
    -- CLAIMED AT CREATION (above): how many of this group the exchange's worker takes now.
    v_take := 0;
    if v_budget > 0 and v_group.queue_name = v_claim ->> 'queue' and v_group.delay = 0
       and v_group.aging_secs is null and true = any (v_group.claimable)
       and not pgflow._queue_limited(v_group.queue_name) then
      v_take := v_budget - coalesce(cardinality(
                  pgflow._queue_op(v_group.queue_name, 'peek_visible', null, null, v_budget)), 0);
    end if;
    for v_part in
      select c.claimed,
             array_agg(c.priority order by c.ord) as priorities,
             array_agg(c.run_id order by c.ord) as run_ids,
             array_agg(c.flow_slug order by c.ord) as flow_slugs,
             array_agg(c.step_slug order by c.ord) as step_slugs,
             array_agg(c.task_index order by c.ord) as task_indexes,
             array_agg(c.element order by c.ord) as elements,
             array_agg(clock_timestamp()
                       + make_interval(secs => c.timeout::float8 + pgflow._claim_visibility_buffer_seconds())
                       order by c.ord) filter (where c.claimed) as claimed_vts
      from (
        select u.*, u.claimable and count(*) filter (where u.claimable) over (order by u.ord) <= v_take as claimed
        from unnest(v_group.priorities, v_group.run_ids, v_group.flow_slugs, v_group.step_slugs,
                    v_group.task_indexes, v_group.elements, v_group.timeouts, v_group.claimable)
               with ordinality as u(priority, run_id, flow_slug, step_slug, task_index, element, timeout,
                                    claimable, ord)
      ) c
      group by c.claimed
      order by c.claimed desc
    loop
      with created as (
        insert into pgflow.step_tasks (flow_slug, run_id, step_slug, task_index, message_id, queue_name, element,
                                       status, attempts_count, started_at, last_worker_id)
        select m.flow_slug, m.run_id, m.step_slug, m.task_index, sent.msg_id, v_group.queue_name, m.element,
               case when v_part.claimed then 'started' else 'queued' end,
               case when v_part.claimed then 1 else 0 end,
               case when v_part.claimed then now() end,
               case when v_part.claimed then (v_claim ->> 'worker')::uuid end
        from unnest(pgflow._queue_op(
               v_group.queue_name, 'send', null,
               case when v_part.claimed then v_part.claimed_vts
                    else array[clock_timestamp() + make_interval(secs => v_group.delay)] end,
               case when v_part.claimed then 1 end,
               (select array_agg(jsonb_build_object(
                         'flow_slug', u.flow_slug,
                         'run_id', u.run_id,
                         'step_slug', u.step_slug,
                         'task_index', u.task_index) order by u.ord)
                from unnest(v_part.flow_slugs, v_part.run_ids, v_part.step_slugs, v_part.task_indexes)
                       with ordinality as u(flow_slug, run_id, step_slug, task_index, ord)),
               case when v_group.aging_secs is not null
                    then array(select pgflow._rank_headers(v_group.aging_secs, p.priority)
                               from unnest(v_part.priorities) with ordinality as p(priority, ord) order by p.ord) end))
               with ordinality as sent(msg_id, ord)
        join unnest(v_part.flow_slugs, v_part.run_ids, v_part.step_slugs, v_part.task_indexes, v_part.elements)
               with ordinality as m(flow_slug, run_id, step_slug, task_index, element, ord)
          on m.ord = sent.ord
        returning message_id
      )
      select array_agg(c.message_id) into v_ids from created c;
      if v_part.claimed then
        v_budget := v_budget - cardinality(v_ids);
        v_claim := jsonb_set(jsonb_set(v_claim, '{budget}', to_jsonb(v_budget)), '{claimed}',
                             coalesce(v_claim -> 'claimed', '[]') || to_jsonb(v_ids));
        perform set_config('pgflow.exchange_claim', v_claim::text, true);
      else
        v_queues := array_append(v_queues, v_group.queue_name);
      end if;
    end loop;
  end loop;
  if v_queues is not null then
    perform pgflow._signal_queues(v_queues);
  end if;
end;
$$;
-- ---- end pgflow._create_step_tasks ----

-- ---- as in schema/08_completion.sql : pgflow.exchange ----
create or replace function pgflow.exchange(queue_name text, worker_id uuid, flow_slugs text[], step_slugs text[], qty integer, vt integer, run_ids uuid[], done_step_slugs text[], task_indexes integer[], outputs jsonb[], attempts integer[])
returns table(outcome text, msg_id bigint, flow_slug text, run_id uuid, step_slug text, task_index integer, input jsonb, flow_input jsonb, attempts_count integer, timeout integer, report jsonb, status text)
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
as $$
declare
  v_qty int := coalesce(exchange.qty, 0);
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
    perform set_config('pgflow.signal_source', 'exchange', true);
    perform set_config('pgflow.signal_worker', exchange.worker_id::text, true);
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
    select array_agg(c.id::bigint order by c.id::bigint) into v_claimed
    from jsonb_array_elements_text(nullif(current_setting('pgflow.exchange_claim', true), '')::jsonb -> 'claimed')
           as c(id);
    perform set_config('pgflow.exchange_claim', '', true);
    perform set_config('pgflow.signal_source', '', true);
    perform set_config('pgflow.signal_worker', '', true);
    if v_claimed is not null then
      -- Created claimed; a task the same completions then ended (its run failed) is not returned.
      return query
      select c.outcome, c.msg_id, c.flow_slug, c.run_id, c.step_slug, c.task_index, c.input, c.flow_input,
             c.attempts_count, c.timeout, c.report, null::text
      from pgflow._claimed_rows(lower(exchange.queue_name), v_claimed) c;
      get diagnostics v_n = row_count;
      v_qty := v_qty - v_n;
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
-- ---- end pgflow.exchange ----

-- Schema-level default privileges cannot take EXECUTE away from PUBLIC: revoked here for the new functions.
revoke execute on function pgflow._worker_disabled(uuid) from public;
revoke execute on function pgflow._claimed_rows(text, bigint[]) from public;
