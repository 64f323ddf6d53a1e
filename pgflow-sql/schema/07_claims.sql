-- Claims: reading a queue's messages and turning them into started tasks, and the one lock order.
--
-- THE LOCK ORDER. Every function of the SQL core that takes row locks takes them in this order, and never
-- waits for an earlier kind while holding a later one:
--
--   1. advisory locks: the name locks of flow slugs and aliases (one namespace, in key order), a flow slug's
--      compile lock, then queue-name locks in sorted order (compilation and alias activation); the
--      maintenance lock (recovery and retention, try-only, never waited for);
--   1b. `pgflow.schedules` rows (FOR UPDATE), one at a time: firing a schedule holds its row while it starts
--      runs (which inserts rows and waits for no lock);
--   2. `pgflow.runs` rows (FOR NO KEY UPDATE): every change of a run's state is serialised on its run row;
--      several runs in run_id order;
--   3. PGMQ message rows (`pgmq.q_<queue>`), per queue in msg_id order, several queues in queue-name order:
--      pgmq.read takes them for a claim; every other path locks a task's message explicitly
--      (pgflow._lock_messages) before it touches the task;
--   4. `pgflow.step_tasks` rows, in (queue_name, message_id) order;
--   5. then `pgflow.step_states` and the run's counters (under the run row of 2);
--   5b. `pgflow.task_attempts`, the attempt history: rows are only inserted, by a path that holds the task row
--      it resets for another attempt (pgflow._record_attempts), and deleted with their run by prune_history and
--      delete_flow_and_data; nobody locks or updates them, so they add no wait to the order;
--   6. flow control's limit rows: `pgflow.queue_limits` FOR UPDATE, then `pgflow.key_limits` in (flow, step)
--      order (FOR SHARE by claims, FOR UPDATE by their set and clear functions), then an advisory try-lock
--      per limit key of the batch (key space 4, never waited for): only a claim on a limited queue takes them,
--      last; then the `pgflow.key_buckets` rows of the keys it holds (idle ones of other keys: SKIP LOCKED);
--      the slot trigger of a task leaving 'started', and a claim parking a full key's backlog, take messages
--      with SKIP LOCKED only.
--
-- A claim (pgmq.read, then claim_tasks) starts at 3: it holds the messages it read and then locks their tasks.
-- Every other writer of a task holds that task's message first, so a claim never waits for a task row whose
-- holder waits for one of the claim's messages: the interleaving "read a message in one session, cancel its
-- task from another, claim it in the first" cannot deadlock. It ends either with the claim first (the task is
-- then cancelled with its message archived) or with the cancellation first (the claim archives the message of
-- the terminal task). Recovery paths (stalled tasks, dead workers) take messages and tasks with SKIP LOCKED,
-- so they never wait at all.
--
-- WHO LOCKS WHAT, in the one lock order (advisory locks; runs in run-id order; messages per queue in message-id
-- order, queues in name order; tasks; step states and run counters). "skip" = SKIP LOCKED, never waits.
--   ensure_flow_compiled, activate_alias   advisory: the name locks of the slug and the alias (key space 3, one
--                                          namespace, in key order), the slug's compile lock, queue-name
--                                          locks (sorted)
--   run_maintenance                        advisory maintenance lock (try only); then prune_history, then
--                                          requeue_stalled_tasks, then requeue_dead_worker_tasks
--   watch_run                              one run FOR SHARE
--   claim_tasks, read_and_claim_tasks,     messages (pgmq.read / lock_visible / lock_visible_ranked: skip, in
--   start_tasks (both forms)               id or rank order; explicit ids: waits, in message-id order), then
--                                          their tasks FOR UPDATE in message order;
--                                          on a limited queue (not start_tasks), then the limit rows, the
--                                          batch's limit keys (try only), the buckets of the keys held (idle
--                                          ones skip) (_apply_limits); a full key's visible backlog skip
--                                          (_park_key_backlog)
--   set_queue_limit, set_key_limit,        the limit row (set/clear_key_limit: then its step's key buckets,
--   clear_queue_limit, clear_key_limit     then its step's parked messages skip)
--   trigger step_tasks_free_limit_slot     (a task leaving 'started') its slot row; parked messages skip
--   complete_task(s) (_complete_tasks)     runs of the batch; the batch's messages plus, when an item can fail
--                                          its run, the messages of that run's live tasks; then tasks, step
--                                          states, run counters (_complete_task_exception, _advance_runs,
--                                          cascade_resolve_conditions, _fail_run, _terminate_tasks re-take only
--                                          locks already held)
--   exchange                               _complete_tasks (the tasks it creates claimed for its worker are
--                                          new rows: no lock), then a claim whose messages are taken skip
--   fail_task (both forms, _fail_task)     run; the task's message plus, when the failure can be final, the
--                                          messages of the run's live tasks; then tasks, step states
--   resolve_stalled_task                   run; the task's message plus, for 'fail', the run's live messages;
--                                          task FOR UPDATE; then as _fail_task
--   release_worker_tasks                   the worker's messages (per queue, message order), then tasks
--   requeue_stalled_tasks                  messages skip, tasks skip; tasks whose message is gone: skip
--   queue_stats                            none (counts each queue's messages without locking)
--   requeue_dead_worker_tasks              worker rows; per last attempt: run skip, its messages skip, then
--                                          _fail_task; others: messages skip, tasks skip
--   prune_history                          finished runs skip; their messages (deleted, waits), attempt
--                                          history, limit slots, tasks, step states, watcher rows, runs;
--                                          archived messages; worker rows skip. dry_run: none (counts only)
--   _record_attempts                       none of its own: inserts history rows for tasks its caller holds
--                                          (_fail_task's retry, stall and dead-worker requeues, release,
--                                          resolve_stalled_task's retry, retry_run)
--   worker_heartbeat                       its worker row
--   cancel_run, cancel_runs (_cancel_run)  runs (cancel_runs: a batch in run-id order, skip); then per run its
--                                          live tasks' messages, then the tasks (_terminate_tasks).
--                                          cancel_runs with dry_run: none (counts only)
--   retry_run                              run; its tasks to run again FOR UPDATE in message order (their
--                                          messages are archived), new messages sent; step states; run counters
--   replay_run                             the original's run (no key update); the new run's rows are its own
--   start_flows_with_keys                  idempotency_keys rows in key order (a concurrent start with the same
--                                          key waits for the first to commit), then as start_flows
--   cancelled_tasks                        none (read only)
--   fire_schedule, pause/resume_schedule   one schedule row FOR UPDATE; fire_schedule then starts runs
--                                          (start_flows: new rows only)
--   set_queue_priority                     the queue's PGMQ table SHARE (index build, waits for writers of
--                                          that queue, holding nothing else), then its queue_priorities row
--   clear_queue_priority                   its queue_priorities row, then the queue's PGMQ table ACCESS
--                                          EXCLUSIVE (dropping the index; claims and sends only read the row)
--
-- FINDING A MESSAGE'S TASK. Every statement that goes from messages to their tasks does it one message at a
-- time, by the task's unique key (queue_name, message_id): `from unnest(ids) as m(id) cross join lateral
-- (select ... from pgflow.step_tasks t where t.queue_name = q and t.message_id = m.id ...)`, with the row lock
-- (or `offset 0`) inside the subquery so that it stays a lookup per message, and the ids sorted so that the
-- locks are taken in message order. The plain form, `t.queue_name = q and t.message_id = any (ids)`, leaves the
-- planner free to scan the queue's tasks by queue name alone and filter them by id. It does that with a
-- generic plan made while the tables were small or without statistics, and then reads every task the queue
-- has ever had on every claim: 2,000 rows to claim one message on a new installation, growing with the
-- queue's history until the next analysis.
--
-- Owns: claim_tasks (the classifying claim of per-step, queue and plain workers), read_and_claim_tasks (read
-- and claim in one call), upstream's start_tasks forms, set_vt_batch and poll_for_tasks.

-- Locks the live messages `p_ids` of queue `p_queue` (FOR UPDATE, in msg_id order, through the queue's
-- statements) and returns the ids it locked. With p_skip_locked, messages another transaction holds are
-- skipped instead of waited for. Ids that are no longer live (archived or deleted), or of a queue that does
-- not exist, are not returned. This is step 3 of the lock order: a task's message is locked before the task.
create function pgflow._lock_messages(p_queue text, p_ids bigint[], p_skip_locked boolean default false)
returns bigint[]
language plpgsql
set search_path = ''
as $$
begin
  if p_ids is null or cardinality(p_ids) = 0
     or to_regclass(format('pgmq.%I', pgmq.format_table_name(p_queue, 'q'))) is null then
    return '{}';
  end if;
  return pgflow._queue_op(p_queue, case when p_skip_locked then 'lock_skip_locked' else 'lock' end, p_ids);
end;
$$;

-- The fence of every claim: NULL when worker `p_worker_id` may claim, else the report of its disabled function,
-- {"function_name", "reason", "disabled_at"} (claim_tasks' 'disabled' row). A worker of a disabled function
-- claims nothing, and nothing is created claimed for it (exchange).
create function pgflow._worker_disabled(p_worker_id uuid)
returns jsonb
language plpgsql
stable
set search_path = ''
as $$
begin
  return (select jsonb_build_object('function_name', wf.function_name, 'reason', wf.disabled_reason,
                                    'disabled_at', wf.disabled_at)
          from pgflow.workers w
          join pgflow.worker_functions wf on wf.function_name = w.function_name
          where w.worker_id = p_worker_id and not wf.enabled);
end;
$$;

-- The 'claimed' rows of a claim (claim_tasks' shape): one per task of queue `p_queue` behind the sorted
-- message ids `p_msg_ids` that is `started`, in message order, with its handler's input (_task_inputs), its
-- attempt, its effective timeout and its run's trace context. Each task is found by its message's key
-- (FINDING A MESSAGE'S TASK, above). Every claim returns its tasks through it: _claim_tasks, exchange (the
-- tasks created claimed) and upstream's start_tasks (its columns of these rows).
create function pgflow._claimed_rows(p_queue text, p_msg_ids bigint[])
returns table(outcome text, msg_id bigint, flow_slug text, run_id uuid, step_slug text, task_index integer, input jsonb, flow_input jsonb, attempts_count integer, timeout integer, report jsonb)
language plpgsql
set search_path = ''
as $$
begin
  return query
  select 'claimed'::text, m.id, t.flow_slug, t.run_id, t.step_slug, t.task_index, i.input, i.flow_input,
         t.attempts_count, coalesce(s.opt_timeout, f.opt_timeout), r.trace_context
  from unnest(p_msg_ids) with ordinality as m(id, ord)
  cross join lateral (
    select t.* from pgflow.step_tasks t where t.queue_name = p_queue and t.message_id = m.id offset 0
  ) t
  join pgflow.steps s on s.flow_slug = t.flow_slug and s.step_slug = t.step_slug
  join pgflow.flows f on f.flow_slug = t.flow_slug
  join pgflow.runs r on r.run_id = t.run_id
  cross join lateral pgflow._task_inputs(t.run_id, t.flow_slug, t.step_slug, s.step_type, s.deps_count,
                                         t.element, r.input) i
  where t.status = 'started'
  order by m.ord;
end;
$$;

-- The classifying claim behind claim_tasks, read_and_claim_tasks and exchange. read_vt NULL: the caller read
-- the messages in an earlier transaction, so they are locked here first. read_vt set: this transaction's
-- locking read holds them; each is counted as read (read_ct, last_read_at) and the ones not claimed, deferred
-- or released stay invisible for read_vt seconds, as after pgmq.read. Queue statements go through the
-- queue's statements function.
create function pgflow._claim_tasks(queue_name text, msg_ids bigint[], worker_id uuid, flow_slugs text[], step_slugs text[], read_vt integer)
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
  v_disabled := pgflow._worker_disabled(_claim_tasks.worker_id);

  -- Lock order step 4: every task of the batch, in message order (v_ids is sorted), classified in the same
  -- statement. Each task is found by its message's key (FINDING A MESSAGE'S TASK, above).
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
    from unnest(v_ids) as m(id)
    cross join lateral (
      select t.* from pgflow.step_tasks t where t.queue_name = v_queue and t.message_id = m.id for update
    ) t
    join pgflow.runs r on r.run_id = t.run_id
    join pgflow.step_states ss on ss.run_id = t.run_id and ss.step_slug = t.step_slug
    join pgflow.steps s on s.flow_slug = t.flow_slug and s.step_slug = t.step_slug
    join pgflow.flows f on f.flow_slug = t.flow_slug
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
    return query select * from pgflow._claimed_rows(v_queue, v_claim_ids);
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

-- The claim of pgflow-rs workers: the messages `msg_ids` a worker read from `queue_name` (in an earlier
-- transaction: they are locked here first), classified against the exact (flow_slugs[i], step_slugs[i]) pairs
-- the worker runs from that queue. Tasks are matched by (queue_name, message_id) only. The batch is
-- classified first, its messages and then its task rows locked in message order:
--   claimed      task in this queue, its (flow, step) among the pairs, `queued`, run and step started
--   deferred     task `started` (a duplicate visibility, benign): no attempt consumed; the message is hidden
--                until the task's recovery boundary (at least the claim buffer from now)
--   archived     task terminal (completed, failed, skipped, cancelled): the message is archived, idempotently
--   waiting      task `queued` but its run or step is not started (not normally reachable): left untouched
--   unsupported  no task for (queue_name, msg_id) ("no_task"), a task for the message body recorded in another
--                queue ("wrong_queue"), or a task whose (flow, step) is not among the pairs ("unsupported_route")
-- If any message is unsupported, or the worker's function is disabled: nothing is claimed, deferred or
-- archived, no attempt is consumed, and every message of the batch becomes visible again (vt = now).
-- Otherwise, atomically: queued tasks become `started` (attempts_count + 1, started_at, last_worker_id) and
-- their messages get visibility = effective step timeout + claim buffer; started ones are deferred; terminal
-- ones archived.
--
-- Returns rows, so a worker decodes no document:
--   outcome 'claimed'      one row per claimed task: msg_id, flow_slug, run_id, step_slug, task_index, input,
--                          flow_input, attempts_count (the attempt this claim started: every result carries
--                          it, the fence), timeout (the effective step timeout in seconds), report (the run's
--                          trace context, NULL without one); in msg_id order
--   outcome 'deferred' | 'archived' | 'waiting'   one row per such message (msg_id only)
--   outcome 'unsupported'  exactly one row, report = {"queue_name", "msg_ids" (the whole batch, visible again),
--                          "unsupported_msg_ids", "flows", "steps", "messages": [{"msg_id", "reason",
--                          "flow_slug", "step_slug"}], "supported": [[flow, step], ...]} without message bodies
--   outcome 'disabled'     exactly one row, report = {"function_name", "reason", "disabled_at"}
-- An empty batch returns no row.
create function pgflow.claim_tasks(queue_name text, msg_ids bigint[], worker_id uuid, flow_slugs text[], step_slugs text[])
returns table(outcome text, msg_id bigint, flow_slug text, run_id uuid, step_slug text, task_index integer, input jsonb, flow_input jsonb, attempts_count integer, timeout integer, report jsonb)
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
as $$
begin
  return query
  select * from pgflow._claim_tasks(claim_tasks.queue_name, claim_tasks.msg_ids, claim_tasks.worker_id,
                                    claim_tasks.flow_slugs, claim_tasks.step_slugs, null);
end;
$$;

create function pgflow.read_and_claim_tasks(
  queue_name text,
  qty int,
  vt int,
  worker_id uuid,
  flow_slugs text[],
  step_slugs text[]
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
  report jsonb
)
language plpgsql
volatile
security definer
set search_path = ''
set plan_cache_mode = force_generic_plan
set enable_seqscan = off
as $$
declare
  v_ids bigint[];
begin
  if read_and_claim_tasks.qty is null or read_and_claim_tasks.qty < 0 then
    raise exception 'read_and_claim_tasks(): qty must be how many messages of queue "%" to read at most, got %.',
        read_and_claim_tasks.queue_name, coalesce(read_and_claim_tasks.qty::text, 'NULL')
      using errcode = 'invalid_parameter_value',
            hint = 'Pass 0 or more (a worker passes its free handler slots); NULL is not "the whole queue".';
  end if;
  -- Lock order step 3: the messages (SKIP LOCKED, so their order does not matter), by rank on a queue with
  -- priorities (18_priorities.sql), else by msg_id.
  v_ids := pgflow._queue_op(read_and_claim_tasks.queue_name,
                            case when exists (select 1 from pgflow.queue_priorities p
                                              where p.queue_name = lower(read_and_claim_tasks.queue_name))
                                 then 'lock_visible_ranked' else 'lock_visible' end,
                            null, null, read_and_claim_tasks.qty);
  if v_ids is null then
    return;
  end if;
  return query
  select * from pgflow._claim_tasks(read_and_claim_tasks.queue_name, v_ids, read_and_claim_tasks.worker_id,
                                    read_and_claim_tasks.flow_slugs, read_and_claim_tasks.step_slugs,
                                    coalesce(read_and_claim_tasks.vt, 0));
end;
$$;

-- Upstream's form: the flow's one queue, then the form above (which replans when needed).
create function pgflow.start_tasks(flow_slug text, msg_ids bigint[], worker_id uuid)
returns setof pgflow.step_task_record
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
as $$
declare
  v_queues text[];
begin
  select array_agg(distinct s.queue_name) into v_queues
  from pgflow.steps s
  where s.flow_slug = start_tasks.flow_slug;

  if v_queues is null then
    return;
  elsif cardinality(v_queues) > 1 then
    raise exception 'start_tasks(): flow "%" sends its tasks to % queues (%)',
        start_tasks.flow_slug, cardinality(v_queues), array_to_string(v_queues, ', ')
      using hint = 'Call start_tasks(flow_slug, msg_ids, worker_id, queue_name) with the queue the messages were read from.';
  end if;

  return query
  select * from pgflow.start_tasks(start_tasks.flow_slug, start_tasks.msg_ids, start_tasks.worker_id, v_queues[1]);
end;
$$;

-- Claims the queued tasks behind `msg_ids` read from queue `queue_name` and returns them ready to run.
--
-- * Only tasks that are `queued`, of a started run and a started step are claimed; other messages are ignored
--   (a started task's message seen again, or a terminal task's, is not an error).
-- * The messages are locked first, then the task rows, then one guarded UPDATE claims them; rows come from its
--   RETURNING, so of two overlapping claims of one message exactly one returns the task.
-- * Before returning, every claimed message gets visibility = effective step timeout + claim buffer
--   (pgflow._claim_visibility_buffer_seconds()). If any claimed message could not be updated (it is missing
--   from its queue), the whole claim fails with `start_tasks(): visibility updated N of M claimed messages` and
--   nothing is claimed.
-- * flow_slug NULL claims tasks of any flow in that queue.
create function pgflow.start_tasks(flow_slug text, msg_ids bigint[], worker_id uuid, queue_name text)
returns setof pgflow.step_task_record
language plpgsql
security definer
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
set enable_seqscan = 'off'
as $$
declare
  v_queue text := lower(start_tasks.queue_name);
  v_claimed bigint[];
  v_vts timestamptz[];
  v_updated int;
begin
  if msg_ids is null or cardinality(msg_ids) = 0 then
    return;
  end if;
  perform pgflow._replan_if_grown();

  perform pgflow._lock_messages(v_queue, start_tasks.msg_ids);

  -- Each task found by its message's key, locked in message order (FINDING A MESSAGE'S TASK, above).
  with candidates as (
    select t.run_id, t.step_slug, t.task_index
    from unnest(array(select distinct i from unnest(start_tasks.msg_ids) as i where i is not null order by i))
           as m(id)
    cross join lateral (
      select t.* from pgflow.step_tasks t
      where t.queue_name = v_queue and t.message_id = m.id
        and (start_tasks.flow_slug is null or t.flow_slug = start_tasks.flow_slug)
        and t.status = 'queued'
      for update
    ) t
  ),
  claimed as (
    update pgflow.step_tasks t
    set status = 'started',
        attempts_count = t.attempts_count + 1,
        -- A claim whose transaction began before the task was queued still starts it no earlier
        -- than it was queued (started_at_is_after_queued_at).
        started_at = greatest(now(), t.queued_at),
        last_worker_id = start_tasks.worker_id
    from candidates c, pgflow.runs r, pgflow.step_states ss
    where t.run_id = c.run_id and t.step_slug = c.step_slug and t.task_index = c.task_index
      and t.status = 'queued'
      and r.run_id = t.run_id and r.status = 'started'
      and ss.run_id = t.run_id and ss.step_slug = t.step_slug and ss.status = 'started'
    returning t.message_id, t.flow_slug, t.step_slug
  )
  select array_agg(c.message_id order by c.message_id),
         array_agg(clock_timestamp() + make_interval(secs => coalesce(s.opt_timeout, f.opt_timeout)::float8
                                                             + pgflow._claim_visibility_buffer_seconds())
                   order by c.message_id)
  into v_claimed, v_vts
  from claimed c
  join pgflow.steps s on s.flow_slug = c.flow_slug and s.step_slug = c.step_slug
  join pgflow.flows f on f.flow_slug = c.flow_slug;

  if v_claimed is null then
    return;
  end if;

  -- Visibility only: read count and last read time as they were (p_n = 0).
  v_updated := coalesce(cardinality(pgflow._queue_op(v_queue, 'visibility', v_claimed, v_vts, 0)), 0);
  if v_updated <> cardinality(v_claimed) then
    raise exception 'start_tasks(): visibility updated % of % claimed messages', v_updated, cardinality(v_claimed)
      using detail = format('queue %s, messages %s', v_queue, v_claimed::text),
            hint = 'A claimed message is missing from its queue; no task was claimed.';
  end if;

  return query
  select c.flow_slug, c.run_id, c.step_slug, c.input, c.msg_id, c.task_index, c.flow_input
  from pgflow._claimed_rows(v_queue, v_claimed) c;
end;
$$;

create function pgflow.set_vt_batch(queue_name text, msg_ids bigint[], vt_offsets integer[])
returns table (msg_id bigint, read_ct integer, enqueued_at timestamptz, vt timestamptz, message jsonb, headers jsonb)
language plpgsql
volatile
security definer
set search_path = ''
as $$
begin
  -- A worker role changes only queues pgflow routes tasks to; an admin, any queue (as upstream).
  if not exists (select 1 from pgflow.steps s where s.queue_name = lower(set_vt_batch.queue_name))
     and not exists (select 1 from pgflow.shared_queues sq where sq.queue_name = lower(set_vt_batch.queue_name))
     and not pgflow._caller_is_admin() then
    raise exception 'set_vt_batch(): queue "%" is not a queue pgflow routes tasks to.', set_vt_batch.queue_name
      using errcode = 'invalid_parameter_value',
            hint = 'Pass the queue of a compiled flow''s step; other PGMQ queues are not pgflow''s to change.';
  end if;
  if msg_ids is null or vt_offsets is null or coalesce(array_length(msg_ids, 1), 0) = 0 then
    return;
  end if;
  if coalesce(array_length(msg_ids, 1), 0) <> coalesce(array_length(vt_offsets, 1), 0) then
    raise exception 'msg_ids length (%) must equal vt_offsets length (%)',
      coalesce(array_length(msg_ids, 1), 0), coalesce(array_length(vt_offsets, 1), 0);
  end if;

  return query execute format(
    'update pgmq.%I q set vt = clock_timestamp() + make_interval(secs => v.off)
       from unnest($1::bigint[], $2::int[]) as v(id, off)
      where q.msg_id = v.id
      returning q.msg_id, q.read_ct, q.enqueued_at, q.vt, q.message, q.headers',
    pgmq.format_table_name(set_vt_batch.queue_name, 'q'))
  using msg_ids, vt_offsets;
end;
$$;

-- Deprecated upstream since the two-phase protocol (read, then start_tasks); kept so old callers get a clear
-- notice instead of a missing function.
create function pgflow.poll_for_tasks(queue_name text, vt integer, qty integer, max_poll_seconds integer default 5, poll_interval_ms integer default 100)
returns setof pgflow.step_task_record
language plpgsql
set search_path = ''
as $$
begin
  raise notice 'pgflow.poll_for_tasks() is deprecated and returns nothing: read messages with pgmq.read() and claim them with pgflow.start_tasks()';
  return;
end;
$$;
