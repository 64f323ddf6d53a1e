-- pgflow-rs SQL core, migration 0024: each queue's message statements are planned once per session.
--
-- PGMQ names a queue's tables after the queue, so every statement on them is built as text and planned on
-- every call: pgmq.archive and pgmq.send_batch do that, and so did the claim's message lock and visibility
-- update here. Measured on one session, planning was most of their cost (pgmq.archive 0.22 ms against
-- 0.05 ms for its DELETE, pgmq.send_batch 0.18 against 0.03, the message lock 0.18 against 0.02), about a
-- fifth of a one-task exchange.
--
-- Each queue now gets one PL/pgSQL function, pgflow."_queue_ops_<queue>", whose statements name its tables
-- directly, so PostgreSQL plans each of them once per session. pgflow._queue_op calls it, creating it the
-- first time a queue is used (flows' queues get it when they compile, through _ensure_queue; queues that
-- exist now get it here). The claim, the read-and-claim, completion and task creation go through it; rare
-- paths (reports, maintenance) keep PGMQ's functions. The statements write what PGMQ's would: the same rows,
-- columns and ids, and the same locks in the same order (lock order step 3, 0011_claims.sql). A later
-- migration that changes the statements drops these functions; they are created again on first use.

------------------------------------------------------------------------------------------------------------
-- One function per queue
------------------------------------------------------------------------------------------------------------

-- The name of queue `p_queue`'s statements function (at most 11 + 47 characters, within the 63 allowed).
-- Immutable all through (quote_ident, not the stable format()), so PostgreSQL inlines it into its callers.
create function pgflow._queue_ops_name(p_queue text)
returns text
language sql
immutable
as $$
  select 'pgflow.' || quote_ident('_queue_ops_' || lower(p_queue))
$$;

