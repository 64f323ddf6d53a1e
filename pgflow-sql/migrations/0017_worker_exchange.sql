-- pgflow-rs SQL core, migration 0017: one round trip per worker cycle, and wake-ups for idle workers.
--
-- * pgflow.exchange records a worker's finished outputs and claims its next tasks in one transaction. Tasks that
--   the completions made ready are in the worker's queue by then (same transaction), so a worker with free slots
--   claims them at once instead of waiting for its next poll: a diamond needs no poll between its steps. The
--   messages are ordinary queue messages; any other worker of the queue could have claimed them first.
-- * New tasks signal their queue on the notification channel `pgflow_queue_signal` (payload: the queue name),
--   at most once per queue per pgflow._signal_interval() and never by two transactions at once, so idle workers
--   wake within milliseconds while notifying transactions stay rare: PostgreSQL serialises the commits of
--   transactions that notify.

------------------------------------------------------------------------------------------------------------
-- Queue signals
------------------------------------------------------------------------------------------------------------

-- When each queue was last signalled. Unlogged: losing it in a crash only makes the next signal earlier.
create unlogged table pgflow.queue_signals (
  queue_name text primary key,
  signaled_at timestamptz not null default '-infinity'
);

insert into pgflow.queue_signals (queue_name)
select distinct s.queue_name from pgflow.steps s
on conflict do nothing;

-- The shortest time between two signals of one queue.
create function pgflow._signal_interval()
returns interval
language sql
immutable
parallel safe
as $$ select interval '5 milliseconds' $$;

-- Signals each queue of `p_queues` (NOTIFY pgflow_queue_signal, payload the queue name, delivered at commit)
-- unless it was signalled less than pgflow._signal_interval() ago or another transaction is signalling it
-- right now (its signal covers this one). Never waits.
create function pgflow._signal_queues(p_queues text[])
returns void
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_queue text;
begin
  for v_queue in select distinct q from unnest(p_queues) as q where q is not null order by 1 loop
    perform 1
    from pgflow.queue_signals s
    where s.queue_name = v_queue and s.signaled_at < clock_timestamp() - pgflow._signal_interval()
    for update skip locked;
    if found then
      update pgflow.queue_signals s set signaled_at = clock_timestamp() where s.queue_name = v_queue;
      perform pg_notify('pgflow_queue_signal', v_queue);
    elsif not exists (select 1 from pgflow.queue_signals s where s.queue_name = v_queue) then
      insert into pgflow.queue_signals (queue_name, signaled_at) values (v_queue, clock_timestamp())
      on conflict do nothing;
      perform pg_notify('pgflow_queue_signal', v_queue);
    end if;
  end loop;
end;
$$;

-- Queues are created while flows compile: give every new queue its signal row there, so sending never inserts.
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

-- New tasks signal their queues: one statement-level trigger covers every path that creates tasks (starting a
-- run, completing a step, a retry of a permanently stalled task gets a fresh message by update and is left to
-- polling).
create function pgflow._signal_new_tasks()
returns trigger
language plpgsql
volatile
set search_path = ''
as $$
begin
  perform pgflow._signal_queues(array(select distinct n.queue_name from new_tasks n));
  return null;
end;
$$;

create trigger step_tasks_signal_queues
  after insert on pgflow.step_tasks
  referencing new table as new_tasks
  for each statement
  execute function pgflow._signal_new_tasks();

------------------------------------------------------------------------------------------------------------
-- One round trip per worker cycle
------------------------------------------------------------------------------------------------------------

-- Records the worker's finished outputs (fenced, exactly as complete_tasks: item i = run_ids[i],
-- step_slugs_done[i], task_indexes[i], outputs[i], attempts[i]; empty arrays: none), then reads and claims up to
-- `qty` messages of `queue_name` for the worker's (flow_slugs[j], step_slugs[j]) pairs, exactly as
-- read_and_claim_tasks (qty 0: no claim), in one transaction. Returns the rows of both, completions first:
--   outcome 'applied' | 'stale'   one row per completion item naming an existing task: run_id, step_slug,
--                                 task_index, attempts_count (the task's current attempt) and status
--   the claim's rows              as read_and_claim_tasks ('claimed', 'deferred', 'archived', 'waiting',
--                                 'unsupported', 'disabled')
-- When the claim finds an unsupported batch, the completions are still recorded (they are the worker's own
-- results); only the claim changes nothing.
create function pgflow.exchange(
  queue_name text,
  worker_id uuid,
  flow_slugs text[],
  step_slugs text[],
  qty int,
  vt int,
  run_ids uuid[],
  done_step_slugs text[],
  task_indexes int[],
  outputs jsonb[],
  attempts int[]
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
  report jsonb,
  status text
)
language plpgsql
volatile
set search_path = ''
as $$
begin
  if coalesce(cardinality(exchange.run_ids), 0) > 0 then
    if array_position(exchange.attempts, null) is not null
       or cardinality(exchange.attempts) is distinct from cardinality(exchange.run_ids) then
      raise exception 'exchange(): every completion needs the attempt its claim returned'
        using errcode = 'invalid_parameter_value';
    end if;
    return query
    select case when c.applied then 'applied' else 'stale' end, null::bigint, (c.task).flow_slug,
           (c.task).run_id, (c.task).step_slug, (c.task).task_index, null::jsonb, null::jsonb,
           (c.task).attempts_count, null::int, null::jsonb, (c.task).status
    from pgflow._complete_tasks(exchange.run_ids, exchange.done_step_slugs, exchange.task_indexes,
                                exchange.outputs, exchange.attempts, exchange.worker_id) c
    order by c.ord;
  end if;
  if coalesce(exchange.qty, 0) > 0 then
    return query
    select c.outcome, c.msg_id, c.flow_slug, c.run_id, c.step_slug, c.task_index, c.input, c.flow_input,
           c.attempts_count, c.timeout, c.report, null::text
    from pgflow.read_and_claim_tasks(exchange.queue_name, exchange.qty, exchange.vt, exchange.worker_id,
                                     exchange.flow_slugs, exchange.step_slugs) c;
  end if;
end;
$$;

create or replace function pgflow._worker_api()
returns text[]
language sql
immutable
as $$
  select array[
    'pgflow.ensure_flow_compiled(text,jsonb,boolean,text,jsonb,text,boolean)',
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
    'pgflow.run_maintenance(interval,interval,integer)'
  ]
$$;

alter function pgflow.exchange(text, uuid, text[], text[], integer, integer, uuid[], text[], integer[], jsonb[], integer[])
  security definer;
revoke execute on all functions in schema pgflow from public;
