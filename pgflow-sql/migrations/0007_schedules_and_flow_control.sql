-- pgflow-rs SQL core: durable schedules and flow control.
--
-- * Schedules (pgflow.schedules, pgflow.schedule_fires): a flow or alias, a cron expression with a time zone,
--   an input, a missed-fire policy and an overlap policy. Any worker fires due schedules; exactly one run
--   starts per (schedule, fire time). set_schedule, pause_schedule, resume_schedule, delete_schedule,
--   due_schedules, fire_schedule.
-- * The worker role may declare and fire schedules.
-- * Flow control (pgflow.queue_limits, pgflow.key_limits, pgflow.limit_slots, pgflow.parked_messages):
--   concurrency limits per queue and per key (a value of the run input), and a token-bucket rate limit per
--   queue, enforced inside the claim of pgflow-rs workers (_claim_tasks); held tasks are not claimed, spend
--   no attempt, and their messages stay hidden until a slot frees (trigger step_tasks_free_limit_slot).
--   set_queue_limit, clear_queue_limit, set_key_limit, clear_key_limit (the schema owner's).

-- The functions a worker calls: compilation, registration and heartbeats, claiming, results, recovery and
-- retention. Signatures as regprocedure text; a change that adds an entry point adds it here.
create or replace function pgflow._worker_api()
returns text[]
language sql
immutable
as $$
  select array[
    'pgflow.ensure_flow_compiled(text,jsonb,boolean,text,jsonb,text,boolean)',
    'pgflow.activate_alias(text,text)',
    'pgflow.flow_routes(text)',
    'pgflow.resolve_step_queues(text,text[])',
    'pgflow.register_worker(uuid,text,text,text[],text[])',
    'pgflow.queue_coverage_gaps(text,text[],text[])',
    'pgflow.version_retirable(text,text)',
    'pgflow.track_worker_function(text)',
    'pgflow.worker_heartbeat(uuid)',
    'pgflow.mark_worker_stopped(uuid)',
    'pgflow.disable_worker_function(text,text)',
    'pgflow.claim_tasks(text,bigint[],uuid,text[],text[])',
    'pgflow.read_and_claim_tasks(text,integer,integer,uuid,text[],text[])',
    'pgflow.exchange(text,uuid,text[],text[],integer,integer,uuid[],text[],integer[],jsonb[],integer[])',
    'pgflow.start_tasks(text,bigint[],uuid)',
    'pgflow.start_tasks(text,bigint[],uuid,text)',
    'pgflow.set_vt_batch(text,bigint[],integer[])',
    'pgflow.complete_task(uuid,text,integer,jsonb)',
    'pgflow.complete_task(uuid,text,integer,jsonb,integer,uuid)',
    'pgflow.complete_tasks(uuid[],text[],integer[],jsonb[],integer[],uuid)',
    'pgflow.fail_task(uuid,text,integer,text)',
    'pgflow.fail_task(uuid,text,integer,text,integer,uuid,integer,boolean)',
    'pgflow.release_worker_tasks(uuid)',
    'pgflow.requeue_stalled_tasks()',
    'pgflow.requeue_dead_worker_tasks(interval)',
    'pgflow.run_maintenance(interval,interval,integer)',
    'pgflow.cancelled_tasks(uuid[],text[],integer[],integer[])',
    'pgflow.queue_stats()',
    'pgflow.set_schedule(text,text,text,text,jsonb,text,integer,text,timestamp with time zone)',
    'pgflow.due_schedules(timestamp with time zone,integer)',
    'pgflow.fire_schedule(text,timestamp with time zone,timestamp with time zone[],timestamp with time zone,text)'
  ]
$$;

-- ---- as in schema/15_schedules.sql ----
-- Schedules: durable cron schedules that start runs, fired by any worker, exactly once per fire time.
--
-- A schedule names a flow slug or an alias (resolved at each fire), a cron expression with a time zone, an
-- input, and two policies:
--   missed   'skip'      fires missed during downtime are dropped; the schedule goes on with its next fire
--            'catch_up'  at most catch_up_max of the missed fires (the most recent ones) start runs
--   overlap  'allow'     every fire starts a run
--            'skip'      a fire is recorded as skipped while the schedule's previous run is still started
--
-- Cron arithmetic (fields, time zones, daylight-saving transitions) is not done here: workers compute fire
-- times with a cron library and pass them in. The database keeps what must be agreed on: the schedule, its
-- next fire time, and one row per fire time (primary key (schedule_name, fire_at)). fire_schedule locks the
-- schedule row, checks the next fire time the worker computed from, records the fires and starts their runs
-- in one transaction: of several workers firing the same schedule, one starts the runs and the others find
-- the next fire time moved on and do nothing. No leader, no pg_cron.
--
-- Lock order: a schedule row (FOR UPDATE) is taken before any run (step 1b of the order in 07_claims.sql);
-- starting a run takes no lock that waits.
--
-- Owns: the tables schedules and schedule_fires; set_schedule, pause_schedule, resume_schedule,
-- delete_schedule (the operator's), due_schedules and fire_schedule (the workers').

create table pgflow.schedules (
  schedule_name text primary key,
  flow_slug text not null,
  cron text not null,
  time_zone text not null default 'UTC',
  input jsonb not null default '{}'::jsonb,
  missed text not null default 'skip',
  catch_up_max integer not null default 1,
  overlap text not null default 'allow',
  paused boolean not null default false,
  -- NULL: not computed yet (a schedule created in SQL, or resumed); the next worker tick computes it.
  next_fire_at timestamptz,
  last_fire_at timestamptz,
  last_run_id uuid,
  -- Why a worker paused the schedule (its cron expression or time zone could not be parsed), if it did.
  last_error text,
  created_at timestamptz not null default now(),
  updated_at timestamptz not null default now(),
  constraint schedules_name_valid check (schedule_name ~ '^[A-Za-z0-9_.:-]{1,128}$'),
  constraint schedules_missed_valid check (missed in ('skip', 'catch_up')),
  constraint schedules_catch_up_max_valid check (catch_up_max between 1 and 1000),
  constraint schedules_overlap_valid check (overlap in ('allow', 'skip'))
);

-- Workers look for due schedules on every tick.
create index idx_schedules_due on pgflow.schedules (next_fire_at) where not paused;

-- One row per (schedule, fire time) that was fired: the run it started, or why it started none.
create table pgflow.schedule_fires (
  schedule_name text not null references pgflow.schedules (schedule_name) on delete cascade,
  fire_at timestamptz not null,
  run_id uuid,
  outcome text not null,
  fired_at timestamptz not null default clock_timestamp(),
  primary key (schedule_name, fire_at),
  constraint schedule_fires_outcome_valid check (outcome in ('started', 'skipped_overlap')),
  constraint schedule_fires_run_when_started check ((outcome = 'started') = (run_id is not null))
);

-- The shape check of a cron expression that SQL can make: 5 to 7 fields of cron characters, or a nickname
-- (@hourly...). The full parse is the worker's (and the Rust API's, which refuses an invalid expression
-- before it reaches the database); a worker that cannot parse a stored expression pauses the schedule with
-- last_error set.
create function pgflow._cron_shape_valid(p_cron text)
returns boolean
language sql
immutable
set search_path = ''
as $$
  select p_cron is not null and (
    lower(btrim(p_cron)) in ('@yearly', '@annually', '@monthly', '@weekly', '@daily', '@midnight', '@hourly')
    or (cardinality(regexp_split_to_array(btrim(p_cron), '\s+')) between 5 and 7
        and btrim(p_cron) ~ '^[0-9A-Za-z*/,?#-]+(\s+[0-9A-Za-z*/,?#-]+)*$'))
