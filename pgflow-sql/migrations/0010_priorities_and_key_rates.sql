-- pgflow-rs SQL core: a rate limit per key, and priorities with aging.
--
-- * pgflow.key_limits: max_per_key becomes optional, and a key limit can carry a rate (rate_limit starts per
--   rate_period per key value), enforced by a token bucket per key (pgflow.key_buckets) inside the claim.
-- * Priorities: pgflow.runs.priority, given by new overloads of start_flow, start_flows and
--   start_flows_with_keys; pgflow.queue_priorities (set_queue_priority, clear_queue_priority); every message a
--   run sends to a queue with priorities carries its rank in its PGMQ headers, and the claim reads such a
--   queue by rank. The per-queue statement functions take headers: the installed ones are dropped here and
--   come back, in their new form, on first use.

alter table pgflow.key_limits
  alter column max_per_key drop not null,
  add column rate_limit integer,
  add column rate_period interval,
  add constraint key_limits_rate_positive check (rate_limit > 0 and rate_period > interval '0'),
  add constraint key_limits_rate_complete check ((rate_limit is null) = (rate_period is null)),
  add constraint key_limits_something check (max_per_key is not null or rate_limit is not null);

create table pgflow.key_buckets (
  limit_key text primary key,
  flow_slug text not null,
  step_slug text not null,
  tokens double precision not null,
  refilled_at timestamptz not null,
  foreign key (flow_slug, step_slug) references pgflow.key_limits (flow_slug, step_slug) on delete cascade
);
create index idx_key_buckets_idle on pgflow.key_buckets (flow_slug, step_slug, refilled_at);

drop function pgflow.set_key_limit(text, text, text[], integer);

-- ---- as in schema/16_flow_control.sql : pgflow.set_key_limit ----
create or replace function pgflow.set_key_limit(flow_slug text, step_slug text, key_path text[], max_per_key integer default NULL::integer, rate_limit integer default NULL::integer, rate_period interval default NULL::interval)
returns pgflow.key_limits
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_row pgflow.key_limits;
  v_where text := format('step "%s" of flow "%s"', set_key_limit.step_slug, set_key_limit.flow_slug);
begin
  if not exists (select 1 from pgflow.steps s
                 where s.flow_slug = set_key_limit.flow_slug and s.step_slug = set_key_limit.step_slug) then
    raise exception 'set_key_limit(): flow "%" has no step "%"', set_key_limit.flow_slug, set_key_limit.step_slug
      using errcode = 'undefined_object', hint = 'Name a concrete flow slug (not an alias) and one of its steps.';
  end if;
  if set_key_limit.key_path is null or cardinality(set_key_limit.key_path) = 0 then
    raise exception 'set_key_limit(): %: key_path is empty; name where the key is in the run input, e.g. ''{tenant}''',
        v_where using errcode = 'invalid_parameter_value';
  end if;
  if set_key_limit.max_per_key is null and set_key_limit.rate_limit is null then
    raise exception 'set_key_limit(): %: give max_per_key, rate_limit or both (clear_key_limit removes them)', v_where
      using errcode = 'invalid_parameter_value';
  end if;
  if set_key_limit.max_per_key < 1 then
    raise exception 'set_key_limit(): %: max_per_key must be at least 1, got %', v_where, set_key_limit.max_per_key
      using errcode = 'invalid_parameter_value';
  end if;
  if set_key_limit.rate_limit < 1 then
    raise exception 'set_key_limit(): %: rate_limit must be at least 1 start per period, got %', v_where,
        set_key_limit.rate_limit
      using errcode = 'invalid_parameter_value';
  end if;
  if (set_key_limit.rate_limit is null) <> (set_key_limit.rate_period is null)
     or set_key_limit.rate_period <= interval '0' then
    raise exception 'set_key_limit(): %: a rate needs both rate_limit and a positive rate_period, got % per %',
        v_where, coalesce(set_key_limit.rate_limit::text, 'NULL'), coalesce(set_key_limit.rate_period::text, 'NULL')
      using errcode = 'invalid_parameter_value';
  end if;
  insert into pgflow.key_limits as k (flow_slug, step_slug, key_path, max_per_key, rate_limit, rate_period)
  values (set_key_limit.flow_slug, set_key_limit.step_slug, set_key_limit.key_path, set_key_limit.max_per_key,
          set_key_limit.rate_limit, set_key_limit.rate_period)
  on conflict on constraint key_limits_pkey do update
  set key_path = excluded.key_path, max_per_key = excluded.max_per_key, rate_limit = excluded.rate_limit,
      rate_period = excluded.rate_period
  returning * into v_row;
  -- The buckets, after their key_limits row (lock order step 6).
  if v_row.rate_limit is null then
    delete from pgflow.key_buckets b where b.flow_slug = v_row.flow_slug and b.step_slug = v_row.step_slug;
  else
    update pgflow.key_buckets b set tokens = least(b.tokens, v_row.rate_limit)
    where b.flow_slug = v_row.flow_slug and b.step_slug = v_row.step_slug and b.tokens > v_row.rate_limit;
  end if;
  perform pgflow._wake_parked_step(v_row.flow_slug, v_row.step_slug);
  return v_row;
