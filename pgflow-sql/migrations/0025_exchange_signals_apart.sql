-- pgflow-rs SQL core, migration 0025: a worker's own exchanges no longer hold back the signal of a new run.
--
-- New tasks signal their queue at most once per pgflow._signal_interval(), and never from two transactions
-- at once (0017). A worker ignores the signals its own exchanges send: they announce tasks that exchange has
-- just claimed, or left for claims the worker makes anyway. But those signals shared one throttle with every
-- other sender. A run started within the interval after an exchange had created dependent tasks, or while
-- that exchange was still committing, sent no signal; with one worker on the queue nothing woke it, and the
-- run's first task waited for that worker's next exchange or poll. Measured with one worker and runs started
-- at 200 per second in 10 ms batches: a fifth of the first tasks waited 11-16 ms for their claim, the others
-- under 4 ms.
--
-- Signals sent by exchanges are now throttled apart from all others: pgflow.queue_signals holds one row per
-- queue and source ('exchange' or 'other'), and pgflow.exchange marks its transaction (the setting
-- pgflow.signal_source, transaction-local) while its completions create tasks. Each source still signals a
-- queue at most once per interval and never waits for another transaction's signal, so a queue gets at most
-- two signals per interval instead of one. Other workers of the queue wake for an exchange's signals as before.

alter table pgflow.queue_signals
  add column source text not null default 'other' check (source in ('exchange', 'other'));
alter table pgflow.queue_signals drop constraint queue_signals_pkey;
alter table pgflow.queue_signals add primary key (queue_name, source);

-- Signals each of p_queues (NULLs and repeats ignored) unless this source signalled it less than
-- pgflow._signal_interval() ago or another transaction of this source is signalling it now. The source is
-- 'exchange' inside pgflow.exchange's completions, 'other' everywhere else.
create or replace function pgflow._signal_queues(p_queues text[])
returns void
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_source text := case when current_setting('pgflow.signal_source', true) = 'exchange' then 'exchange'
                        else 'other' end;
  v_queue text;
begin
  for v_queue in
    with wanted as (
      select distinct q.name from unnest(p_queues) as q(name) where q.name is not null
    ),
    due as (
      select s.queue_name
      from pgflow.queue_signals s
      where s.source = v_source
        and s.queue_name in (select w.name from wanted w)
        and s.signaled_at < clock_timestamp() - pgflow._signal_interval()
      order by s.queue_name
      for update skip locked
    ),
    stamped as (
      update pgflow.queue_signals s
      set signaled_at = clock_timestamp()
      from due
      where s.queue_name = due.queue_name and s.source = v_source
      returning s.queue_name
    ),
    added as (
      insert into pgflow.queue_signals (queue_name, source, signaled_at)
      select w.name, v_source, clock_timestamp()
      from wanted w
      where not exists (select 1 from pgflow.queue_signals s where s.queue_name = w.name and s.source = v_source)
      on conflict do nothing
      returning queue_name
    )
    select x.queue_name from stamped x
    union all
    select a.queue_name from added a
  loop
    perform pg_notify('pgflow_queue_signal', v_queue);
  end loop;
end;
$$;

-- As in 0017, with the completions' task creation marked as the exchange's (see the top of this file). The
-- mark is cleared before the claim and lasts no longer than the transaction.
create or replace function pgflow.exchange(
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
security definer
set search_path = ''
set plan_cache_mode = force_generic_plan
set enable_seqscan = off
as $$
begin
  if coalesce(cardinality(exchange.run_ids), 0) > 0 then
    if array_position(exchange.attempts, null) is not null
       or cardinality(exchange.attempts) is distinct from cardinality(exchange.run_ids) then
      raise exception 'exchange(): every completion needs the attempt its claim returned'
        using errcode = 'invalid_parameter_value';
    end if;
    perform set_config('pgflow.signal_source', 'exchange', true);
    return query
    select case when c.applied then 'applied' else 'stale' end, null::bigint, (c.task).flow_slug,
           (c.task).run_id, (c.task).step_slug, (c.task).task_index, null::jsonb, null::jsonb,
           (c.task).attempts_count, null::int, null::jsonb, (c.task).status
    from pgflow._complete_tasks(exchange.run_ids, exchange.done_step_slugs, exchange.task_indexes,
                                exchange.outputs, exchange.attempts, exchange.worker_id) c
    order by c.ord;
    perform set_config('pgflow.signal_source', '', true);
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

revoke execute on all functions in schema pgflow from public;
