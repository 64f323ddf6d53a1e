-- pgflow-rs SQL core, migration 0011: the classifying claim of pgflow-rs workers, and the one lock order of
-- the SQL core.
--
-- THE LOCK ORDER. Every function of the SQL core that takes row locks takes them in this order, and never
-- waits for an earlier kind while holding a later one:
--
--   1. advisory locks: a flow slug's compile lock, then queue-name locks in sorted order (compilation); the
--      maintenance lock (recovery and retention, try-only, never waited for);
--   2. `pgflow.runs` rows (FOR NO KEY UPDATE): every change of a run's state is serialised on its run row;
--      several runs in run_id order (complete_tasks);
--   3. PGMQ message rows (`pgmq.q_<queue>`), per queue in msg_id order, several queues in queue-name order:
--      pgmq.read takes them for a claim; every other path locks a task's message explicitly
--      (pgflow._lock_messages) before it touches the task;
--   4. `pgflow.step_tasks` rows, in (queue_name, message_id) order;
--   5. then `pgflow.step_states` and the run's counters (under the run row of 2).
--
-- A claim (pgmq.read, then claim_tasks) starts at 3: it holds the messages it read and then locks their tasks.
-- Every other writer of a task holds that task's message first, so a claim never waits for a task row whose
-- holder waits for one of the claim's messages: the interleaving "read a message in one session, cancel its
-- task from another, claim it in the first" cannot deadlock. It ends either with the claim first (the task is
-- then cancelled with its message archived) or with the cancellation first (the claim archives the message of
-- the terminal task). Recovery paths (stalled tasks, dead workers) take messages and tasks with SKIP LOCKED,
-- so they never wait at all.
--
-- claim_tasks(queue_name, flow_slug, step_slug, msg_ids, worker_id) is the claim of per-step workers and the
-- classifying claim for plain workers (step_slug NULL). read_and_claim_tasks reads and claims in one call.
-- The upstream start_tasks forms (0007) stay as they are.

-- Claims the messages `msg_ids` that a worker read from `queue_name` for its subscription
-- (flow_slug, step_slug; step_slug NULL = every step of the flow, the plain-flow worker).
--
-- The complete batch is classified first, with every matching task row locked in message order:
--   claim        task in this queue, of this flow (and step), `queued`, run and step started
--   defer        task `started` (a duplicate visibility, benign): no attempt consumed; the message is hidden
--                until the task's recovery boundary, started_at + effective step timeout + stall buffer
--                (at least the claim buffer from now), the moment requeue_stalled_tasks() may requeue it
--   archive      task terminal (completed, failed, skipped, cancelled): the message is archived, idempotently
--   wait         task `queued` but its run or step is not started (not normally reachable): left untouched
--   unsupported  no task for (queue_name, msg_id) (reason "no_task"), a task for the message body's
--                (run_id, step_slug, task_index) recorded in another queue ("wrong_queue"), or a task of
--                another flow or step than the subscription ("unsupported_route")
--
-- If any message is unsupported, or the worker's function is disabled: nothing is claimed, deferred or
-- archived, no attempt is consumed, and every message of the batch becomes visible again (vt = now).
-- Otherwise, atomically: queued tasks become `started` (attempts_count + 1, started_at, last_worker_id) and
-- their messages get visibility = effective step timeout + claim buffer (checked for every claimed message;
-- a missing one raises `claim_tasks(): visibility updated N of M claimed messages` and rolls everything
-- back), started ones are deferred, terminal ones archived.
--
-- Returns one JSON object:
--   {"outcome": "claimed" | "unsupported" | "disabled",
--    "tasks":    [{"flow_slug", "run_id", "step_slug", "input", "msg_id", "task_index", "flow_input",
--                  "attempts_count", "timeout"}, ...]
--                (pgflow.step_task_record fields, plus the attempt this claim started, which every result must
--                carry (the fence of 0007), and the effective step timeout in seconds that the claim's
--                visibility is based on, so the worker's deadline and the visibility agree; in msg_id order;
--                empty unless outcome = claimed),
--    "deferred": [msg_id, ...], "archived": [msg_id, ...], "waiting": [msg_id, ...],
--    "unsupported": null | {"queue_name", "flow_slug", "step_slug"  (the subscription),
--                           "msg_ids"  (the whole batch, made visible again),
--                           "unsupported_msg_ids", "flows", "steps" (distinct, of the unsupported messages,
--                           from the task or else the message body),
--                           "messages": [{"msg_id", "reason", "flow_slug", "step_slug"}]}   (no bodies),
--    "disabled": null | {"function_name", "reason", "disabled_at"}}
-- The worker turns "unsupported" into a fatal stop: it calls pgflow.disable_worker_function() first.
create function pgflow.claim_tasks(
  queue_name text,
  flow_slug text,
  step_slug text,
  msg_ids bigint[],
  worker_id uuid
)
returns jsonb
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_queue text := lower(claim_tasks.queue_name);
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
  v_tasks jsonb;