end;
$$;
-- ---- end pgflow.set_key_limit ----

-- ---- as in schema/16_flow_control.sql : pgflow._limit_admission ----
create or replace function pgflow._limit_admission(p_queue text, p_ids bigint[], p_limit pgflow.queue_limits, p_free bigint, p_queue_tokens double precision, p_now timestamptz)
returns table(msg_id bigint, run_id uuid, flow_slug text, step_slug text, task_index integer, limit_key text, slot_key text, key_tokens double precision, admitted boolean, hide_until timestamptz)
language plpgsql
stable
set search_path = ''
as $$
#variable_conflict use_column
begin
  -- PL/pgSQL, so that its plan is cached for the session (a SQL function with SET options is planned anew on
  -- every call).
  return query
  with cand as (
    select t.message_id as id, t.run_id, t.flow_slug, t.step_slug, t.task_index, k.max_per_key, k.rate_limit,
           extract(epoch from k.rate_period)::float8 as period_secs,
           case when k.flow_slug is not null
                then t.flow_slug || '/' || t.step_slug || '/' || coalesce(r.input #>> k.key_path, '') end as limit_key
    from pgflow.step_tasks t
    join pgflow.runs r on r.run_id = t.run_id
    left join pgflow.key_limits k on k.flow_slug = t.flow_slug and k.step_slug = t.step_slug
    where t.queue_name = p_queue and t.message_id = any (p_ids)
  ),
  per_key as (
    select c.*, row_number() over (partition by coalesce(c.limit_key, c.id::text) order by c.id) as turn,
           case when c.max_per_key is not null
                then (select count(*) from pgflow.limit_slots s where s.limit_key = c.limit_key) end as running,
           case when c.rate_limit is not null
                then coalesce((select least(c.rate_limit::float8,
                                            b.tokens + c.rate_limit * extract(epoch from p_now - b.refilled_at)::float8
                                                       / c.period_secs)
                               from pgflow.key_buckets b where b.limit_key = c.limit_key),
                              c.rate_limit::float8) end as tokens
    from cand c
  ),
  key_ok as (
    select p.*, coalesce(p.running + p.turn > p.max_per_key, false) as over_slots,
           coalesce(p.turn > floor(p.tokens), false) as over_rate
    from per_key p
  ),
  ranked as (
    select k.*, case when not (k.over_slots or k.over_rate)
                     then row_number() over (partition by k.over_slots or k.over_rate order by k.turn, k.id) end as place
    from key_ok k
  ),
  decided as (
    select r.*, r.place is not null and (p_free is null or r.place <= p_free) as ok from ranked r
  )
  select d.id, d.run_id, d.flow_slug, d.step_slug, d.task_index, d.limit_key,
         case when d.max_per_key is not null then d.limit_key end, d.tokens, d.ok,
         case
           when d.ok then null
           when d.over_slots then p_now + make_interval(secs => pgflow._park_seconds())
           when d.over_rate then p_now + make_interval(secs => greatest(0.05, (d.turn - d.tokens) * d.period_secs
                                                                               / d.rate_limit))
           when p_limit.rate_limit is not null and p_limit.max_started is null and d.limit_key is null
             then p_now + make_interval(secs => greatest(0.05, (1 - (p_queue_tokens - floor(p_queue_tokens)))
                                                                * extract(epoch from p_limit.rate_period)::float8
                                                                / p_limit.rate_limit))
           else p_now + make_interval(secs => pgflow._park_seconds())
         end
  from decided d
  order by d.id;
end;
$$;
-- ---- end pgflow._limit_admission ----

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
  v_slot_keys text[];
  v_key_tokens double precision[];
  v_admitted boolean[];
  v_hide timestamptz[];
begin
  -- Lock order step 6: the queue's limit row, then the key limits of the batch's steps in (flow, step) order.
  select * into v_limit from pgflow.queue_limits l where l.queue_name = p_queue for update;
  perform 1 from pgflow.key_limits k
  where (k.flow_slug, k.step_slug) in (select t.flow_slug, t.step_slug from pgflow.step_tasks t
                                       where t.queue_name = p_queue and t.message_id = any (p_ids))
  order by k.flow_slug, k.step_slug
  for update of k;

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

  select array_agg(a.msg_id order by a.msg_id), array_agg(a.run_id order by a.msg_id),
         array_agg(a.flow_slug order by a.msg_id), array_agg(a.step_slug order by a.msg_id),
         array_agg(a.task_index order by a.msg_id), array_agg(a.limit_key order by a.msg_id),
         array_agg(a.slot_key order by a.msg_id), array_agg(a.key_tokens order by a.msg_id),
         array_agg(a.admitted order by a.msg_id), array_agg(a.hide_until order by a.msg_id)
  into v_ids, v_runs, v_flows, v_steps, v_indexes, v_keys, v_slot_keys, v_key_tokens, v_admitted, v_hide
  from pgflow._limit_admission(p_queue, p_ids, v_limit, v_free, v_tokens, v_now) a;

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
  perform pgflow._spend_key_tokens(v_flows, v_steps, v_keys, v_key_tokens, v_admitted, v_now);

  -- Held ones: parked until a slot frees or their token comes.
  insert into pgflow.parked_messages as pm (queue_name, msg_id, limit_key)
  select p_queue, a.id, a.limit_key
  from unnest(v_ids, v_keys, v_admitted) as a(id, limit_key, admitted)
  where not a.admitted
  on conflict on constraint parked_messages_pkey do update set parked_at = excluded.parked_at;

  return query
  select a.id, a.hide from unnest(v_ids, v_admitted, v_hide) as a(id, admitted, hide) where not a.admitted order by a.id;
end;
$$;
-- ---- end pgflow._apply_limits ----

-- ---- as in schema/16_flow_control.sql : pgflow._spend_key_tokens ----
create or replace function pgflow._spend_key_tokens(p_flows text[], p_steps text[], p_keys text[], p_tokens double precision[], p_admitted boolean[], p_now timestamptz)
returns void
language plpgsql
set search_path = ''
as $$
begin
  if not exists (select 1 from unnest(p_tokens) as t(tokens) where t.tokens is not null) then
    return;
  end if;
  insert into pgflow.key_buckets as b (limit_key, flow_slug, step_slug, tokens, refilled_at)
  select a.limit_key, a.flow_slug, a.step_slug, min(a.tokens) - count(*), p_now
  from unnest(p_flows, p_steps, p_keys, p_tokens, p_admitted) as a(flow_slug, step_slug, limit_key, tokens, admitted)
  where a.tokens is not null and a.admitted
  group by a.limit_key, a.flow_slug, a.step_slug
  on conflict on constraint key_buckets_pkey do update set tokens = excluded.tokens, refilled_at = excluded.refilled_at;

  delete from pgflow.key_buckets b
  where b.limit_key in (
    select i.limit_key
    from (select distinct a.flow_slug, a.step_slug
          from unnest(p_flows, p_steps, p_tokens) as a(flow_slug, step_slug, tokens)
          where a.tokens is not null) s
    join pgflow.key_limits k on k.flow_slug = s.flow_slug and k.step_slug = s.step_slug
    cross join lateral (select x.limit_key from pgflow.key_buckets x
                        where x.flow_slug = s.flow_slug and x.step_slug = s.step_slug
                          and x.refilled_at < p_now - k.rate_period
                        limit 32) i);
end;
$$;
-- ---- end pgflow._spend_key_tokens ----

-- ---- as in schema/16_flow_control.sql : pgflow.clear_key_limit ----
create or replace function pgflow.clear_key_limit(flow_slug text, step_slug text)
returns boolean
language plpgsql
security definer
set search_path = ''
as $$
begin
  delete from pgflow.key_limits k
  where k.flow_slug = clear_key_limit.flow_slug and k.step_slug = clear_key_limit.step_slug;
  if not found then
    return false;
  end if;
  perform pgflow._wake_parked_step(clear_key_limit.flow_slug, clear_key_limit.step_slug);
  return true;
end;
$$;
-- ---- end pgflow.clear_key_limit ----

-- ---- as in schema/16_flow_control.sql : pgflow._wake_parked_step ----
create or replace function pgflow._wake_parked_step(p_flow_slug text, p_step_slug text)
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_queue text;
  v_prefix text := p_flow_slug || '/' || p_step_slug || '/';
  v_ids bigint[];
begin
  select s.queue_name into v_queue from pgflow.steps s where s.flow_slug = p_flow_slug and s.step_slug = p_step_slug;
  select array_agg(pm.msg_id order by pm.msg_id) into v_ids
  from pgflow.parked_messages pm
  where pm.queue_name = v_queue and left(pm.limit_key, length(v_prefix)) = v_prefix;
  if v_ids is null then
    return;
  end if;
  v_ids := pgflow._lock_messages(v_queue, v_ids, true);
  if cardinality(v_ids) > 0 then
    delete from pgflow.parked_messages pm where pm.queue_name = v_queue and pm.msg_id = any (v_ids);
    perform pgflow._queue_op(v_queue, 'visibility', v_ids, array(select clock_timestamp() from unnest(v_ids)), 0);
  end if;
end;
$$;
-- ---- end pgflow._wake_parked_step ----

alter table pgflow.runs add column priority int not null default 0;

create table pgflow.queue_priorities (
  queue_name text primary key,
  aging interval not null,
  constraint queue_priorities_aging_positive check (aging > interval '0')
);

drop function pgflow._queue_op(text, text, bigint[], timestamptz[], integer, jsonb[]);

-- The per-queue statement functions of the installed queues, in their old form (recreated on first use).
do $$
declare
  v_fn regprocedure;
begin
  for v_fn in
    select p.oid::regprocedure from pg_proc p join pg_namespace n on n.oid = p.pronamespace
    where n.nspname = 'pgflow' and p.proname like '\_queue\_ops\_%'
      and pg_get_function_identity_arguments(p.oid)
          = 'p_op text, p_ids bigint[], p_vts timestamp with time zone[], p_n integer, p_msgs jsonb[]'
  loop
    execute format('drop function %s', v_fn);
  end loop;
end;
$$;

-- ---- as in schema/18_priorities.sql : pgflow._rank_index_name ----
create or replace function pgflow._rank_index_name(p_queue text)
returns text
language sql
immutable
as $$
  select 'q_' || lower(p_queue) || '_pgflow_rank'
$$;
-- ---- end pgflow._rank_index_name ----

-- ---- as in schema/18_priorities.sql : pgflow._rank_headers ----
create or replace function pgflow._rank_headers(p_aging_secs double precision, p_priority integer)
returns jsonb
language sql
stable
as $$
  select case when p_aging_secs is not null
              then jsonb_build_object('pgflow_rank',
                                      extract(epoch from clock_timestamp())::float8
                                      - coalesce(p_priority, 0) * p_aging_secs) end
$$;
-- ---- end pgflow._rank_headers ----

-- ---- as in schema/18_priorities.sql : pgflow._run_rank_headers ----
create or replace function pgflow._run_rank_headers(p_queue text, p_run_id uuid)
returns jsonb
language sql
stable
as $$
  select pgflow._rank_headers(extract(epoch from qp.aging)::float8,
                              (select r.priority from pgflow.runs r where r.run_id = p_run_id))
  from pgflow.queue_priorities qp
  where qp.queue_name = lower(p_queue)
$$;
-- ---- end pgflow._run_rank_headers ----

-- ---- as in schema/18_priorities.sql : pgflow.set_queue_priority ----
create or replace function pgflow.set_queue_priority(queue_name text, aging interval)
returns pgflow.queue_priorities
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_queue text := lower(set_queue_priority.queue_name);
  v_row pgflow.queue_priorities;
begin
  if not exists (select 1 from pgflow.steps s where s.queue_name = v_queue)
     or pgflow._queue_meta_name(v_queue) is null then
    raise exception 'set_queue_priority(): queue "%" is not a queue pgflow routes tasks to', set_queue_priority.queue_name
      using errcode = 'undefined_object',
            hint = 'Name the queue of a compiled flow''s step (pgflow.steps.queue_name).';
  end if;
  if set_queue_priority.aging is null or set_queue_priority.aging <= interval '0' then
    raise exception 'set_queue_priority(): queue "%": aging must be a positive interval, got %', v_queue,
        coalesce(set_queue_priority.aging::text, 'NULL')
      using errcode = 'invalid_parameter_value',
            hint = 'Aging is how long one priority step is worth, e.g. ''1 minute''.';
  end if;
  execute format('create index if not exists %I on pgmq.%I (((headers ->> %L)::float8) nulls first, msg_id)',
                 pgflow._rank_index_name(v_queue), pgmq.format_table_name(v_queue, 'q'), 'pgflow_rank');
  insert into pgflow.queue_priorities as p (queue_name, aging)
  values (v_queue, set_queue_priority.aging)
  on conflict on constraint queue_priorities_pkey do update set aging = excluded.aging
  returning * into v_row;
  return v_row;
end;
$$;
-- ---- end pgflow.set_queue_priority ----

-- ---- as in schema/18_priorities.sql : pgflow.clear_queue_priority ----
create or replace function pgflow.clear_queue_priority(queue_name text)
returns boolean
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_queue text := lower(clear_queue_priority.queue_name);
begin
  delete from pgflow.queue_priorities p where p.queue_name = v_queue;
  if not found then
    return false;
  end if;
  execute format('drop index if exists pgmq.%I', pgflow._rank_index_name(v_queue));
  return true;
end;
$$;
-- ---- end pgflow.clear_queue_priority ----

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
          insert into pgmq.%2$I (vt, message, headers)
          select p_vts[1], m.message, p_headers[m.ord]
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

-- ---- as in schema/04_queue_names.sql : pgflow._drop_queue_ops ----
create or replace function pgflow._drop_queue_ops(p_queue text)
returns void
language plpgsql
set search_path = ''
as $$
begin
  execute format('drop function if exists %s(text, bigint[], timestamptz[], int, jsonb[], jsonb[])',
                 pgflow._queue_ops_name(p_queue));
end;
$$;
-- ---- end pgflow._drop_queue_ops ----

-- ---- as in schema/04_queue_names.sql : pgflow._queue_op ----
create or replace function pgflow._queue_op(p_queue text, p_op text, p_ids bigint[] default NULL::bigint[], p_vts timestamp with time zone[] default NULL::timestamp with time zone[], p_n integer default NULL::integer, p_msgs jsonb[] default NULL::jsonb[], p_headers jsonb[] default NULL::jsonb[])
returns bigint[]
language plpgsql
set search_path = ''
as $$
declare
  v_fn text := pgflow._queue_ops_name(p_queue);
  v_ids bigint[];
begin
  if to_regproc(v_fn) is null then
    perform pgflow._create_queue_ops(p_queue);
  end if;
  execute format('select %s($1, $2, $3, $4, $5, $6)', v_fn) into v_ids using p_op, p_ids, p_vts, p_n, p_msgs,
    p_headers;
  return v_ids;
end;
$$;
-- ---- end pgflow._queue_op ----

-- ---- as in schema/06_runs.sql : pgflow._create_step_tasks ----
create or replace function pgflow._create_step_tasks(p_run_ids uuid[], p_step_slugs text[])
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_group record;
  v_queues text[];
begin
  for v_group in
    select s.queue_name, coalesce(s.opt_start_delay, 0) as delay,
           (select extract(epoch from qp.aging)::float8 from pgflow.queue_priorities qp
            where qp.queue_name = s.queue_name) as aging_secs,
           array_agg(r.priority order by t.run_id, t.step_slug, t.task_index) as priorities,
           array_agg(t.run_id order by t.run_id, t.step_slug, t.task_index) as run_ids,
           array_agg(r.flow_slug order by t.run_id, t.step_slug, t.task_index) as flow_slugs,
           array_agg(t.step_slug order by t.run_id, t.step_slug, t.task_index) as step_slugs,
           array_agg(t.task_index order by t.run_id, t.step_slug, t.task_index) as task_indexes,
           array_agg(t.element order by t.run_id, t.step_slug, t.task_index) as elements
    from unnest(p_run_ids, p_step_slugs) as x(run_id, step_slug)
    cross join lateral (select r.flow_slug, r.input, r.priority from pgflow.runs r where r.run_id = x.run_id offset 0) r
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
                   with ordinality as u(flow_slug, run_id, step_slug, task_index, ord)),
           case when v_group.aging_secs is not null
                then array(select pgflow._rank_headers(v_group.aging_secs, p.priority)
                           from unnest(v_group.priorities) with ordinality as p(priority, ord) order by p.ord) end))
           with ordinality as sent(msg_id, ord)
    join unnest(v_group.flow_slugs, v_group.run_ids, v_group.step_slugs, v_group.task_indexes, v_group.elements)
           with ordinality as m(flow_slug, run_id, step_slug, task_index, element, ord)
      on m.ord = sent.ord;
    v_queues := array_append(v_queues, v_group.queue_name);
  end loop;
  perform pgflow._signal_queues(v_queues);