$$;

-- Creates the schedule `schedule_name`, or replaces its definition (flow, cron, zone, input, policies), and
-- returns its row. A changed cron or time zone recomputes the next fire (next_fire_at, or NULL for the next
-- worker tick to compute); an unchanged one keeps it, so a worker declaring its schedules at every start does
-- not move them. Pause state is kept. Bad input (an unknown flow or alias, a malformed cron expression, an
-- unknown time zone, an unknown policy, a catch-up limit outside 1..1000) raises 22023 or 42704 quoting it
-- and changes nothing.
create function pgflow.set_schedule(
  schedule_name text,
  flow_slug text,
  cron text,
  time_zone text default 'UTC',
  input jsonb default '{}'::jsonb,
  missed text default 'skip',
  catch_up_max integer default 1,
  overlap text default 'allow',
  next_fire_at timestamptz default NULL::timestamptz
)
returns pgflow.schedules
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_row pgflow.schedules;
begin
  if set_schedule.schedule_name is null or set_schedule.schedule_name !~ '^[A-Za-z0-9_.:-]{1,128}$' then
    raise exception 'set_schedule(): invalid schedule name "%"', coalesce(set_schedule.schedule_name, 'NULL')
      using errcode = 'invalid_parameter_value',
            hint = 'Use 1 to 128 letters, digits, "_", ".", ":" or "-".';
  end if;
  if set_schedule.flow_slug is null or not exists (
       select 1 from pgflow.flows f where f.flow_slug = pgflow.resolve_flow_slug(set_schedule.flow_slug)) then
    raise exception 'set_schedule(): schedule "%" names flow or alias "%", which is not compiled',
        set_schedule.schedule_name, coalesce(set_schedule.flow_slug, 'NULL')
      using errcode = 'undefined_object',
            hint = 'Compile the flow (start a worker that serves it) or activate the alias first.';
  end if;
  if not pgflow._cron_shape_valid(set_schedule.cron) then
    raise exception 'set_schedule(): invalid cron expression "%" for schedule "%"',
        coalesce(set_schedule.cron, 'NULL'), set_schedule.schedule_name
      using errcode = 'invalid_parameter_value',
            hint = 'Use 5 fields (minute hour day-of-month month day-of-week), 6 with seconds first, or @hourly, @daily...';
  end if;
  if set_schedule.time_zone is null
     or not exists (select 1 from pg_catalog.pg_timezone_names z where z.name = set_schedule.time_zone) then
    raise exception 'set_schedule(): unknown time zone "%" for schedule "%"',
        coalesce(set_schedule.time_zone, 'NULL'), set_schedule.schedule_name
      using errcode = 'invalid_parameter_value',
            hint = 'Use an IANA time zone name such as "UTC" or "Europe/Paris".';
  end if;
  if set_schedule.missed is null or set_schedule.missed not in ('skip', 'catch_up') then
    raise exception 'set_schedule(): missed-fire policy "%" of schedule "%" is neither "skip" nor "catch_up"',
        coalesce(set_schedule.missed, 'NULL'), set_schedule.schedule_name
      using errcode = 'invalid_parameter_value';
  end if;
  if set_schedule.catch_up_max is null or set_schedule.catch_up_max not between 1 and 1000 then
    raise exception 'set_schedule(): catch_up_max of schedule "%" must be 1 to 1000, got %',
        set_schedule.schedule_name, coalesce(set_schedule.catch_up_max::text, 'NULL')
      using errcode = 'invalid_parameter_value';
  end if;
  if set_schedule.overlap is null or set_schedule.overlap not in ('allow', 'skip') then
    raise exception 'set_schedule(): overlap policy "%" of schedule "%" is neither "allow" nor "skip"',
        coalesce(set_schedule.overlap, 'NULL'), set_schedule.schedule_name
      using errcode = 'invalid_parameter_value';
  end if;
  if set_schedule.input is null then
    raise exception 'set_schedule(): schedule "%" has a NULL input', set_schedule.schedule_name
      using errcode = 'invalid_parameter_value', hint = 'Pass the run input as JSON (''{}'' for none).';
  end if;

  insert into pgflow.schedules as s (schedule_name, flow_slug, cron, time_zone, input, missed, catch_up_max,
                                     overlap, next_fire_at)
  values (set_schedule.schedule_name, set_schedule.flow_slug, btrim(set_schedule.cron), set_schedule.time_zone,
          set_schedule.input, set_schedule.missed, set_schedule.catch_up_max, set_schedule.overlap,
          set_schedule.next_fire_at)
  on conflict on constraint schedules_pkey do update
  set flow_slug = excluded.flow_slug,
      input = excluded.input,
      missed = excluded.missed,
      catch_up_max = excluded.catch_up_max,
      overlap = excluded.overlap,
      cron = excluded.cron,
      time_zone = excluded.time_zone,
      next_fire_at = case when s.cron = excluded.cron and s.time_zone = excluded.time_zone
                          then coalesce(s.next_fire_at, excluded.next_fire_at)
                          else excluded.next_fire_at end,
      last_error = case when s.cron = excluded.cron and s.time_zone = excluded.time_zone
                        then s.last_error end,
      updated_at = now()
  returning * into v_row;
  return v_row;
