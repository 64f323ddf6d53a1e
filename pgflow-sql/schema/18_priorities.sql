-- Priorities: on a queue with priorities enabled, a claim reads the visible messages by rank instead of by
-- message id, and aging keeps low priorities from starving.
--
-- A run carries a priority (pgflow.runs.priority, an integer, default 0; higher is claimed first), given at
-- its start (start_flow, start_flows, start_flows_with_keys). Every message the run sends to a queue with
-- priorities enabled (its first steps, its dependents, map tasks, retry_run's new messages; a failed task
-- retries with its message, so with its rank) carries in its PGMQ headers a rank fixed at send time:
--
--   rank = the send time in epoch seconds - priority x the queue's aging in seconds
--
-- so priority p is a head start of p x aging: a task of priority p waits at most (q - p) x aging behind
-- tasks of priority q sent at the same time, never for ever. The claim of pgflow-rs workers
-- (read_and_claim_tasks, exchange) reads a queue with priorities by (rank, msg_id) through an index on the
-- rank that set_queue_priority creates; a queue without the setting is read by msg_id as before, by the
-- same plan. Messages without a rank (sent before the setting) are read first. Upstream's two-phase workers
-- read with pgmq.read, by msg_id. The recovery paths that re-send a lost message give it its run's rank as of
-- that time.
--
-- Lock order: set_queue_priority builds the index (a SHARE lock on the queue table: sends and claims on that
-- queue wait for the build), then writes its queue_priorities row; claims and sends only read that row.
--
-- Owns: queue_priorities; set_queue_priority, clear_queue_priority; _rank_index_name, _queue_aging_secs,
-- _rank_headers, _run_rank_headers.

create table pgflow.queue_priorities (
  queue_name text primary key,
  aging interval not null,
  constraint queue_priorities_aging_positive check (aging > interval '0')
);

-- The name of the rank index on queue `p_queue`'s PGMQ table (at most 2 + 47 + 12 characters).
create function pgflow._rank_index_name(p_queue text)
returns text
language sql
immutable
as $$
  select 'q_' || lower(p_queue) || '_pgflow_rank'
$$;

-- Queue `p_queue`'s aging in seconds when it has priorities, else NULL: what _rank_headers takes. Every
-- path that sends a task's message looks the aging up here, once per queue of what it sends. PL/pgSQL, so
-- that its plan is cached for the session (a SQL function that reads a table is planned again in each
-- statement that calls it).
create function pgflow._queue_aging_secs(p_queue text)
returns double precision
language plpgsql
stable
set search_path = ''
as $$
begin
  return (select extract(epoch from qp.aging)::float8 from pgflow.queue_priorities qp
          where qp.queue_name = p_queue);
end;
$$;

-- The PGMQ headers of messages sent now by runs of priority `p_priority` to a queue whose aging is
-- `p_aging_secs` seconds: {"pgflow_rank": rank}; NULL when the queue has no priorities (p_aging_secs NULL).
-- Plain SQL without SET options, so the planner inlines it.
create function pgflow._rank_headers(p_aging_secs double precision, p_priority integer)
returns jsonb
language sql
stable
as $$
  select case when p_aging_secs is not null
              then jsonb_build_object('pgflow_rank',
                                      extract(epoch from clock_timestamp())::float8
                                      - coalesce(p_priority, 0) * p_aging_secs) end
$$;

-- The headers of a message that run `p_run_id` sends now to queue `p_queue` (the recovery paths that re-send
-- a lost message one at a time): its rank on a queue with priorities, else NULL.
create function pgflow._run_rank_headers(p_queue text, p_run_id uuid)
returns jsonb
language sql
stable
as $$
  select pgflow._rank_headers(pgflow._queue_aging_secs(lower(p_queue)),
                              (select r.priority from pgflow.runs r where r.run_id = p_run_id))
$$;

-- Enables priorities on queue `queue_name` with aging `aging` (a priority step is a head start of that
-- long): creates the rank index on its PGMQ table (once) and records the setting; returns it. Refuses a queue
-- pgflow routes no task to and an aging of zero or less (or NULL); nothing changes then.
create function pgflow.set_queue_priority(queue_name text, aging interval)
returns pgflow.queue_priorities
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_queue text := lower(set_queue_priority.queue_name);
  v_row pgflow.queue_priorities;
begin
  if not exists (select 1 from pgflow.steps s where s.queue_name = v_queue)
     or pgflow._queue_meta_name(v_queue) is null then
    raise exception 'set_queue_priority(): queue "%" is not a queue pgflow routes tasks to', set_queue_priority.queue_name
      using errcode = 'undefined_object',
            hint = 'Name the queue of a compiled flow''s step (pgflow.steps.queue_name).';
  end if;
  if set_queue_priority.aging is null or set_queue_priority.aging <= interval '0' then
    raise exception 'set_queue_priority(): queue "%": aging must be a positive interval, got %', v_queue,
        coalesce(set_queue_priority.aging::text, 'NULL')
      using errcode = 'invalid_parameter_value',
            hint = 'Aging is how long one priority step is worth, e.g. ''1 minute''.';
  end if;
  execute format('create index if not exists %I on pgmq.%I (((headers ->> %L)::float8) nulls first, msg_id)',
                 pgflow._rank_index_name(v_queue), pgmq.format_table_name(v_queue, 'q'), 'pgflow_rank');
  insert into pgflow.queue_priorities as p (queue_name, aging)
  values (v_queue, set_queue_priority.aging)
  on conflict on constraint queue_priorities_pkey do update set aging = excluded.aging
  returning * into v_row;
  return v_row;
end;
$$;

-- Disables priorities on queue `queue_name` (its claims read by msg_id again) and drops the rank index;
-- whether it had them.
create function pgflow.clear_queue_priority(queue_name text)
returns boolean
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_queue text := lower(clear_queue_priority.queue_name);
begin
  delete from pgflow.queue_priorities p where p.queue_name = v_queue;
  if not found then
    return false;
  end if;
  execute format('drop index if exists pgmq.%I', pgflow._rank_index_name(v_queue));
  return true;
end;
$$;

-- Schema-level default privileges cannot take EXECUTE away from PUBLIC: revoked here for the functions above.
revoke execute on all functions in schema pgflow from public;