end;
$$;
-- ---- end pgflow._create_step_tasks ----

-- ---- as in schema/06_runs.sql : pgflow.start_flows ----
create or replace function pgflow.start_flows(flow_slug text, inputs jsonb[], run_ids uuid[], priorities integer[])
returns setof pgflow.runs
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
as $$
declare
  v_slug text := pgflow.resolve_flow_slug(start_flows.flow_slug);
  v_n int := cardinality(start_flows.inputs);
  v_steps int;
  v_root_map boolean;
  v_bad int;
  v_i int;
  v_runs uuid[];
  v_run pgflow.runs;
  v_started int;
  v_start_runs uuid[];
  v_start_steps text[];
  v_start_tasks int[];
  v_cascade uuid[];
begin
  if v_n is null then
    raise exception 'start_flows(%): inputs is NULL; pass an array with one input per run', v_slug;
  end if;
  if start_flows.run_ids is not null and cardinality(start_flows.run_ids) is distinct from v_n then
    raise exception 'start_flows(%): % run ids for % inputs; pass one run id (or NULL) per input, or no run ids',
      v_slug, coalesce(cardinality(start_flows.run_ids), 0), v_n;
  end if;
  if start_flows.priorities is not null and cardinality(start_flows.priorities) is distinct from v_n then
    raise exception 'start_flows(%): % priorities for % inputs; pass one priority (or NULL) per input, or no priorities',
      v_slug, coalesce(cardinality(start_flows.priorities), 0), v_n
      using errcode = 'invalid_parameter_value';
  end if;
  if v_n = 0 then
    return;
  end if;

  select count(*)::int, coalesce(bool_or(s.step_type = 'map' and s.deps_count = 0), false)
  into v_steps, v_root_map
  from pgflow.steps s
  where s.flow_slug = v_slug;

  if v_root_map then
    select min(i.ord) into v_bad
    from unnest(start_flows.inputs) with ordinality as i(input, ord)
    where i.input is null or jsonb_typeof(i.input) <> 'array';
    if v_bad is not null and start_flows.inputs[v_bad] is null then
      raise exception 'Flow % has root map steps but input is NULL%', v_slug,
        case when v_n > 1 then format(' (input %s of %s)', v_bad, v_n) else '' end;
    elsif v_bad is not null then
      raise exception 'Flow % has root map steps but input is not an array (got %)%', v_slug,
        jsonb_typeof(start_flows.inputs[v_bad]),
        case when v_n > 1 then format(' (input %s of %s)', v_bad, v_n) else '' end;
    end if;
  end if;

  for v_i in 1 .. v_n loop
    v_runs[v_i] := coalesce(start_flows.run_ids[v_i], gen_random_uuid());
  end loop;

  -- One run:started per run, in input order.
  for v_run in
    insert into pgflow.runs (run_id, flow_slug, input, remaining_steps, priority)
    select v_runs[i.ord], v_slug, i.input, v_steps, coalesce(start_flows.priorities[i.ord], 0)
    from unnest(start_flows.inputs) with ordinality as i(input, ord)
    order by i.ord
    returning *
  loop
    perform pgflow._emit('run:started', v_run.run_id, jsonb_build_object(
      'event_type', 'run:started',
      'run_id', v_run.run_id,
      'flow_slug', v_run.flow_slug,
      'input', v_run.input,
      'status', 'started',
      'remaining_steps', v_run.remaining_steps,
      'started_at', v_run.started_at
    ));
  end loop;

  -- A run's root steps are inserted started unless one of them needs the cascade (a root condition, or an
  -- empty root map); the roots inserted started come back ordered by run and step.
  with inserted as (
    insert into pgflow.step_states (flow_slug, run_id, step_slug, remaining_deps, initial_tasks, status,
                                    started_at, remaining_tasks)
    select y.flow_slug, y.run_id, y.step_slug, y.deps_count, y.initial_tasks,
           case when y.start then 'started' else 'created' end,
           case when y.start then now() end,
           case when y.start then y.initial_tasks end
    from (
      select s.flow_slug, r.run_id, s.step_slug, s.deps_count, x.initial_tasks,
             s.deps_count = 0 and not coalesce(bool_or(s.deps_count = 0 and pgflow._needs_cascade(
               x.initial_tasks, s.required_input_pattern, s.forbidden_input_pattern))
               over (partition by r.run_id), false) as start
      from unnest(v_runs, start_flows.inputs) as r(run_id, input)
      cross join pgflow.steps s
      cross join lateral (
        select case when s.step_type = 'single' then 1
                    when s.deps_count = 0 then jsonb_array_length(r.input)
               end as initial_tasks
      ) x
      where s.flow_slug = v_slug
    ) y
    returning step_states.run_id, step_states.step_slug, step_states.status, step_states.remaining_tasks
  )
  select count(distinct i.run_id) filter (where i.status = 'started')::int,
         array_agg(i.run_id order by i.run_id, i.step_slug) filter (where i.status = 'started'),
         array_agg(i.step_slug order by i.run_id, i.step_slug) filter (where i.status = 'started'),
         array_agg(i.remaining_tasks order by i.run_id, i.step_slug) filter (where i.status = 'started')
  into v_started, v_start_runs, v_start_steps, v_start_tasks
  from inserted i;

  if v_start_runs is not null and pgflow._step_events_enabled() then
    for v_i in 1 .. cardinality(v_start_runs) loop
      perform pgflow._emit_step_started(v_start_runs[v_i], v_start_steps[v_i], now(), v_start_tasks[v_i], 0);
    end loop;
  end if;
  -- Runs with no root started here (a root needs the cascade, or the flow has no steps): _advance_runs
  -- decides.
  if v_started < v_n then
    select array_agg(r.run_id order by r.ord) into v_cascade
    from unnest(v_runs) with ordinality as r(run_id, ord)
    where r.run_id <> all (coalesce(v_start_runs, '{}'));
    perform pgflow._advance_runs(v_cascade);
  end if;
  if v_start_runs is not null then
    perform pgflow._create_step_tasks(v_start_runs, v_start_steps);
  end if;

  -- Read back by key, one lateral lookup per run (kept apart with offset 0): a join could be planned as a
  -- pass over a whole index by a session whose plan predates the table's growth.
  return query select r.* from unnest(v_runs) with ordinality as u(run_id, ord)
               cross join lateral (select * from pgflow.runs x where x.run_id = u.run_id offset 0) r
               order by u.ord;