begin
  if claim_tasks.flow_slug is null then
    raise exception 'claim_tasks(): flow_slug is required (the worker''s subscription)'
      using errcode = 'invalid_parameter_value';
  end if;
  select coalesce(array_agg(distinct i order by i), '{}') into v_ids from unnest(claim_tasks.msg_ids) as i where i is not null;
  if cardinality(v_ids) = 0 then
    return jsonb_build_object('outcome', 'claimed', 'tasks', '[]'::jsonb, 'deferred', '[]'::jsonb,
      'archived', '[]'::jsonb, 'waiting', '[]'::jsonb, 'unsupported', null, 'disabled', null);
  end if;
  v_table := pgmq.format_table_name(v_queue, 'q');

  -- Lock order step 3: the batch's messages (already held when pgmq.read ran in this transaction).
  perform pgflow._lock_messages(v_queue, v_ids);

  -- The fence: a worker of a disabled function claims nothing.
  select jsonb_build_object('function_name', wf.function_name, 'reason', wf.disabled_reason,
                            'disabled_at', wf.disabled_at)
  into v_disabled
  from pgflow.workers w
  join pgflow.worker_functions wf on wf.function_name = w.function_name
  where w.worker_id = claim_tasks.worker_id and not wf.enabled;

  -- Lock every task of the batch in (queue_name, message_id) order (as start_tasks and _terminate_tasks) and
  -- classify the complete batch in the same statement; a message without a task row is unsupported.
  with locked as (
    select t.message_id as id,
           t.run_id, t.step_slug, t.task_index, t.started_at,
           coalesce(s.opt_timeout, f.opt_timeout) as timeout,
           case
             when t.flow_slug <> claim_tasks.flow_slug
               or (claim_tasks.step_slug is not null and t.step_slug <> claim_tasks.step_slug) then 'unsupported'
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
         array_agg(c.timeout::float8 + pgflow._claim_visibility_buffer_seconds() order by c.id) filter (where c.kind = 'claim'),
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
    execute format('update pgmq.%I q set vt = clock_timestamp() where q.msg_id = any ($1)', v_table)
    using v_ids;

    if v_unsupported_ids is not null then
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
          'queue_name', $2, 'flow_slug', $3, 'step_slug', $4,
          'msg_ids', to_jsonb($5::bigint[]),
          'unsupported_msg_ids', to_jsonb($1::bigint[]),
          'flows', coalesce((select jsonb_agg(distinct r.flow_slug) from reasons r where r.flow_slug is not null), '[]'),
          'steps', coalesce((select jsonb_agg(distinct r.step_slug) from reasons r where r.step_slug is not null), '[]'),
          'messages', (select jsonb_agg(jsonb_build_object('msg_id', r.id, 'reason', r.reason,
                                        'flow_slug', r.flow_slug, 'step_slug', r.step_slug) order by r.id)
                       from reasons r))
      $q$, v_table)
      into v_report
      using v_unsupported_ids, v_queue, claim_tasks.flow_slug, claim_tasks.step_slug, v_ids;
    end if;

    return jsonb_build_object(
      'outcome', case when v_unsupported_ids is not null then 'unsupported' else 'disabled' end,
      'tasks', '[]'::jsonb, 'deferred', '[]'::jsonb, 'archived', '[]'::jsonb, 'waiting', '[]'::jsonb,
      'unsupported', v_report, 'disabled', v_disabled);
  end if;

  -- Fully supported batch: claim, defer, archive.
  if v_claim_ids is not null then
    update pgflow.step_tasks t
    set status = 'started',
        attempts_count = t.attempts_count + 1,
        -- A claim whose transaction began before the task was queued still starts it no earlier
        -- than it was queued (started_at_is_after_queued_at).
        started_at = greatest(now(), t.queued_at),
        last_worker_id = claim_tasks.worker_id
    from unnest(v_run_ids, v_step_slugs, v_task_indexes) as c(run_id, step_slug, task_index)
    where t.run_id = c.run_id and t.step_slug = c.step_slug and t.task_index = c.task_index
      and t.status = 'queued';

    execute format(
      'update pgmq.%I q set vt = clock_timestamp() + make_interval(secs => v.secs)
         from unnest($1::bigint[], $2::float8[]) as v(id, secs)
        where q.msg_id = v.id',
      v_table)
    using v_claim_ids, v_secs;
    get diagnostics v_updated = row_count;
    if v_updated <> cardinality(v_claim_ids) then
      raise exception 'claim_tasks(): visibility updated % of % claimed messages', v_updated, cardinality(v_claim_ids)
        using detail = format('queue %s, messages %s', v_queue, v_claim_ids::text),
              hint = 'A claimed message is missing from its queue; no task was claimed.';
    end if;
  end if;

  if v_defer_ids is not null then
    execute format(
      'update pgmq.%I q set vt = v.vt from unnest($1::bigint[], $2::timestamptz[]) as v(id, vt) where q.msg_id = v.id',
      v_table)
    using v_defer_ids, v_defer_vts;
  end if;

  if v_archive_ids is not null then
    perform pgmq.archive(v_queue, v_archive_ids);
  end if;

  if v_claim_ids is not null then
    select jsonb_agg(jsonb_build_object(
             'flow_slug', t.flow_slug,
             'run_id', t.run_id,
             'step_slug', t.step_slug,
             'input', i.input,
             'msg_id', c.msg_id,
             'task_index', t.task_index,
             'flow_input', i.flow_input,
             'attempts_count', t.attempts_count,
             'timeout', coalesce(s.opt_timeout, f.opt_timeout))
           order by c.ord)
    into v_tasks
    from unnest(v_run_ids, v_step_slugs, v_task_indexes, v_claim_ids)
           with ordinality as c(run_id, step_slug, task_index, msg_id, ord)
    join pgflow.step_tasks t on t.run_id = c.run_id and t.step_slug = c.step_slug and t.task_index = c.task_index
    join pgflow.steps s on s.flow_slug = t.flow_slug and s.step_slug = t.step_slug
    join pgflow.flows f on f.flow_slug = t.flow_slug
    join pgflow.runs r on r.run_id = t.run_id
    cross join lateral pgflow._task_inputs(t.run_id, t.flow_slug, t.step_slug, s.step_type, s.deps_count,
                                           t.element, r.input) i;
  end if;

  return jsonb_build_object(
    'outcome', 'claimed',
    'tasks', coalesce(v_tasks, '[]'::jsonb),
    'deferred', coalesce(to_jsonb(v_defer_ids), '[]'::jsonb),
    'archived', coalesce(to_jsonb(v_archive_ids), '[]'::jsonb),
    'waiting', coalesce(to_jsonb(v_wait_ids), '[]'::jsonb),
    'unsupported', null,
    'disabled', null);
