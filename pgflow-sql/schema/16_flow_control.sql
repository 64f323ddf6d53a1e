-- Flow control: concurrency limits per queue and per key, and rate limits per queue and per key, enforced by
-- the database inside the claim, across every worker process.
--
--   queue limit   pgflow.queue_limits.max_started: at most that many tasks of the queue started at once
--   key limit     pgflow.key_limits: a step's tasks whose run input has the same value at key_path (a tenant
--                 id, say) are started at most max_per_key at once; other keys are not blocked
--   rate limit    pgflow.queue_limits.rate_limit per rate_period: a token bucket of the queue (at most
--                 rate_limit starts in any period; tokens refill continuously)
--   key rate      pgflow.key_limits.rate_limit per rate_period: a token bucket per key value
--                 (pgflow.key_buckets, one row per key that spent a token within the last period; a bucket
--                 idle for a whole period is full, the same as no row, and is pruned by the claims)
--
-- How a claim enforces them (pgflow._claim_tasks calls pgflow._apply_limits for the tasks it is about to
-- claim, only on a queue with a limit): the limit rows are locked (a queue limit's row serialises the claims of
-- its queue; key limits are shared, and each key of the batch is try-locked instead, so claims of one queue
-- with different keys run side by side), the running tasks counted from pgflow.limit_slots (one row per started
-- task under a concurrency limit), and the batch's tasks admitted in turns by key (each key's first task, then
-- each key's second...) while slots and tokens last (pgflow._limit_admission; a queue without key limits whose
-- free slots and tokens cover the whole batch admits it without that query). A task whose key another claim
-- holds at that moment is hidden for _busy_key_seconds() and read again (not parked: that claim commits within
-- milliseconds). Admitted tasks get a slot row and are claimed. The
-- others are HELD: not claimed, no attempt spent, reported as 'waiting', and their messages parked
-- (pgflow.parked_messages): hidden until a slot of their key or queue frees, when the task that held the slot
-- leaves 'started' (trigger step_tasks_free_limit_slot makes the oldest parked message of that key, and of
-- the queue, visible again), or for a rate limit until the token they wait for. A parked message also comes
-- back after park_seconds() at the latest when a concurrency limit held it, so nothing depends on the
-- wake-up alone; there is no busy loop: a held message is hidden, and the next read reaches the messages
-- behind it (no head-of-line blocking).
--
-- Limits apply to the claims of pgflow-rs workers (claim_tasks, read_and_claim_tasks, exchange); upstream's
-- start_tasks does not consult them. Tasks already started when a limit is set hold no slot.
--
-- Lock order: the limit rows are step 6, after the claim's messages and tasks: queue_limits FOR UPDATE, then
-- key_limits in (flow, step) order, FOR SHARE by claims (FOR UPDATE, or changed, by set_key_limit and
-- clear_key_limit), then per key of the batch a transaction-scoped advisory try-lock (key space 4, the key's
-- hashtext; never waited for, so its order does not matter). A key's bucket is written only by the holder of
-- its try-lock (or by set_key_limit, which excludes claims), and idle buckets are pruned with SKIP LOCKED. The
-- slot trigger runs where a task leaves 'started' (holding that task) and takes parked messages with SKIP
-- LOCKED only; so does a claim that parks a full key's backlog (after step 6, and it never waits).

-- A key at its limit does not hold up the others: when a claim holds a task because its key's slots are all
-- taken, it parks the rest of that key's visible backlog in the same transaction (pgflow._park_key_backlog),
-- so a large backlog of one key costs one set-based statement, not a read of each of its messages.
--
-- Owns: queue_limits, key_limits, key_buckets, limit_slots, parked_messages; set_queue_limit, set_key_limit,
-- clear_queue_limit, clear_key_limit; _park_seconds, _limit_key, _wake_parked_step, _queue_limited,
-- _busy_key_seconds, _limit_admission, _apply_limits, _park_key_backlog, _park_scan_limit, _spend_key_tokens,
-- _free_limit_slot.

create table pgflow.queue_limits (
  queue_name text primary key,
  -- NULL: no concurrency limit.
  max_started integer,
  -- NULL: no rate limit.
  rate_limit integer,
  rate_period interval,
  tokens double precision,
  refilled_at timestamptz,
  constraint queue_limits_max_started_positive check (max_started > 0),
  constraint queue_limits_rate_positive check (rate_limit > 0 and rate_period > interval '0'),
  constraint queue_limits_rate_complete check ((rate_limit is null) = (rate_period is null)),
  constraint queue_limits_something check (max_started is not null or rate_limit is not null)
);