end;
$$;
-- ---- end pgflow.start_flows ----
-- ---- as in schema/06_runs.sql : pgflow.start_flows ----
create or replace function pgflow.start_flows(flow_slug text, inputs jsonb[], run_ids uuid[] default NULL::uuid[])
returns setof pgflow.runs
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
as $$
begin
  return query select * from pgflow.start_flows(start_flows.flow_slug, start_flows.inputs, start_flows.run_ids,
                                                null::integer[]);
end;
$$;
-- ---- end pgflow.start_flows ----

-- ---- as in schema/06_runs.sql : pgflow.start_flow ----
create or replace function pgflow.start_flow(flow_slug text, input jsonb, run_id uuid, priority integer)
returns setof pgflow.runs
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
as $$
begin
  return query select * from pgflow.start_flows(start_flow.flow_slug, array[start_flow.input],
                                                array[start_flow.run_id], array[start_flow.priority]);
end;
$$;
-- ---- end pgflow.start_flow ----
-- ---- as in schema/06_runs.sql : pgflow.start_flow ----
create or replace function pgflow.start_flow(flow_slug text, input jsonb, run_id uuid default NULL::uuid)
returns setof pgflow.runs
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
as $$
begin
  return query select * from pgflow.start_flows(start_flow.flow_slug, array[start_flow.input],
                                                array[start_flow.run_id], null::integer[]);
