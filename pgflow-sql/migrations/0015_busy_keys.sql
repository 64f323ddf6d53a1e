-- pgflow-rs SQL core: claims of one queue no longer wait for each other on its key limits.
-- - A claim locks the key limits of its queue's steps FOR SHARE (set_key_limit and clear_key_limit still
--   exclude claims), and each key of its batch with a transaction-scoped advisory try-lock. A task whose key
--   another claim holds is hidden for _busy_key_seconds() and read again, neither counted nor parked.
-- - The admission query takes the batch's keys from its caller instead of finding them again.
-- - Claims prune idle key buckets with SKIP LOCKED.

drop function pgflow._limit_admission(text, bigint[], pgflow.queue_limits, bigint, double precision, timestamptz);

-- ---- as in schema/16_flow_control.sql : pgflow._busy_key_seconds ----
create or replace function pgflow._busy_key_seconds()
returns double precision
language sql
immutable
set search_path = ''
as $$ select 0.02::float8 $$;
-- ---- end pgflow._busy_key_seconds ----

-- ---- as in schema/16_flow_control.sql : pgflow._limit_admission ----
create or replace function pgflow._limit_admission(p_ids bigint[], p_flows text[], p_steps text[], p_keys text[], p_busy boolean[], p_limit pgflow.queue_limits, p_free bigint, p_queue_tokens double precision, p_now timestamptz)
returns table(msg_id bigint, slot_key text, key_tokens double precision, admitted boolean, hide_until timestamptz)
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
    select b.id, b.limit_key, b.busy, k.max_per_key, k.rate_limit,
           extract(epoch from k.rate_period)::float8 as period_secs
    from unnest(p_ids, p_flows, p_steps, p_keys, p_busy) as b(id, flow_slug, step_slug, limit_key, busy)
    left join pgflow.key_limits k on k.flow_slug = b.flow_slug and k.step_slug = b.step_slug
  ),
  per_key as (
    select c.*, row_number() over (partition by coalesce(c.limit_key, c.id::text) order by c.id) as turn,
           case when c.max_per_key is not null and not c.busy
                then (select count(*) from pgflow.limit_slots s where s.limit_key = c.limit_key) end as running,
           case when c.rate_limit is not null and not c.busy
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
    select k.*, case when not (k.busy or k.over_slots or k.over_rate)
                     then row_number() over (partition by k.busy or k.over_slots or k.over_rate order by k.turn, k.id)
                end as place
    from key_ok k
  ),
  decided as (
    select r.*, r.place is not null and (p_free is null or r.place <= p_free) as ok from ranked r
  )
  select d.id, case when d.max_per_key is not null and not d.busy then d.limit_key end, d.tokens, d.ok,
         case
           when d.ok then null
           when d.busy then p_now + make_interval(secs => pgflow._busy_key_seconds())
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
    from pgflow.step_tasks t
    left join pgflow.key_limits k on k.flow_slug = t.flow_slug and k.step_slug = t.step_slug
    where t.queue_name = p_queue and t.message_id = any (p_ids)
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
                        limit 32
                        for update skip locked) i);
end;
$$;
-- ---- end pgflow._spend_key_tokens ----

revoke execute on all functions in schema pgflow from public;