end;
$$;

-- Locks the schedule row `p_name` (lock order 1b) or raises 42704 naming it.
create function pgflow._lock_schedule(p_name text, p_caller text)
returns pgflow.schedules
language plpgsql
set search_path = ''
as $$
declare
  v_row pgflow.schedules;
begin
  select * into v_row from pgflow.schedules s where s.schedule_name = p_name for update;
  if not found then
    raise exception '%(): no schedule "%"', p_caller, coalesce(p_name, 'NULL')
      using errcode = 'undefined_object',
            hint = 'select schedule_name from pgflow.schedules lists the schedules.';
  end if;
  return v_row;
end;
$$;

-- Pauses a schedule: no fire starts a run until it is resumed.
create function pgflow.pause_schedule(schedule_name text)
returns pgflow.schedules
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_row pgflow.schedules;
begin
  perform pgflow._lock_schedule(pause_schedule.schedule_name, 'pause_schedule');
  update pgflow.schedules s set paused = true, updated_at = now()
  where s.schedule_name = pause_schedule.schedule_name
  returning * into v_row;
  return v_row;
end;
$$;

-- Resumes a schedule. Its next fire is computed afresh from the time of the next worker tick: fires that fell
-- while it was paused are not caught up.
create function pgflow.resume_schedule(schedule_name text)
returns pgflow.schedules
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_row pgflow.schedules;
begin
  perform pgflow._lock_schedule(resume_schedule.schedule_name, 'resume_schedule');
  update pgflow.schedules s
  set paused = false, next_fire_at = null, last_error = null, updated_at = now()
  where s.schedule_name = resume_schedule.schedule_name and s.paused
  returning * into v_row;
  if v_row is null then
    select * into v_row from pgflow.schedules s where s.schedule_name = resume_schedule.schedule_name;
  end if;
  return v_row;