end;
$$;
-- ---- end pgflow.start_flow ----

-- ---- as in schema/13_run_control.sql : pgflow.start_flows_with_keys ----
create or replace function pgflow.start_flows_with_keys(flow_slug text, inputs jsonb[], idempotency_keys text[], run_ids uuid[], key_ttl interval, priorities integer[])
returns setof pgflow.runs
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_name text := lower(start_flows_with_keys.flow_slug);
  v_n int := cardinality(start_flows_with_keys.inputs);
  v_ttl interval := coalesce(start_flows_with_keys.key_ttl, pgflow._idempotency_key_ttl());
  v_ids uuid[];
  v_new_ord int[] := '{}';
  v_item record;
  v_id uuid;
  v_prev jsonb;
begin
  if v_n is null or cardinality(start_flows_with_keys.idempotency_keys) is distinct from v_n then
    raise exception 'start_flows_with_keys(%): % idempotency keys for % inputs; pass one key (or NULL) per input',
      start_flows_with_keys.flow_slug, coalesce(cardinality(start_flows_with_keys.idempotency_keys), 0),
      coalesce(v_n, 0)
      using errcode = 'invalid_parameter_value';
  end if;
  if start_flows_with_keys.run_ids is not null and cardinality(start_flows_with_keys.run_ids) <> v_n then
    raise exception 'start_flows_with_keys(%): % run ids for % inputs; pass one run id (or NULL) per input',
      start_flows_with_keys.flow_slug, cardinality(start_flows_with_keys.run_ids), v_n
      using errcode = 'invalid_parameter_value';
  end if;
  if start_flows_with_keys.priorities is not null and cardinality(start_flows_with_keys.priorities) <> v_n then
    raise exception 'start_flows_with_keys(%): % priorities for % inputs; pass one priority (or NULL) per input',
      start_flows_with_keys.flow_slug, cardinality(start_flows_with_keys.priorities), v_n
      using errcode = 'invalid_parameter_value';
  end if;
  if v_ttl <= interval '0' then
    raise exception 'start_flows_with_keys(%): the idempotency window must be positive (got %)',
      start_flows_with_keys.flow_slug, v_ttl
      using errcode = 'invalid_parameter_value';
  end if;
  if v_n = 0 then
    return;
  end if;

  -- Keys in key order, so that two concurrent calls with overlapping keys wait for each other in one order.
  for v_item in
    select i.ord::int as ord, i.input, k.key
    from unnest(start_flows_with_keys.inputs) with ordinality as i(input, ord)
    join unnest(start_flows_with_keys.idempotency_keys) with ordinality as k(key, ord) on k.ord = i.ord
    order by k.key nulls last, i.ord
  loop
    v_id := coalesce(start_flows_with_keys.run_ids[v_item.ord], gen_random_uuid());
    if v_item.key is null then
      v_ids[v_item.ord] := v_id;
      v_new_ord := v_new_ord || v_item.ord;
      continue;
    end if;
    insert into pgflow.idempotency_keys as k (flow_name, idempotency_key, run_id, input, expires_at)
    values (v_name, v_item.key, v_id, coalesce(v_item.input, 'null'::jsonb), now() + v_ttl)
    on conflict (flow_name, idempotency_key) do update
      set run_id = excluded.run_id, input = excluded.input, created_at = excluded.created_at,
          expires_at = excluded.expires_at
      where k.expires_at <= now()
    returning k.run_id into v_id;
    if found then
      v_ids[v_item.ord] := v_id;
      v_new_ord := v_new_ord || v_item.ord;
    else
      select k.run_id, k.input into v_id, v_prev
      from pgflow.idempotency_keys k
      where k.flow_name = v_name and k.idempotency_key = v_item.key;
      if v_prev is distinct from coalesce(v_item.input, 'null'::jsonb) then
        raise exception 'start_flows_with_keys(%): idempotency key "%" was used for another input',
          start_flows_with_keys.flow_slug, v_item.key
          using errcode = 'PF035',
                detail = format('The key started run %s with input %s.', v_id, v_prev),
                hint = 'Use a new key for a new input, or start with the same input to get the existing run.';
      end if;
      v_ids[v_item.ord] := v_id;
    end if;
  end loop;

  if cardinality(v_new_ord) > 0 then
    perform 1 from pgflow.start_flows(
      start_flows_with_keys.flow_slug,
      array(select start_flows_with_keys.inputs[o] from unnest(v_new_ord) with ordinality as u(o, n) order by n),
      array(select v_ids[o] from unnest(v_new_ord) with ordinality as u(o, n) order by n),
      case when start_flows_with_keys.priorities is not null
           then array(select start_flows_with_keys.priorities[o] from unnest(v_new_ord) with ordinality as u(o, n)
                      order by n) end);
  end if;

  return query select r.* from unnest(v_ids) with ordinality as u(run_id, ord)
               cross join lateral (select * from pgflow.runs x where x.run_id = u.run_id offset 0) r
               order by u.ord;