create table pgflow.key_limits (
  flow_slug text not null,
  step_slug text not null,
  key_path text[] not null,
  -- NULL: no concurrency limit per key.
  max_per_key integer,
  -- NULL: no rate limit per key.
  rate_limit integer,
  rate_period interval,
  primary key (flow_slug, step_slug),
  foreign key (flow_slug, step_slug) references pgflow.steps (flow_slug, step_slug) on delete cascade,
  constraint key_limits_max_positive check (max_per_key > 0),
  constraint key_limits_path_not_empty check (cardinality(key_path) > 0),
  constraint key_limits_rate_positive check (rate_limit > 0 and rate_period > interval '0'),
  constraint key_limits_rate_complete check ((rate_limit is null) = (rate_period is null)),
  constraint key_limits_something check (max_per_key is not null or rate_limit is not null)
);

-- The token bucket of one key value of a step with a key rate: its tokens at refilled_at (they refill
-- continuously up to rate_limit). No row: a full bucket.
create table pgflow.key_buckets (
  limit_key text primary key,
  flow_slug text not null,
  step_slug text not null,
  tokens double precision not null,
  refilled_at timestamptz not null,
  foreign key (flow_slug, step_slug) references pgflow.key_limits (flow_slug, step_slug) on delete cascade
);
create index idx_key_buckets_idle on pgflow.key_buckets (flow_slug, step_slug, refilled_at);

-- One row per started task that a limit counts; deleted when the task leaves 'started' (the trigger below),
-- and with the task by the two paths that delete started tasks' rows (delete_flow_and_data, prune_history).
-- No foreign key to step_tasks: its check, one query per slot taken, cost more than the slot itself. The
-- primary key leads with the queue, so that it also counts a queue's slots.
create table pgflow.limit_slots (
  run_id uuid not null,
  step_slug text not null,
  task_index integer not null,
  queue_name text not null,
  -- flow/step/key for a task under a key limit; NULL otherwise.
  limit_key text,
  primary key (queue_name, run_id, step_slug, task_index)
);
create index idx_limit_slots_key on pgflow.limit_slots (limit_key) where limit_key is not null;

-- The messages of held tasks, hidden until a slot frees.
create table pgflow.parked_messages (
  queue_name text not null,
  msg_id bigint not null,
  limit_key text,
  parked_at timestamptz not null default clock_timestamp(),
  primary key (queue_name, msg_id)
);
create index idx_parked_messages_key on pgflow.parked_messages (queue_name, limit_key, parked_at);

-- The longest a held task's message stays hidden without a wake-up.
create function pgflow._park_seconds()
returns integer
language sql
immutable
set search_path = ''
as $$ select 10 $$;

-- The key of a task under its step's key limit: flow, step and the value at the limit's key_path in the run
-- input (`p_value`; NULL, a missing key, is the key ''). A step's keys all begin with
-- _limit_key(flow, step, ''). No SET options, so that the planner inlines it into the queries that call it.
create function pgflow._limit_key(p_flow_slug text, p_step_slug text, p_value text)
returns text
language sql
immutable parallel safe
as $$ select p_flow_slug || '/' || p_step_slug || '/' || coalesce(p_value, '') $$;

-- Sets (or replaces) the concurrency limit and the rate limit of queue `queue_name`: at most max_started of
-- its tasks started at once (NULL: none), at most rate_limit starts per rate_period (NULL: none). Refuses a
-- queue pgflow routes no task to, a limit below 1, a rate without a period and a period of zero or less.
create function pgflow.set_queue_limit(queue_name text, max_started integer default NULL::integer, rate_limit integer default NULL::integer, rate_period interval default NULL::interval)
returns pgflow.queue_limits
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_queue text := lower(set_queue_limit.queue_name);
  v_row pgflow.queue_limits;
