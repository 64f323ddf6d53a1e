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