end;
$$;
-- ---- end pgflow.start_flows_with_keys ----
-- ---- as in schema/13_run_control.sql : pgflow.start_flows_with_keys ----
create or replace function pgflow.start_flows_with_keys(flow_slug text, inputs jsonb[], idempotency_keys text[], run_ids uuid[] default NULL::uuid[], key_ttl interval default NULL::interval)
returns setof pgflow.runs
language plpgsql
security definer
set search_path = ''
as $$
begin
  return query select * from pgflow.start_flows_with_keys(start_flows_with_keys.flow_slug, start_flows_with_keys.inputs,
                                                          start_flows_with_keys.idempotency_keys,
                                                          start_flows_with_keys.run_ids, start_flows_with_keys.key_ttl,
                                                          null::integer[]);
end;
$$;
-- ---- end pgflow.start_flows_with_keys ----

-- ---- as in schema/13_run_control.sql : pgflow._resend_tasks ----
create or replace function pgflow._resend_tasks(p_run_id uuid, p_step_slugs text[], p_task_indexes int[])
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_group record;
  v_queues text[];
  v_priority integer := (select r.priority from pgflow.runs r where r.run_id = p_run_id);
begin
  for v_group in
    select t.queue_name,
           (select extract(epoch from qp.aging)::float8 from pgflow.queue_priorities qp
            where qp.queue_name = t.queue_name) as aging_secs,
           array_agg(t.step_slug order by t.step_slug, t.task_index) as step_slugs,
           array_agg(t.task_index order by t.step_slug, t.task_index) as task_indexes,
           array_agg(jsonb_build_object('flow_slug', t.flow_slug, 'run_id', t.run_id, 'step_slug', t.step_slug,
                                        'task_index', t.task_index) order by t.step_slug, t.task_index) as bodies
    from unnest(p_step_slugs, p_task_indexes) as x(step_slug, task_index)
    join pgflow.step_tasks t on t.run_id = p_run_id and t.step_slug = x.step_slug and t.task_index = x.task_index
    group by t.queue_name
    order by t.queue_name
  loop
    update pgflow.step_tasks t
    set message_id = sent.msg_id
    from unnest(pgflow._queue_op(v_group.queue_name, 'send', null, array[clock_timestamp()], null, v_group.bodies,
                                 case when v_group.aging_secs is not null
                                      then array_fill(pgflow._rank_headers(v_group.aging_secs, v_priority),
                                                      array[cardinality(v_group.bodies)]) end))
           with ordinality as sent(msg_id, ord)
    join unnest(v_group.step_slugs, v_group.task_indexes) with ordinality as m(step_slug, task_index, ord)
      on m.ord = sent.ord
    where t.run_id = p_run_id and t.step_slug = m.step_slug and t.task_index = m.task_index;
    v_queues := array_append(v_queues, v_group.queue_name);
  end loop;
  perform pgflow._signal_queues(v_queues);