begin
  if not exists (select 1 from pgflow.steps s where s.queue_name = v_queue) then
    raise exception 'set_queue_limit(): queue "%" is not a queue pgflow routes tasks to', set_queue_limit.queue_name
      using errcode = 'undefined_object',
            hint = 'Name the queue of a compiled flow''s step (pgflow.steps.queue_name).';
  end if;
  if set_queue_limit.max_started is null and set_queue_limit.rate_limit is null then
    raise exception 'set_queue_limit(): queue "%": give max_started, rate_limit or both (clear_queue_limit removes them)',
        v_queue using errcode = 'invalid_parameter_value';
  end if;
  if set_queue_limit.max_started < 1 then
    raise exception 'set_queue_limit(): queue "%": max_started must be at least 1, got %', v_queue,
        set_queue_limit.max_started
      using errcode = 'invalid_parameter_value', hint = 'To stop a queue, pause its workers; to lift the limit, clear it.';
  end if;
  if set_queue_limit.rate_limit < 1 then
    raise exception 'set_queue_limit(): queue "%": rate_limit must be at least 1 start per period, got %', v_queue,
        set_queue_limit.rate_limit
      using errcode = 'invalid_parameter_value';
  end if;
  if (set_queue_limit.rate_limit is null) <> (set_queue_limit.rate_period is null)
     or set_queue_limit.rate_period <= interval '0' then
    raise exception 'set_queue_limit(): queue "%": a rate needs both rate_limit and a positive rate_period, got % per %',
        v_queue, coalesce(set_queue_limit.rate_limit::text, 'NULL'), coalesce(set_queue_limit.rate_period::text, 'NULL')
      using errcode = 'invalid_parameter_value';
  end if;
  insert into pgflow.queue_limits as l (queue_name, max_started, rate_limit, rate_period, tokens, refilled_at)
  values (v_queue, set_queue_limit.max_started, set_queue_limit.rate_limit, set_queue_limit.rate_period,
          set_queue_limit.rate_limit, clock_timestamp())
  on conflict on constraint queue_limits_pkey do update
  set max_started = excluded.max_started, rate_limit = excluded.rate_limit, rate_period = excluded.rate_period,
      tokens = least(coalesce(l.tokens, excluded.tokens), excluded.tokens), refilled_at = excluded.refilled_at
  returning * into v_row;
  return v_row;
end;
$$;

-- Removes the limits of queue `queue_name`; whether it had any.
create function pgflow.clear_queue_limit(queue_name text)
returns boolean
language plpgsql
security definer
set search_path = ''
as $$
begin
  delete from pgflow.queue_limits l where l.queue_name = lower(clear_queue_limit.queue_name);
  return found;
end;
$$;

-- Sets (or replaces) the per-key limits of step `step_slug` of flow `flow_slug`, for its tasks whose run
-- input has the same value at key_path (as `input #>> key_path`; a missing key is the key ''): at most
-- max_per_key of them started at once (NULL: no concurrency limit), at most rate_limit starts per
-- rate_period (NULL: no rate; a token bucket per key value). Refuses an unknown flow or step, an empty path,
-- neither limit, a limit below 1, a rate without a period and a period of zero or less; nothing changes then.
-- A new rate caps the tokens each key has left at it; no rate drops the buckets. The step's parked messages
-- come back now (their claims decide again under the new limits).
create function pgflow.set_key_limit(flow_slug text, step_slug text, key_path text[], max_per_key integer default NULL::integer, rate_limit integer default NULL::integer, rate_period interval default NULL::interval)
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

-- Removes the per-key limits of a step (its parked messages come back now); whether it had any.
create function pgflow.clear_key_limit(flow_slug text, step_slug text)
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

-- Makes the parked messages of step `p_step_slug` of flow `p_flow_slug` visible now (its key limits just
-- changed or went: a message held for a token of the old rate may wait far longer than the new one asks).
-- Messages are taken with SKIP LOCKED: a message a claim holds is left to it.
create function pgflow._wake_parked_step(p_flow_slug text, p_step_slug text)
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

-- Whether a claim on `p_queue` must consult the limits (one index probe each; false on unlimited queues).
-- PL/pgSQL, so that its plan is cached for the session: every claim asks, and a SQL function that reads a
-- table is parsed and planned again in each statement that calls it.
create function pgflow._queue_limited(p_queue text)
returns boolean
language plpgsql
stable
set search_path = ''
as $$
begin
  return exists (select 1 from pgflow.queue_limits l where l.queue_name = p_queue)
      or exists (select 1 from pgflow.key_limits k
                 join pgflow.steps s on s.flow_slug = k.flow_slug and s.step_slug = k.step_slug
                 where s.queue_name = p_queue);
end;
$$;

-- How long a task whose key another claim holds stays hidden (seconds): about the time that claim takes to
-- commit. Its message then comes back to be read again; it is not parked (no slot need free for it).
create function pgflow._busy_key_seconds()
returns double precision
language sql
immutable
set search_path = ''
as $$ select 0.02::float8 $$;