end;
$$;

-- Deletes a schedule and its fire records (not the runs it started). Returns whether it existed.
create function pgflow.delete_schedule(schedule_name text)
returns boolean
language plpgsql
security definer
set search_path = ''
as $$
begin
  delete from pgflow.schedules s where s.schedule_name = delete_schedule.schedule_name;
  return found;
end;
$$;

-- The schedules a worker should fire at `as_of`: not paused, and due (next_fire_at <= as_of) or without a next
-- fire time yet. At most `max_rows`, most overdue first. Reads only; fire_schedule decides under the lock.
create function pgflow.due_schedules(as_of timestamptz, max_rows integer default 100)
returns table(schedule_name text, cron text, time_zone text, missed text, catch_up_max integer, next_fire_at timestamptz)
language sql
stable
security definer
set search_path = ''
as $$
  select s.schedule_name, s.cron, s.time_zone, s.missed, s.catch_up_max, s.next_fire_at
  from pgflow.schedules s
  where not s.paused and (s.next_fire_at is null or s.next_fire_at <= due_schedules.as_of)
  order by s.next_fire_at nulls first, s.schedule_name
  limit greatest(coalesce(due_schedules.max_rows, 100), 0)
$$;

-- Fires schedule `schedule_name` in one transaction, if its next fire time is still `expected_next_fire_at`
-- (the one the worker computed from; NULL for a schedule without one yet): records each of `fire_times`
-- (one row per (schedule, fire time): a time already recorded is never fired again), starts one run per fire
-- (or records 'skipped_overlap' while the schedule's previous run is started and overlap is 'skip'), and sets
-- the next fire time to `next_fire_at`. With `error` set, the schedule is paused with last_error instead (its
-- cron expression or time zone could not be parsed). Returns one row per recorded fire; nothing when another
-- worker fired first, or the schedule is paused or gone.
create function pgflow.fire_schedule(
  schedule_name text,
  expected_next_fire_at timestamptz,
  fire_times timestamptz[],
  next_fire_at timestamptz,
  error text default NULL::text
)
returns table(fire_at timestamptz, run_id uuid, outcome text)
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_row pgflow.schedules;
  v_at timestamptz;
  v_run uuid;
  v_last_run uuid;
  v_last_at timestamptz;
begin
  -- Lock order 1b: the schedule row, before any run.
  select * into v_row from pgflow.schedules s where s.schedule_name = fire_schedule.schedule_name for update;
  if not found or v_row.paused
     or v_row.next_fire_at is distinct from fire_schedule.expected_next_fire_at then
    return;
  end if;
  if fire_schedule.error is not null then
    update pgflow.schedules s set paused = true, last_error = fire_schedule.error, updated_at = now()
    where s.schedule_name = fire_schedule.schedule_name;
    return;
  end if;
  if fire_schedule.next_fire_at is null
     or fire_schedule.next_fire_at <= coalesce(fire_schedule.expected_next_fire_at, '-infinity') then
    raise exception 'fire_schedule(): schedule "%" must move its next fire forward (from % to %)',
        fire_schedule.schedule_name, coalesce(fire_schedule.expected_next_fire_at::text, 'NULL'),
        coalesce(fire_schedule.next_fire_at::text, 'NULL')
      using errcode = 'invalid_parameter_value';
  end if;

  v_last_run := v_row.last_run_id;
  v_last_at := v_row.last_fire_at;
  for v_at in select distinct t from unnest(coalesce(fire_schedule.fire_times, '{}')) as t
              where t is not null order by t loop
    if v_row.overlap = 'skip' and v_last_run is not null
       and exists (select 1 from pgflow.runs r where r.run_id = v_last_run and r.status = 'started') then
      insert into pgflow.schedule_fires as f (schedule_name, fire_at, run_id, outcome)
      values (v_row.schedule_name, v_at, null, 'skipped_overlap')
      on conflict do nothing;
      if found then
        return query select v_at, null::uuid, 'skipped_overlap'::text;
      end if;
    else
      v_run := gen_random_uuid();
      insert into pgflow.schedule_fires as f (schedule_name, fire_at, run_id, outcome)
      values (v_row.schedule_name, v_at, v_run, 'started')
      on conflict do nothing;
      if found then
        perform pgflow.start_flows(v_row.flow_slug, array[v_row.input], array[v_run]);
        v_last_run := v_run;
        return query select v_at, v_run, 'started'::text;
      end if;
    end if;
    v_last_at := greatest(v_last_at, v_at);
  end loop;

  update pgflow.schedules s
  set next_fire_at = fire_schedule.next_fire_at, last_fire_at = v_last_at, last_run_id = v_last_run,
      updated_at = now()
  where s.schedule_name = fire_schedule.schedule_name;
end;
$$;

-- Schema-level default privileges cannot take EXECUTE away from PUBLIC: revoked here for the functions above.
revoke execute on all functions in schema pgflow from public;

-- ---- as in schema/16_flow_control.sql ----
-- Flow control: concurrency limits per queue and per key, and a rate limit per queue, enforced by the
-- database inside the claim, across every worker process.
--
--   queue limit   pgflow.queue_limits.max_started: at most that many tasks of the queue started at once
--   key limit     pgflow.key_limits: a step's tasks whose run input has the same value at key_path (a tenant
--                 id, say) are started at most max_per_key at once; other keys are not blocked
--   rate limit    pgflow.queue_limits.rate_limit per rate_period: a token bucket of the queue (at most
--                 rate_limit starts in any period; tokens refill continuously)
--
-- How a claim enforces them (pgflow._claim_tasks calls pgflow._apply_limits for the tasks it is about to
-- claim, only on a queue with a limit): the limit rows are locked (serialising the claims of one limited
-- queue), the running tasks counted from pgflow.limit_slots (one row per started task under a limit), and the
-- batch's tasks admitted in turns by key (each key's first task, then each key's second...) while slots and
-- tokens last. Admitted tasks get a slot row and are claimed. The others are HELD: not claimed, no attempt
-- spent, reported as 'waiting', and their messages parked (pgflow.parked_messages): hidden until a slot of
-- their key or queue frees, when the task that held the slot leaves 'started' (trigger
-- step_tasks_free_limit_slot makes the oldest parked message of that key, and of the queue, visible again),
-- or for a rate limit until the next token. A parked message also comes back after park_seconds() at the
-- latest, so nothing depends on the wake-up alone; there is no busy loop: a held message is hidden, and the
-- next read reaches the messages behind it (no head-of-line blocking).
--
-- Limits apply to the claims of pgflow-rs workers (claim_tasks, read_and_claim_tasks, exchange); upstream's
-- start_tasks does not consult them. Tasks already started when a limit is set hold no slot.
--
-- Lock order: the limit rows (queue_limits, then key_limits in (flow, step) order, FOR UPDATE) are step 6,
-- after the claim's messages and tasks; only claims and the set_* functions lock them. The slot trigger runs
-- where a task leaves 'started' (holding that task) and takes parked messages with SKIP LOCKED only.
--
-- Owns: queue_limits, key_limits, limit_slots, parked_messages; set_queue_limit, set_key_limit,
-- clear_queue_limit, clear_key_limit; _queue_limited, _apply_limits, _park_messages, _free_limit_slot.

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
  max_per_key integer not null,
  primary key (flow_slug, step_slug),
  foreign key (flow_slug, step_slug) references pgflow.steps (flow_slug, step_slug) on delete cascade,
  constraint key_limits_max_positive check (max_per_key > 0),
  constraint key_limits_path_not_empty check (cardinality(key_path) > 0)
);