end;
$$;
-- ---- end pgflow._resend_tasks ----

-- ---- as in schema/07_claims.sql : pgflow.read_and_claim_tasks ----
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
  if read_and_claim_tasks.qty is null or read_and_claim_tasks.qty < 0 then
    raise exception 'read_and_claim_tasks(): qty must be how many messages of queue "%" to read at most, got %.',
        read_and_claim_tasks.queue_name, coalesce(read_and_claim_tasks.qty::text, 'NULL')
      using errcode = 'invalid_parameter_value',
            hint = 'Pass 0 or more (a worker passes its free handler slots); NULL is not "the whole queue".';
  end if;
  -- Lock order step 3: the messages (SKIP LOCKED, so their order does not matter), by rank on a queue with
  -- priorities (18_priorities.sql), else by msg_id.
  v_ids := pgflow._queue_op(read_and_claim_tasks.queue_name,
                            case when exists (select 1 from pgflow.queue_priorities p
                                              where p.queue_name = lower(read_and_claim_tasks.queue_name))
                                 then 'lock_visible_ranked' else 'lock_visible' end,
                            null, null, read_and_claim_tasks.qty);
  if v_ids is null then
    return;
  end if;
  return query
  select * from pgflow._claim_tasks(read_and_claim_tasks.queue_name, v_ids, read_and_claim_tasks.worker_id,
                                    read_and_claim_tasks.flow_slugs, read_and_claim_tasks.step_slugs,
                                    coalesce(read_and_claim_tasks.vt, 0));
end;
$$;
-- ---- end pgflow.read_and_claim_tasks ----

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
    'task_index', v_task.task_index), pgflow._run_rank_headers(v_task.queue_name, v_task.run_id)) into v_msg_id;

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
    'pgflow.start_flow(text,jsonb,uuid,integer)',
    'pgflow.start_flows(text,jsonb[],uuid[],integer[])',
    'pgflow.start_flows_with_keys(text,jsonb[],text[],uuid[],interval,integer[])',
    'pgflow.cancel_run(uuid,text)',
    'pgflow.cancel_runs(text,text,timestamp with time zone,text[],jsonb,text,integer,boolean)',
    'pgflow.retry_run(uuid,text)',
    'pgflow.replay_run(uuid,text)',
    'pgflow.queue_stats()'
  ]
$$;
-- ---- end pgflow._client_api ----

-- Schema-level default privileges cannot take EXECUTE away from PUBLIC: revoked here for the functions above.
revoke execute on all functions in schema pgflow from public;
