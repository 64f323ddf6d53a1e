-- pgflow-rs SQL core, migration 0030: an exchange signals a queue only when another worker serves it.
--
-- A transaction that notifies holds a cluster-wide lock from its commit until the commit record is flushed,
-- so notifying commits queue one behind the other (see 0029). An exchange that creates dependent tasks
-- signalled their queue (at most once per pgflow._signal_interval(), 0025) even when the only worker of that
-- queue was the exchange's own worker, which ignores its own signals (it has just claimed those tasks, or
-- claims them on its next exchange). With one worker on a queue, the common deployment, every such signal was
-- a notifying commit that woke nobody: at 950 diamond runs/s, about 200 a second.
--
-- pgflow.exchange now also names its worker (the transaction-local setting pgflow.signal_worker), and an
-- exchange's signal goes to a queue only while another live worker is registered on it (not stopped, not
-- deprecated, heartbeat within pgflow._worker_liveness_window()). Other senders ('other': starts, the
-- upstream completion functions, recovery) signal as before. A worker that registers after the check claims
-- at once when it starts, so no task waits for a signal that was not sent.

-- As in 0025, skipping the queues of an exchange that no other live worker serves.
create or replace function pgflow._signal_queues(p_queues text[])
returns void
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_source text := case when current_setting('pgflow.signal_source', true) = 'exchange' then 'exchange'
                        else 'other' end;
  v_worker uuid := case when v_source = 'exchange'
                         then nullif(current_setting('pgflow.signal_worker', true), '')::uuid end;
  v_queue text;
begin
  for v_queue in
    with wanted as (
      select distinct q.name from unnest(p_queues) as q(name)
      where q.name is not null
        -- An exchange wakes the other live workers of the queue; its own worker ignores its signals.
        and (v_source <> 'exchange'
             or exists (select 1 from pgflow.workers wk
                        where wk.queue_name = q.name
                          and wk.worker_id is distinct from v_worker
                          and wk.stopped_at is null
                          and wk.deprecated_at is null
                          and wk.last_heartbeat_at > now() - pgflow._worker_liveness_window()))
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

-- As in 0026, naming the exchange's worker for pgflow._signal_queues.
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
  perform pgflow._replan_if_grown();
  if coalesce(cardinality(exchange.run_ids), 0) > 0 then
    if array_position(exchange.attempts, null) is not null
       or cardinality(exchange.attempts) is distinct from cardinality(exchange.run_ids) then
      raise exception 'exchange(): every completion needs the attempt its claim returned'
        using errcode = 'invalid_parameter_value';
    end if;
    perform set_config('pgflow.signal_source', 'exchange', true);
    perform set_config('pgflow.signal_worker', exchange.worker_id::text, true);
    return query
    select case when c.applied then 'applied' else 'stale' end, null::bigint, (c.task).flow_slug,
           (c.task).run_id, (c.task).step_slug, (c.task).task_index, null::jsonb, null::jsonb,
           (c.task).attempts_count, null::int, null::jsonb, (c.task).status
    from pgflow._complete_tasks(exchange.run_ids, exchange.done_step_slugs, exchange.task_indexes,
                                exchange.outputs, exchange.attempts, exchange.worker_id) c
    order by c.ord;
    perform set_config('pgflow.signal_source', '', true);
    perform set_config('pgflow.signal_worker', '', true);
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