end;
$$;

-- Reads up to `qty` visible messages from `queue_name` (hidden for `vt` seconds) and classifies and claims
-- them with claim_tasks(queue_name, flow_slug, step_slug, msg_ids, worker_id). Never sleeps.
-- Returns claim_tasks' JSON (every element of "tasks" carries its "attempts_count" after the claim).
-- An empty read returns {"outcome": "claimed", "tasks": [], ...} without calling claim_tasks.
create function pgflow.read_and_claim_tasks(
  queue_name text,
  flow_slug text,
  step_slug text,
  qty int,
  vt int,
  worker_id uuid
)
returns jsonb
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_ids bigint[];
begin
  select array_agg(m.msg_id) into v_ids
  from pgmq.read(read_and_claim_tasks.queue_name, read_and_claim_tasks.vt, read_and_claim_tasks.qty) m;
  if v_ids is null then
    return jsonb_build_object('outcome', 'claimed', 'tasks', '[]'::jsonb, 'deferred', '[]'::jsonb,
      'archived', '[]'::jsonb, 'waiting', '[]'::jsonb, 'unsupported', null, 'disabled', null);
  end if;

  return pgflow.claim_tasks(read_and_claim_tasks.queue_name, read_and_claim_tasks.flow_slug,
                            read_and_claim_tasks.step_slug, v_ids, read_and_claim_tasks.worker_id);
end;
$$;