-- One row per started task that a limit counts; deleted when the task leaves 'started' (or is deleted).
create table pgflow.limit_slots (
  run_id uuid not null,
  step_slug text not null,
  task_index integer not null,
  queue_name text not null,
  -- flow/step/key for a task under a key limit; NULL otherwise.
  limit_key text,
  primary key (run_id, step_slug, task_index),
  foreign key (run_id, step_slug, task_index) references pgflow.step_tasks (run_id, step_slug, task_index)
    on delete cascade
);
create index idx_limit_slots_queue on pgflow.limit_slots (queue_name);
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

-- Sets (or replaces) the per-key limit of step `step_slug` of flow `flow_slug`: at most max_per_key of its
-- tasks whose run input has the same value at key_path (as `input #>> key_path`; a missing key is the key
-- '') started at once. Refuses an unknown flow or step, an empty path and a limit below 1.
create function pgflow.set_key_limit(flow_slug text, step_slug text, key_path text[], max_per_key integer)
returns pgflow.key_limits
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_row pgflow.key_limits;
begin
  if not exists (select 1 from pgflow.steps s
                 where s.flow_slug = set_key_limit.flow_slug and s.step_slug = set_key_limit.step_slug) then
    raise exception 'set_key_limit(): flow "%" has no step "%"', set_key_limit.flow_slug, set_key_limit.step_slug
      using errcode = 'undefined_object', hint = 'Name a concrete flow slug (not an alias) and one of its steps.';
  end if;
  if set_key_limit.key_path is null or cardinality(set_key_limit.key_path) = 0 then
    raise exception 'set_key_limit(): step "%" of flow "%": key_path is empty; name where the key is in the run input, e.g. ''{tenant}''',
        set_key_limit.step_slug, set_key_limit.flow_slug
      using errcode = 'invalid_parameter_value';
  end if;
  if set_key_limit.max_per_key is null or set_key_limit.max_per_key < 1 then
    raise exception 'set_key_limit(): step "%" of flow "%": max_per_key must be at least 1, got %',
        set_key_limit.step_slug, set_key_limit.flow_slug, coalesce(set_key_limit.max_per_key::text, 'NULL')
      using errcode = 'invalid_parameter_value';
  end if;
  insert into pgflow.key_limits as k (flow_slug, step_slug, key_path, max_per_key)
  values (set_key_limit.flow_slug, set_key_limit.step_slug, set_key_limit.key_path, set_key_limit.max_per_key)
  on conflict on constraint key_limits_pkey do update
  set key_path = excluded.key_path, max_per_key = excluded.max_per_key
  returning * into v_row;
  return v_row;