-- Creates queue `p_queue`'s statements function unless it exists. Operations (ids are message ids):
--   lock              lock p_ids' live messages, in id order; returns those locked
--   lock_skip_locked  the same, skipping messages another transaction holds
--   lock_visible      lock up to p_n visible messages, oldest first, skipping held ones (as pgmq.read);
--                     returns them, or NULL when there is none
--   visibility        set each of p_ids' vt to p_vts' matching value, add p_n to read_ct and, when p_n is 1,
--                     stamp last_read_at; returns the ids updated
--   archive           move p_ids' messages to the archive table (as pgmq.archive); returns the ids moved
--   send              insert p_msgs with vt p_vts[1] (as pgmq.send_batch); returns their ids, in p_msgs order
create function pgflow._create_queue_ops(p_queue text)
returns void
language plpgsql
volatile
set search_path = ''
as $$
begin
  if to_regproc(pgflow._queue_ops_name(p_queue)) is not null then
    return;
  end if;
  execute format($f$
    create function %1$s(p_op text, p_ids bigint[], p_vts timestamptz[], p_n int, p_msgs jsonb[])
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
          insert into pgmq.%2$I (vt, message)
          select p_vts[1], m.message from unnest(p_msgs) with ordinality as m(message, ord) order by m.ord
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
  -- Schema-level default privileges cannot take EXECUTE away from PUBLIC, so it is revoked here (0014).
  execute format('revoke execute on function %s(text, bigint[], timestamptz[], int, jsonb[]) from public',
                 pgflow._queue_ops_name(p_queue));
exception
  -- Another transaction created it first.
  when duplicate_function or unique_violation then
    null;
end;
$$;

-- Drops queue `p_queue`'s statements function, if any (its queue is being dropped).
create function pgflow._drop_queue_ops(p_queue text)
returns void
language plpgsql
volatile
set search_path = ''
as $$
begin
  execute format('drop function if exists %s(text, bigint[], timestamptz[], int, jsonb[])',
                 pgflow._queue_ops_name(p_queue));
end;
$$;

-- Runs operation `p_op` (see _create_queue_ops) on queue `p_queue`'s messages.
create function pgflow._queue_op(p_queue text, p_op text, p_ids bigint[] default null,
                                 p_vts timestamptz[] default null, p_n int default null,
                                 p_msgs jsonb[] default null)
returns bigint[]
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_fn text := pgflow._queue_ops_name(p_queue);
  v_ids bigint[];
begin
  if to_regproc(v_fn) is null then
    perform pgflow._create_queue_ops(p_queue);
  end if;
  execute format('select %s($1, $2, $3, $4, $5)', v_fn) into v_ids using p_op, p_ids, p_vts, p_n, p_msgs;
  return v_ids;
end;
$$;

-- As in 0005, through the queue's statements.
create or replace function pgflow._lock_messages(p_queue text, p_ids bigint[], p_skip_locked boolean default false)
returns bigint[]
language plpgsql
volatile
set search_path = ''
as $$
begin
  if p_ids is null or cardinality(p_ids) = 0
     or to_regclass(format('pgmq.%I', pgmq.format_table_name(p_queue, 'q'))) is null then
    return '{}';
  end if;
  return pgflow._queue_op(p_queue, case when p_skip_locked then 'lock_skip_locked' else 'lock' end, p_ids);
end;
$$;

-- As in 0017, creating the queue's statements with the queue.
create or replace function pgflow._ensure_queue(p_queue text)
returns void
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_max bigint;
  v_seq text;
begin
  insert into pgflow.queue_signals (queue_name) values (lower(p_queue)) on conflict do nothing;
  if pgflow._queue_meta_name(p_queue) is not null then
    return;
  end if;
  perform pgmq.create(p_queue);
  perform pgflow._create_queue_ops(p_queue);
  select max(t.message_id) into v_max from pgflow.step_tasks t where t.queue_name = lower(p_queue);
  if v_max is null then
    return;
  end if;
  v_seq := pg_get_serial_sequence(format('pgmq.%I', pgmq.format_table_name(p_queue, 'q')), 'msg_id');
  if v_seq is not null then
    perform setval(v_seq, greatest(v_max, coalesce(pg_sequence_last_value(v_seq::regclass), 0)));
  end if;
end;
$$;

-- As in 0015, dropping the statements of each queue it drops.
create or replace function pgflow.delete_flow_and_data(p_flow_slug text)
returns void
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_queue text;
  v_meta_name text;
begin
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

------------------------------------------------------------------------------------------------------------
-- The hot paths, through the queue's statements
------------------------------------------------------------------------------------------------------------

-- As in 0021, through the queue's statements.
create or replace function pgflow._claim_tasks(
  queue_name text,
  msg_ids bigint[],
  worker_id uuid,
  flow_slugs text[],
  step_slugs text[],
  read_vt int
)
returns table (
  outcome text,
  msg_id bigint,
  flow_slug text,
  run_id uuid,
  step_slug text,
  task_index int,
  input jsonb,
  flow_input jsonb,
  attempts_count int,
  timeout int,
  report jsonb
)
language plpgsql
volatile
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

  -- Lock order step 4: every task of the batch, in message order, classified in the same statement.
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
    from pgflow.step_tasks t
    join pgflow.runs r on r.run_id = t.run_id
    join pgflow.step_states ss on ss.run_id = t.run_id and ss.step_slug = t.step_slug
    join pgflow.steps s on s.flow_slug = t.flow_slug and s.step_slug = t.step_slug
    join pgflow.flows f on f.flow_slug = t.flow_slug
    where t.queue_name = v_queue and t.message_id = any (v_ids)
    order by t.message_id
    for update of t
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

    return query select 'unsupported'::text, null::bigint, null::text, null::uuid, null::text, null::int,
                        null::jsonb, null::jsonb, null::int, null::int, v_report;
    return;
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
  if v_claim_ids is not null or v_defer_ids is not null or _claim_tasks.read_vt is not null then
    select array_agg(v.id), array_agg(v.vt) into v_vis_ids, v_vis_vts
    from (
      select c.id, clock_timestamp() + make_interval(secs => c.secs) as vt
      from unnest(v_claim_ids, v_secs) as c(id, secs)
      union all
      select d.id, d.vt from unnest(v_defer_ids, v_defer_vts) as d(id, vt)
      union all
      select o.id, clock_timestamp() + make_interval(secs => _claim_tasks.read_vt)
      from unnest(coalesce(v_wait_ids, '{}') || coalesce(v_archive_ids, '{}')) as o(id)
      where _claim_tasks.read_vt is not null
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

  if v_claim_ids is not null then
    return query
    select 'claimed'::text, c.msg_id, t.flow_slug, t.run_id, t.step_slug, t.task_index, i.input, i.flow_input,
           t.attempts_count, coalesce(s.opt_timeout, f.opt_timeout), null::jsonb
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

-- As in 0021, through the queue's statements.
create or replace function pgflow.read_and_claim_tasks(
  queue_name text,
  qty int,
  vt int,
  worker_id uuid,
  flow_slugs text[],
  step_slugs text[]
)
returns table (
  outcome text,
  msg_id bigint,
  flow_slug text,
  run_id uuid,
  step_slug text,
  task_index int,
  input jsonb,
  flow_input jsonb,
  attempts_count int,
  timeout int,
  report jsonb
)
language plpgsql
volatile
security definer
set search_path = ''
set plan_cache_mode = force_generic_plan
set enable_seqscan = off
as $$
declare
  v_ids bigint[];
begin
  -- Lock order step 3: the messages.
  v_ids := pgflow._queue_op(read_and_claim_tasks.queue_name, 'lock_visible', null, null,
                            read_and_claim_tasks.qty);
  if v_ids is null then
    return;
  end if;
  return query
  select * from pgflow._claim_tasks(read_and_claim_tasks.queue_name, v_ids, read_and_claim_tasks.worker_id,
                                    read_and_claim_tasks.flow_slugs, read_and_claim_tasks.step_slugs,
                                    coalesce(read_and_claim_tasks.vt, 0));
end;
$$;

-- As in 0023, through the queue's statements.
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

  -- Lock order 3: the tasks' messages, per queue.
  for v_group in
    select t.queue_name, array_agg(t.message_id order by t.message_id) as ids
    from unnest(p_run_ids, p_step_slugs, p_task_indexes) as i(run_id, step_slug, task_index)
    join pgflow.step_tasks t on t.run_id = i.run_id and t.step_slug = i.step_slug and t.task_index = i.task_index
    where t.message_id is not null
    group by t.queue_name
    order by t.queue_name
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

-- As in 0022, sending through the queue's statements.
create or replace function pgflow._create_step_tasks(p_run_ids uuid[], p_step_slugs text[])
returns void
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_group record;
  v_queues text[];
begin
  for v_group in
    select s.queue_name, coalesce(s.opt_start_delay, 0) as delay,
           array_agg(t.run_id order by t.run_id, t.step_slug, t.task_index) as run_ids,
           array_agg(r.flow_slug order by t.run_id, t.step_slug, t.task_index) as flow_slugs,
           array_agg(t.step_slug order by t.run_id, t.step_slug, t.task_index) as step_slugs,
           array_agg(t.task_index order by t.run_id, t.step_slug, t.task_index) as task_indexes,
           array_agg(t.element order by t.run_id, t.step_slug, t.task_index) as elements
    from unnest(p_run_ids, p_step_slugs) as x(run_id, step_slug)
    join pgflow.runs r on r.run_id = x.run_id
    join pgflow.steps s on s.flow_slug = r.flow_slug and s.step_slug = x.step_slug
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
    insert into pgflow.step_tasks (flow_slug, run_id, step_slug, task_index, message_id, queue_name, element)
    select m.flow_slug, m.run_id, m.step_slug, m.task_index, sent.msg_id, v_group.queue_name, m.element
    from unnest(pgflow._queue_op(
           v_group.queue_name, 'send', null,
           array[clock_timestamp() + make_interval(secs => v_group.delay)], null,
           (select array_agg(jsonb_build_object(
                     'flow_slug', u.flow_slug,
                     'run_id', u.run_id,
                     'step_slug', u.step_slug,
                     'task_index', u.task_index) order by u.ord)
            from unnest(v_group.flow_slugs, v_group.run_ids, v_group.step_slugs, v_group.task_indexes)
                   with ordinality as u(flow_slug, run_id, step_slug, task_index, ord))))
           with ordinality as sent(msg_id, ord)
    join unnest(v_group.flow_slugs, v_group.run_ids, v_group.step_slugs, v_group.task_indexes, v_group.elements)
           with ordinality as m(flow_slug, run_id, step_slug, task_index, element, ord)
      on m.ord = sent.ord;
    v_queues := array_append(v_queues, v_group.queue_name);
  end loop;
  perform pgflow._signal_queues(v_queues);
end;
$$;

-- The queues flows use now.
select pgflow._create_queue_ops(s.queue_name)
from (select distinct queue_name from pgflow.steps) s
where to_regclass(format('pgmq.%I', pgmq.format_table_name(s.queue_name, 'q'))) is not null;

revoke execute on all functions in schema pgflow from public;