-- The admission of a claim's batch on a limited queue, one row per task of the batch (`p_ids`, queued, their
-- messages and task rows locked by the caller, in message order, with their flows, steps and keys; `p_busy`:
-- the key is held by another claim). The tasks of a free key take turns (every key's first
-- task, then every key's second...); a task passes its key when its key has a free slot (max_per_key) and a
-- token (its bucket's tokens now, full without a row) for its turn; the queue's free slots and tokens
-- (`p_free`, NULL: unlimited) then go to the tasks that passed, in turns, so no key starves the others within a
-- batch. For each task held: until when to hide its message (a key's or the queue's next slot: park_seconds,
-- woken earlier by a freed slot; a key rate: the time its turn's token comes; the queue rate alone: the next
-- token; a busy key: _busy_key_seconds).
create function pgflow._limit_admission(p_ids bigint[], p_flows text[], p_steps text[], p_keys text[], p_busy boolean[], p_limit pgflow.queue_limits, p_free bigint, p_queue_tokens double precision, p_now timestamptz)
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

-- The admission of a claim on a limited queue: of the tasks behind `p_ids` (queued, about to be claimed, their
-- messages and task rows locked by the caller), returns the ids to HOLD and the time until which to hide each;
-- the admitted ones get a slot row (and lose any parked row) and spend their tokens. Lock order step 6: the
-- queue's limit row, the key limits of its steps (shared), then a try-lock per key of the batch; then the key
-- buckets of the keys it holds.
create function pgflow._apply_limits(p_queue text, p_ids bigint[])
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

-- Parks the visible messages of queue `p_queue` whose tasks belong to one of the full keys `p_keys` (every
-- slot taken), apart from the claim's batch `p_batch`, until `p_until` (a freed slot wakes them one by one,
-- as any parked message). Reads at most _park_scan_limit() visible messages, through the queue's vt index, so
-- one claim's cost stays bounded; the next held task of the key parks the rest. Messages are locked with SKIP
-- LOCKED and only while still visible: one that a claim holds, or has claimed, is left alone.
create function pgflow._park_key_backlog(p_queue text, p_keys text[], p_batch bigint[], p_until timestamptz)
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

-- The most visible messages one claim reads to park a full key's backlog.
create function pgflow._park_scan_limit()
returns integer
language sql
immutable
set search_path = ''
as $$ select 5000 $$;

-- The key buckets after a claim's admission (the caller holds the steps' key_limits rows, shared, and the
-- try-locks of the admitted tasks' keys): each key with a rate that admitted tasks keeps its tokens minus those
-- tasks as of `p_now`; and a few buckets of the same steps idle for a whole period (full again, the same as no
-- row) are deleted, skipping any that another claim has locked, so the table holds about the keys active within
-- the last period.
create function pgflow._spend_key_tokens(p_flows text[], p_steps text[], p_keys text[], p_tokens double precision[], p_admitted boolean[], p_now timestamptz)
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

-- Trigger of pgflow.step_tasks: a task leaving 'started' frees its slot and makes the oldest parked message of
-- its key visible again, and (for a queue limit) the oldest parked message of its queue. Parked messages are
-- taken with SKIP LOCKED: this never waits (a message another transaction holds comes back by its park time).
create function pgflow._free_limit_slot()
returns trigger
language plpgsql
set search_path = ''
as $$
declare
  v_slot pgflow.limit_slots;
  v_ids bigint[];
begin
  delete from pgflow.limit_slots s
  where s.queue_name = old.queue_name and s.run_id = old.run_id and s.step_slug = old.step_slug
    and s.task_index = old.task_index
  returning * into v_slot;
  -- No slot, or nothing parked on the queue (while the limits do not bind): nothing to wake.
  if v_slot is null
     or not exists (select 1 from pgflow.parked_messages pm where pm.queue_name = v_slot.queue_name) then
    return null;
  end if;
  select array_agg(x.msg_id order by x.msg_id) into v_ids
  from (
    (select pm.msg_id from pgflow.parked_messages pm
     where pm.queue_name = v_slot.queue_name and v_slot.limit_key is not null and pm.limit_key = v_slot.limit_key
     order by pm.parked_at limit 1)
    union
    (select pm.msg_id from pgflow.parked_messages pm
     where pm.queue_name = v_slot.queue_name
       and exists (select 1 from pgflow.queue_limits l where l.queue_name = v_slot.queue_name and l.max_started is not null)
     order by pm.parked_at limit 1)
  ) x;
  if v_ids is null then
    return null;
  end if;
  v_ids := pgflow._lock_messages(v_slot.queue_name, v_ids, true);
  if cardinality(v_ids) > 0 then
    delete from pgflow.parked_messages pm where pm.queue_name = v_slot.queue_name and pm.msg_id = any (v_ids);
    perform pgflow._queue_op(v_slot.queue_name, 'visibility', v_ids,
                             array(select clock_timestamp() from unnest(v_ids)), 0);
  end if;
  return null;
end;
$$;

create trigger step_tasks_free_limit_slot
after update of status on pgflow.step_tasks
for each row
when (old.status = 'started' and new.status is distinct from 'started')
execute function pgflow._free_limit_slot();

-- Schema-level default privileges cannot take EXECUTE away from PUBLIC: revoked here for the functions above.
revoke execute on all functions in schema pgflow from public;