end;
$$;

-- Removes the per-key limit of a step; whether it had one.
create function pgflow.clear_key_limit(flow_slug text, step_slug text)
returns boolean
language plpgsql
security definer
set search_path = ''
as $$
begin
  delete from pgflow.key_limits k
  where k.flow_slug = clear_key_limit.flow_slug and k.step_slug = clear_key_limit.step_slug;
  return found;
end;
$$;

-- Whether a claim on `p_queue` must consult the limits (one index probe each; false on unlimited queues).
create function pgflow._queue_limited(p_queue text)
returns boolean
language sql
stable
set search_path = ''
as $$
  select exists (select 1 from pgflow.queue_limits l where l.queue_name = p_queue)
      or exists (select 1 from pgflow.key_limits k
                 join pgflow.steps s on s.flow_slug = k.flow_slug and s.step_slug = k.step_slug
                 where s.queue_name = p_queue)
$$;

-- The admission of a claim on a limited queue: of the tasks behind `p_ids` (queued, about to be claimed, their
-- messages and task rows locked by the caller), returns the ids to HOLD and the time until which to hide each;
-- the admitted ones get a slot row (and lose any parked row). Locks the limit rows (lock order step 6).
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
  v_steps text[];
  v_indexes integer[];
  v_keys text[];
  v_admitted boolean[];
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

  -- The batch's admission, in arrays (one entry per task, in message order).
  with cand as (
    select t.message_id as id, t.run_id, t.step_slug, t.task_index, k.max_per_key,
           case when k.flow_slug is not null
                then t.flow_slug || '/' || t.step_slug || '/' || coalesce(r.input #>> k.key_path, '') end as limit_key
    from pgflow.step_tasks t
    join pgflow.runs r on r.run_id = t.run_id
    left join pgflow.key_limits k on k.flow_slug = t.flow_slug and k.step_slug = t.step_slug
    where t.queue_name = p_queue and t.message_id = any (p_ids)
  ),
  per_key as (
    select c.*, row_number() over (partition by coalesce(c.limit_key, c.id::text) order by c.id) as turn,
           (select count(*) from pgflow.limit_slots s where s.limit_key = c.limit_key) as running
    from cand c
  ),
  key_ok as (
    select p.*, (p.limit_key is null or p.running + p.turn <= p.max_per_key) as ok from per_key p
  ),
  -- The queue's free slots and tokens go to the key-admitted tasks in turns: every key's first task, then
  -- every key's second... (keys take turns; no key starves the others within a batch).
  ranked as (
    select k.*, case when k.ok then row_number() over (partition by k.ok order by k.turn, k.id) end as place
    from key_ok k
  )
  select array_agg(r.id order by r.id), array_agg(r.run_id order by r.id), array_agg(r.step_slug order by r.id),
         array_agg(r.task_index order by r.id), array_agg(r.limit_key order by r.id),
         array_agg(r.ok and (v_free is null or r.place <= v_free) order by r.id)
  into v_ids, v_runs, v_steps, v_indexes, v_keys, v_admitted
  from ranked r;

  insert into pgflow.limit_slots (run_id, step_slug, task_index, queue_name, limit_key)
  select a.run_id, a.step_slug, a.task_index, p_queue, a.limit_key
  from unnest(v_runs, v_steps, v_indexes, v_keys, v_admitted) as a(run_id, step_slug, task_index, limit_key, admitted)
  where a.admitted and (v_limit.max_started is not null or a.limit_key is not null)
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

  -- Held ones: parked until a slot frees (at most park_seconds), or until the next token when only the rate
  -- held them back.
  insert into pgflow.parked_messages as pm (queue_name, msg_id, limit_key)
  select p_queue, a.id, a.limit_key
  from unnest(v_ids, v_keys, v_admitted) as a(id, limit_key, admitted)
  where not a.admitted
  on conflict on constraint parked_messages_pkey do update set parked_at = excluded.parked_at;

  return query
  select a.id,
         case when v_limit.rate_limit is not null and v_limit.max_started is null and a.limit_key is null
              then v_now + make_interval(secs => greatest(0.05, (1 - (v_tokens - floor(v_tokens)))
                                                           * extract(epoch from v_limit.rate_period)
                                                           / v_limit.rate_limit))
              else v_now + make_interval(secs => pgflow._park_seconds())
         end
  from unnest(v_ids, v_keys, v_admitted) as a(id, limit_key, admitted)
  where not a.admitted
  order by a.id;
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
  where s.run_id = old.run_id and s.step_slug = old.step_slug and s.task_index = old.task_index
  returning * into v_slot;
  if v_slot is null then
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

-- ---- the claim consults flow control (schema/07_claims.sql) ----
-- The classifying claim behind claim_tasks, read_and_claim_tasks and exchange. read_vt NULL: the caller read
-- the messages in an earlier transaction, so they are locked here first. read_vt set: this transaction's
-- locking read holds them; each is counted as read (read_ct, last_read_at) and the ones not claimed, deferred
-- or released stay invisible for read_vt seconds, as after pgmq.read. Queue statements go through the
-- queue's statements function.
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
