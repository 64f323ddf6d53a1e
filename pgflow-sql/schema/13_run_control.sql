-- Run control: cancelling runs (one, or many by filter), retrying a failed or cancelled run in place,
-- replaying a run from a step, idempotent starts, and the check through which workers learn that the tasks
-- they run are no longer current.
--
-- Owns: cancel_run, cancel_runs, retry_run, replay_run, start_flows_with_keys, cancelled_tasks and their
-- helpers. Every transition takes its locks in the order written at the top of 07_claims.sql (the run row
-- first, then the messages of the run's tasks, then the tasks, then step states), and every result a worker
-- records afterwards stays fenced: a cancelled task, or a task sent back to the queue by retry_run, is not
-- `started` at the attempt the worker holds, so its late result is 'stale' and changes nothing.
--
-- Error codes (SQLSTATE):
--   PF031  no such run (never started, or removed by retention)
--   PF032  the run cannot be retried in its state (still started, or completed: replay it instead)
--   PF033  the run's flow version is gone (a queue of a step that would run again no longer exists)
--   PF034  replay from a step the run's flow does not have
--   PF035  an idempotency key was used before with another input
--   PF036  a replay is impossible: a step it would copy did not complete in the original run

-- Cancels one started run, holding its run row (lock order 2): the run becomes `cancelled` with its reason and
-- time; its queued and started tasks become `cancelled` and their messages are archived (_terminate_tasks:
-- messages, then tasks); steps not yet started never start (nothing starts a step of a run that is not
-- started). Emits `run:cancelled`. Returns false, changing nothing, for a run that is not started.
create function pgflow._cancel_run(p_run_id uuid, p_reason text)
returns boolean
language plpgsql
set search_path = ''
as $$
declare
  v_run pgflow.runs;
begin
  update pgflow.runs r
  set status = 'cancelled', cancelled_at = now(), cancel_reason = p_reason
  where r.run_id = p_run_id and r.status = 'started'
  returning r.* into v_run;
  if not found then
    return false;
  end if;

  perform pgflow._terminate_tasks(p_run_id, null, 'cancelled');

  perform pgflow._emit('run:cancelled', p_run_id, jsonb_strip_nulls(jsonb_build_object(
    'event_type', 'run:cancelled',
    'run_id', v_run.run_id,
    'flow_slug', v_run.flow_slug,
    'status', 'cancelled',
    'cancel_reason', v_run.cancel_reason,
    'cancelled_at', v_run.cancelled_at
  )));
  return true;
end;
$$;

-- Cancels run `run_id` with `reason`, in one transaction (see _cancel_run). Idempotent: a run that is already
-- finished (completed, failed or cancelled) is left as it is. Returns one row: the run's status afterwards,
-- whether this call cancelled it, and the cancel reason and time (of this call, or of the earlier cancel).
-- An unknown run raises PF031.
create function pgflow.cancel_run(run_id uuid, reason text default NULL::text)
returns table(status text, changed boolean, cancel_reason text, cancelled_at timestamp with time zone)
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_status text;
  v_changed boolean := false;
begin
  -- Lock order 2: the run row.
  select r.status into v_status
  from pgflow.runs r
  where r.run_id = cancel_run.run_id
  for no key update;
  if not found then
    raise exception 'cancel_run(%): no such run', cancel_run.run_id
      using errcode = 'PF031',
            hint = 'Check the run id; a finished run is removed by retention (prune_history) after its window.';
  end if;

  if v_status = 'started' then
    v_changed := pgflow._cancel_run(cancel_run.run_id, cancel_run.reason);
  end if;

  return query
  select r.status, v_changed, r.cancel_reason, r.cancelled_at
  from pgflow.runs r
  where r.run_id = cancel_run.run_id;
end;
$$;

-- Cancels, in one bounded batch, up to `max_runs` started runs matching every filter given (NULL: no filter):
--   flow_slug       a concrete flow slug, or an alias (the runs of the version it points at, and of any concrete
--                   flow of that name)
--   status          the runs' status; only 'started' runs can be cancelled, so any other value is refused
--   started_before  runs started before this time
--   input_path, input_value   runs whose input at that JSON path (#>) equals the value
-- Runs another transaction holds are skipped (the next batch finds them). Returns how many runs this call
-- cancelled: call it again until it returns 0 to cancel every match. Run rows are locked first, in run-id
-- order (lock order 2), then each run is cancelled as by cancel_run.
--
-- With dry_run it changes and locks nothing and returns how many started runs match now: what calls until
-- done would cancel (max_runs bounds a real call only). The same selection serves both.
create function pgflow.cancel_runs(
  flow_slug text default NULL::text,
  status text default 'started'::text,
  started_before timestamp with time zone default NULL::timestamp with time zone,
  input_path text[] default NULL::text[],
  input_value jsonb default NULL::jsonb,
  reason text default NULL::text,
  max_runs integer default 1000,
  dry_run boolean default false
)
returns integer
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_slug text;
  v_ids uuid[];
  v_id uuid;
  v_count int := 0;
  v_select constant text := 'select r.run_id from pgflow.runs r
    where r.status = ''started''
      and ($1 is null or r.flow_slug = $2 or lower(r.flow_slug) = lower($1))
      and ($3 is null or r.started_at < $3)
      and ($4 is null or r.input #> $4 = $5)';
begin
  if cancel_runs.dry_run is null then
    raise exception 'cancel_runs(): dry_run must be true or false, not NULL'
      using errcode = 'invalid_parameter_value';
  end if;
  if cancel_runs.status is not null and cancel_runs.status <> 'started' then
    raise exception 'cancel_runs(): only started runs can be cancelled (status filter %)', cancel_runs.status
      using errcode = 'invalid_parameter_value',
            hint = 'Pass status => ''started'' or NULL; completed, failed and cancelled runs are already finished.';
  end if;
  if (cancel_runs.input_path is null) <> (cancel_runs.input_value is null) then
    raise exception 'cancel_runs(): input_path and input_value go together (got path %, value %)',
      cancel_runs.input_path, cancel_runs.input_value
      using errcode = 'invalid_parameter_value',
            hint = 'Pass both, e.g. input_path => ''{customer,id}'', input_value => ''42''.';
  end if;
  if coalesce(cancel_runs.max_runs, 0) < 1 then
    raise exception 'cancel_runs(): max_runs must be at least 1 (got %)', cancel_runs.max_runs
      using errcode = 'invalid_parameter_value';
  end if;
  if cancel_runs.flow_slug is not null then
    v_slug := coalesce((select a.flow_slug from pgflow.flow_aliases a
                        where lower(a.alias) = lower(cancel_runs.flow_slug)), cancel_runs.flow_slug);
  end if;

  if cancel_runs.dry_run then
    execute 'select count(*) from (' || v_select || ') x'
    into v_count
    using cancel_runs.flow_slug, v_slug, cancel_runs.started_before, cancel_runs.input_path,
          cancel_runs.input_value;
    return v_count;
  end if;

  execute 'select array_agg(x.run_id order by x.run_id) from (' || v_select
          || ' order by r.run_id limit $6 for no key update skip locked) x'
  into v_ids
  using cancel_runs.flow_slug, v_slug, cancel_runs.started_before, cancel_runs.input_path,
        cancel_runs.input_value, cancel_runs.max_runs;

  foreach v_id in array coalesce(v_ids, '{}') loop
    if pgflow._cancel_run(v_id, cancel_runs.reason) then
      v_count := v_count + 1;
    end if;
  end loop;
  return v_count;
end;
$$;

-- Sends task messages for tasks that exist already (retry_run): one message per task on the task's own queue,
-- visible now (with the run's rank on a queue with priorities), and records its id on the task. The caller
-- holds the run row and the tasks' rows.
create function pgflow._resend_tasks(p_run_id uuid, p_step_slugs text[], p_task_indexes int[])
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
           pgflow._queue_aging_secs(t.queue_name) as aging_secs,
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

-- Refuses (PF033) when a queue of one of the steps `p_step_slugs` of flow `p_flow_slug` no longer exists: the
-- flow version was retired and its queues dropped, so the steps could never run again.
create function pgflow._assert_version_present(p_caller text, p_run_id uuid, p_flow_slug text, p_step_slugs text[])
returns void
language plpgsql
stable
set search_path = ''
as $$
declare
  v_missing text;
begin
  select string_agg(distinct s.queue_name, ', ' order by s.queue_name) into v_missing
  from pgflow.steps s
  where s.flow_slug = p_flow_slug and s.step_slug = any (p_step_slugs)
    and pgflow._queue_meta_name(s.queue_name) is null;
  if v_missing is not null then
    raise exception '%(%): the flow version % is gone: queue % no longer exists', p_caller, p_run_id, p_flow_slug,
      v_missing
      using errcode = 'PF033',
            hint = 'The version was retired and its queues dropped; start a new run of the current version instead.';
  end if;
end;
$$;

-- Retries a failed or cancelled run in place (upstream #657, #658). In one transaction, holding the run row:
--   * every step that did not complete and was not skipped (the failed or cancelled steps, and the steps
--     downstream of them) runs again: its failed, cancelled or unfinished tasks go back to the queue with fresh
--     attempts (attempts_base = the attempts used so far: a result of the earlier try stays stale), each with a
--     new message; a step without tasks goes back to `created` and starts when its dependencies are done;
--   * completed tasks keep their outputs and never run again, including the completed tasks of a partly
--     finished map; completed and skipped steps stay as they are;
--   * the run goes back to `started` (retry_count + 1), and run_retries records who (`retried_by`, or the
--     calling role), when, and what the earlier try left: its status, cancel reason and the errors of its
--     failed tasks.
-- Refused, changing nothing: an unknown run (PF031); a run that is started, whose tasks may still run, or
-- completed (PF032: replay_run re-runs steps of a completed run); a flow version that is gone (PF033).
-- Returns the run row afterwards.
create function pgflow.retry_run(run_id uuid, retried_by text default NULL::text)
returns pgflow.runs
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_run pgflow.runs;
  v_steps text[];
  v_task_steps text[];
  v_task_indexes int[];
  v_errors jsonb;
begin
  -- Lock order 2: the run row.
  select r.* into v_run
  from pgflow.runs r
  where r.run_id = retry_run.run_id
  for no key update;
  if not found then
    raise exception 'retry_run(%): no such run', retry_run.run_id
      using errcode = 'PF031',
            hint = 'Check the run id; a finished run is removed by retention (prune_history) after its window.';
  end if;
  if v_run.status = 'started' then
    raise exception 'retry_run(%): run of flow % is still started; its tasks may still be running',
      retry_run.run_id, v_run.flow_slug
      using errcode = 'PF032',
            hint = 'Wait until it fails, or cancel it (cancel_run), then retry it.';
  elsif v_run.status = 'completed' then
    raise exception 'retry_run(%): run of flow % completed; there is nothing to retry', retry_run.run_id,
      v_run.flow_slug
      using errcode = 'PF032',
            hint = 'To run steps of a completed run again, replay it from a step (replay_run).';
  end if;

  select array_agg(ss.step_slug order by ss.step_slug) into v_steps
  from pgflow.step_states ss
  where ss.run_id = retry_run.run_id and ss.status not in ('completed', 'skipped');
  perform pgflow._assert_version_present('retry_run', retry_run.run_id, v_run.flow_slug, v_steps);

  -- History first, from the earlier try's task rows.
  select coalesce(jsonb_agg(jsonb_build_object('step_slug', t.step_slug, 'task_index', t.task_index,
                                               'attempts', t.attempts_count - t.attempts_base,
                                               'error_message', t.error_message)
                            order by t.step_slug, t.task_index), '[]')
  into v_errors
  from pgflow.step_tasks t
  where t.run_id = retry_run.run_id and t.status = 'failed';
  insert into pgflow.run_retries (run_id, retry_number, retried_by, previous_status, previous_failed_at,
                                  previous_cancelled_at, previous_cancel_reason, errors)
  values (retry_run.run_id, v_run.retry_count + 1, coalesce(retry_run.retried_by, pgflow._caller_role()),
          v_run.status, v_run.failed_at, v_run.cancelled_at, v_run.cancel_reason, v_errors);

  -- The run back to started: nothing of the steps below may start before it is.
  update pgflow.runs r
  set status = 'started', failed_at = null, cancelled_at = null, cancel_reason = null, output = null,
      retry_count = r.retry_count + 1,
      remaining_steps = coalesce(cardinality(v_steps), 0)
  where r.run_id = retry_run.run_id;

  -- Lock order 4: the tasks to run again (their messages were archived when they ended), in message order.
  -- Their last attempts go to the attempt history first (pgflow.task_attempts). Fresh attempts from the
  -- attempts used so far; a new message each, below.
  select coalesce(array_agg(a.step_slug), '{}'), coalesce(array_agg(a.task_index), '{}')
  into v_task_steps, v_task_indexes
  from (
    select t.step_slug, t.task_index
    from pgflow.step_tasks t
    where t.run_id = retry_run.run_id and t.step_slug = any (v_steps) and t.status <> 'completed'
    order by t.queue_name, t.message_id
    for update
  ) a;
  perform pgflow._record_attempts('run_retried', array_fill(retry_run.run_id, array[cardinality(v_task_steps)]),
                                  v_task_steps, v_task_indexes, null,
                                  coalesce(v_run.cancelled_at, v_run.failed_at));
  with reset as (
    update pgflow.step_tasks t
    set status = 'queued', attempts_base = t.attempts_count, error_message = null, output = null,
        started_at = null, failed_at = null, queued_at = greatest(now(), t.queued_at), permanently_stalled_at = null,
        requeued_count = 0, last_requeued_at = null
    from unnest(v_task_steps, v_task_indexes) as a(step_slug, task_index)
    where t.run_id = retry_run.run_id and t.step_slug = a.step_slug and t.task_index = a.task_index
    returning t.step_slug, t.task_index
  )
  select array_agg(r.step_slug order by r.step_slug, r.task_index),
         array_agg(r.task_index order by r.step_slug, r.task_index)
  into v_task_steps, v_task_indexes
  from reset r;

  -- Step states (lock order 5): a step with tasks is started again with the count of its unfinished tasks; a
  -- step without tasks goes back to created.
  update pgflow.step_states ss
  set status = case when x.n_tasks > 0 then 'started' else 'created' end,
      started_at = case when x.n_tasks > 0 then coalesce(ss.started_at, now()) end,
      remaining_tasks = case when x.n_tasks > 0 then x.n_open end,
      failed_at = null, error_message = null, output = null, completed_at = null
  from (
    select s.step_slug,
           (select count(*) from pgflow.step_tasks t
            where t.run_id = retry_run.run_id and t.step_slug = s.step_slug)::int as n_tasks,
           (select count(*) from pgflow.step_tasks t
            where t.run_id = retry_run.run_id and t.step_slug = s.step_slug and t.status <> 'completed')::int as n_open
    from unnest(v_steps) as s(step_slug)
  ) x
  where ss.run_id = retry_run.run_id and ss.step_slug = x.step_slug;

  if v_task_steps is not null then
    perform pgflow._resend_tasks(retry_run.run_id, v_task_steps, v_task_indexes);
  end if;

  perform pgflow._emit('run:retried', retry_run.run_id, jsonb_build_object(
    'event_type', 'run:retried',
    'run_id', retry_run.run_id,
    'flow_slug', v_run.flow_slug,
    'status', 'started',
    'retry_count', v_run.retry_count + 1,
    'previous_status', v_run.status
  ));

  -- Steps that became ready (a created step whose dependencies are done) start; a run with nothing left
  -- completes.
  perform pgflow._advance_runs(array[retry_run.run_id]);
  perform pgflow._complete_runs(array[retry_run.run_id]);

  select r.* into v_run from pgflow.runs r where r.run_id = retry_run.run_id;
  return v_run;
end;
$$;

-- Replays run `run_id` from step `from_step`: a new run of the same flow version and input, linked to the
-- original (replay_of), that copies the outputs of every completed (or skipped) step that is not `from_step`
-- or downstream of it, then runs `from_step` and its descendants (and any other step the original did not
-- finish). Works on runs in any status, completed ones included (re-running a step after fixing a bug).
-- Refused, changing nothing: an unknown run (PF031, also when retention removed it); a step the run's flow
-- does not have (PF034, naming the flow that has it when another does); a dependency of `from_step` that did
-- not complete in the original (PF036); a flow version that is gone (PF033). Returns the new run's id.
create function pgflow.replay_run(run_id uuid, from_step text)
returns uuid
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_orig pgflow.runs;
  v_new uuid := gen_random_uuid();
  v_run pgflow.runs;
  v_rerun text[];
  v_missing text;
  v_other text;
begin
  -- Lock order 2: the original's run row (its steps must not change while they are copied).
  select r.* into v_orig
  from pgflow.runs r
  where r.run_id = replay_run.run_id
  for no key update;
  if not found then
    raise exception 'replay_run(%): no such run', replay_run.run_id
      using errcode = 'PF031',
            hint = 'Check the run id; a finished run and its outputs are removed by retention (prune_history).';
  end if;

  if not exists (select 1 from pgflow.steps s
                 where s.flow_slug = v_orig.flow_slug and s.step_slug = replay_run.from_step) then
    select string_agg(s.flow_slug, ', ' order by s.flow_slug) into v_other
    from pgflow.steps s where s.step_slug = replay_run.from_step;
    raise exception 'replay_run(%): flow % has no step "%"%', replay_run.run_id, v_orig.flow_slug,
      replay_run.from_step,
      case when v_other is not null then format(' (it is a step of %s)', v_other) else '' end
      using errcode = 'PF034',
            hint = format('Steps of %s: %s.', v_orig.flow_slug,
                          (select string_agg(s.step_slug, ', ' order by s.step_index) from pgflow.steps s
                           where s.flow_slug = v_orig.flow_slug));
  end if;

  -- The steps to run: from_step, its descendants, and every step the original did not finish.
  with recursive down (step_slug) as (
    select replay_run.from_step
    union
    select d.step_slug from pgflow.deps d join down on d.dep_slug = down.step_slug
    where d.flow_slug = v_orig.flow_slug
  )
  select array_agg(s.step_slug order by s.step_index) into v_rerun
  from pgflow.steps s
  left join pgflow.step_states ss on ss.run_id = v_orig.run_id and ss.step_slug = s.step_slug
  where s.flow_slug = v_orig.flow_slug
    and (s.step_slug in (select step_slug from down) or ss.status is null
         or ss.status not in ('completed', 'skipped'));

  -- Every dependency of from_step is copied, so it must have finished in the original.
  select string_agg(d.dep_slug, ', ' order by d.dep_slug) into v_missing
  from pgflow.deps d
  where d.flow_slug = v_orig.flow_slug and d.step_slug = replay_run.from_step and d.dep_slug = any (v_rerun);
  if v_missing is not null then
    raise exception 'replay_run(%): cannot replay flow % from "%": its dependency % did not complete in this run',
      replay_run.run_id, v_orig.flow_slug, replay_run.from_step, v_missing
      using errcode = 'PF036',
            hint = 'Replay from the earliest step that did not complete, or retry the run (retry_run).';
  end if;
  perform pgflow._assert_version_present('replay_run', replay_run.run_id, v_orig.flow_slug, v_rerun);

  insert into pgflow.runs (run_id, flow_slug, input, remaining_steps, replay_of)
  values (v_new, v_orig.flow_slug, v_orig.input, cardinality(v_rerun), v_orig.run_id)
  returning * into v_run;

  -- Copied steps keep the original's status, output, task count and times; the others are created, waiting for
  -- their dependencies that are not copied, with the task count a map learns from a copied dependency.
  insert into pgflow.step_states (flow_slug, run_id, step_slug, status, remaining_tasks, initial_tasks,
                                  remaining_deps, output, skip_reason, created_at, started_at, completed_at,
                                  skipped_at)
  select s.flow_slug, v_new, s.step_slug,
         case when c.copied then o.status else 'created' end,
         case when c.copied and o.status = 'completed' then 0 end,
         case when c.copied then o.initial_tasks
              when s.step_type = 'single' then 1
              when s.deps_count = 0 and jsonb_typeof(v_orig.input) = 'array' then jsonb_array_length(v_orig.input)
              when s.deps_count = 0 then 0
              else (select case when ds.status = 'skipped' or jsonb_typeof(ds.output) <> 'array' then 0
                                else jsonb_array_length(ds.output) end
                    from pgflow.deps d
                    join pgflow.step_states ds on ds.run_id = v_orig.run_id and ds.step_slug = d.dep_slug
                    where d.flow_slug = s.flow_slug and d.step_slug = s.step_slug and d.dep_slug <> all (v_rerun)
                    limit 1)
         end,
         case when c.copied then 0
              else (select count(*)::int from pgflow.deps d
                    where d.flow_slug = s.flow_slug and d.step_slug = s.step_slug and d.dep_slug = any (v_rerun))
         end,
         case when c.copied then o.output end,
         case when c.copied then o.skip_reason end,
         now(),
         case when c.copied and o.status = 'completed' then now() end,
         case when c.copied and o.status = 'completed' then now() end,
         case when c.copied and o.status = 'skipped' then now() end
  from pgflow.steps s
  cross join lateral (select s.step_slug <> all (v_rerun) as copied) c
  left join pgflow.step_states o on o.run_id = v_orig.run_id and o.step_slug = s.step_slug
  where s.flow_slug = v_orig.flow_slug;

  perform pgflow._emit('run:started', v_new, jsonb_build_object(
    'event_type', 'run:started',
    'run_id', v_new,
    'flow_slug', v_run.flow_slug,
    'input', v_run.input,
    'status', 'started',
    'remaining_steps', v_run.remaining_steps,
    'started_at', v_run.started_at,
    'replay_of', v_orig.run_id
  ));

  perform pgflow._advance_runs(array[v_new]);
  return v_new;
end;
$$;

-- The idempotency window of starts: the setting pgflow.idempotency_key_ttl (an interval), 24 hours when unset.
create function pgflow._idempotency_key_ttl()
returns interval
language sql
stable
set search_path = ''
as $$
  select coalesce(nullif(current_setting('pgflow.idempotency_key_ttl', true), '')::interval, interval '24 hours')
$$;

-- start_flows with an idempotency key per input (NULL: no key for that input). For each key, within its window:
-- the first start with (flow_slug as given, flow or alias, key) starts a run and records the key; every later
-- start with the same key returns that run instead of starting another, also when many start concurrently
-- (the key row is inserted first: concurrent starts wait for it, then find it). The same key with another input
-- raises PF035 naming the key, and nothing is started. A key whose window (key_ttl, else
-- _idempotency_key_ttl()) has passed starts a new run; retention (prune_history) removes expired keys.
-- Returns one run row per input, in input order (a key named twice in one call: the same run twice).
-- priorities: as start_flows (one per input, or NULL); a key found returns its run with the priority it has.
create function pgflow.start_flows_with_keys(flow_slug text, inputs jsonb[], idempotency_keys text[], run_ids uuid[], key_ttl interval, priorities integer[])
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

-- start_flows_with_keys without priorities (all 0).
create function pgflow.start_flows_with_keys(flow_slug text, inputs jsonb[], idempotency_keys text[], run_ids uuid[] default NULL::uuid[], key_ttl interval default NULL::interval)
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

-- For a worker's tasks in flight (item i = run_ids[i], step_slugs[i], task_indexes[i], attempts[i]): the items
-- that are no longer current, so their handlers should stop and their results will be dropped (stale). A task
-- is current while its run is started and it is `started` at that attempt. Reason: the run's cancel reason
-- (status 'cancelled'), or its status ('failed', 'completed'), or the task's status for a task that ended
-- alone. No locks; read-only.
create function pgflow.cancelled_tasks(run_ids uuid[], step_slugs text[], task_indexes integer[], attempts integer[])
returns table(run_id uuid, step_slug text, task_index integer, attempt integer, run_status text, reason text)
language sql
stable
security definer
set search_path = ''
as $$
  select i.run_id, i.step_slug, i.task_index, i.attempt, r.status,
         case when r.status = 'cancelled' then coalesce(r.cancel_reason, 'run cancelled')
              when r.status is distinct from 'started' then 'run ' || coalesce(r.status, 'removed')
              else 'task ' || coalesce(t.status, 'removed') || ' at attempt ' || coalesce(t.attempts_count, 0)
         end
  from unnest(cancelled_tasks.run_ids, cancelled_tasks.step_slugs, cancelled_tasks.task_indexes,
              cancelled_tasks.attempts) as i(run_id, step_slug, task_index, attempt)
  left join pgflow.runs r on r.run_id = i.run_id
  left join pgflow.step_tasks t on t.run_id = i.run_id and t.step_slug = i.step_slug and t.task_index = i.task_index
  where r.status is distinct from 'started' or t.status is distinct from 'started'
     or t.attempts_count is distinct from i.attempt
$$;

-- Nothing here is PUBLIC's: the roles that call these get them through the lists of 12_privileges.sql.
revoke execute on all functions in schema pgflow from public;
