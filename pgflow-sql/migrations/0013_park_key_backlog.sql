-- pgflow-rs SQL core: a key at its concurrency limit no longer holds up the other keys of its queue. A claim
-- that holds a task because its key's slots are all taken parks the rest of that key's visible backlog in the
-- same transaction (pgflow._park_key_backlog), so the next read reaches the other keys' tasks at once. Before,
-- each of the key's messages was read and parked by a claim in turn: a task of another key behind a backlog of
-- 10,000 waited for all of them to be read.
-- The limit key's formula moves into pgflow._limit_key, used by the admission, the parking and the wake-up.

-- ---- as in schema/16_flow_control.sql : pgflow._park_scan_limit ----
create or replace function pgflow._park_scan_limit()
returns integer
language sql
immutable
set search_path = ''
as $$ select 5000 $$;
-- ---- end pgflow._park_scan_limit ----

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
      join pgflow.step_tasks t on t.queue_name = $1 and t.message_id = v.msg_id and t.status = 'queued'
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
  v_full_keys text[];
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

  -- A key whose slots are all taken: the rest of its visible backlog is parked now as well, so that the next
  -- reads reach the other keys' tasks at once instead of meeting this key's tasks batch by batch.
  if array_position(v_admitted, false) is not null then
    select array_agg(distinct a.slot_key) into v_full_keys
    from unnest(v_flows, v_steps, v_slot_keys, v_admitted) as a(flow_slug, step_slug, slot_key, admitted)
    join pgflow.key_limits k on k.flow_slug = a.flow_slug and k.step_slug = a.step_slug
    where not a.admitted and a.slot_key is not null
      and (select count(*) from pgflow.limit_slots s where s.limit_key = a.slot_key) >= k.max_per_key;
    if v_full_keys is not null then
      perform pgflow._park_key_backlog(p_queue, v_full_keys, v_ids,
                                       v_now + make_interval(secs => pgflow._park_seconds()));
    end if;
  end if;

  return query
  select a.id, a.hide from unnest(v_ids, v_admitted, v_hide) as a(id, admitted, hide) where not a.admitted order by a.id;
end;
$$;
-- ---- end pgflow._apply_limits ----

-- ---- as in schema/16_flow_control.sql : pgflow._limit_key ----
create or replace function pgflow._limit_key(p_flow_slug text, p_step_slug text, p_value text)
returns text
language sql
immutable parallel safe
as $$ select p_flow_slug || '/' || p_step_slug || '/' || coalesce(p_value, '') $$;
-- ---- end pgflow._limit_key ----

-- ---- as in schema/16_flow_control.sql : pgflow._wake_parked_step ----
create or replace function pgflow._wake_parked_step(p_flow_slug text, p_step_slug text)
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_queue text;
  v_prefix text := pgflow._limit_key(p_flow_slug, p_step_slug, '');
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
                then pgflow._limit_key(t.flow_slug, t.step_slug, r.input #>> k.key_path) end as limit_key
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

revoke execute on function pgflow._limit_key(text, text, text) from public;
revoke execute on function pgflow._park_scan_limit() from public;
revoke execute on function pgflow._park_key_backlog(text, text[], bigint[], timestamptz) from public;
