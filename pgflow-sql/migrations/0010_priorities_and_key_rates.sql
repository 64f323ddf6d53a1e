-- pgflow-rs SQL core: a rate limit per key, and priorities with aging.
--
-- * pgflow.key_limits: max_per_key becomes optional, and a key limit can carry a rate (rate_limit starts per
--   rate_period per key value), enforced by a token bucket per key (pgflow.key_buckets) inside the claim.

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
language sql
stable
set search_path = ''
as $$
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
  order by d.id
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

-- Schema-level default privileges cannot take EXECUTE away from PUBLIC: revoked here for the functions above.
revoke execute on all functions in schema pgflow from public;
