-- pgflow-rs SQL core, migration 0021: the per-step worker's classifying claim in one round trip.
--
-- Addition only: read_and_claim_tasks reads from PGMQ and calls claim_tasks (0013) for the worker's exact
-- subscription, adding each claimed task's attempt number.

-- Reads up to `qty` visible messages from `queue_name` (hidden for `vt` seconds) and classifies and claims
-- them with claim_tasks(queue_name, flow_slug, step_slug, msg_ids, worker_id). Never sleeps.
-- Returns claim_tasks' JSON; every element of "tasks" also carries "attempts_count" (after the claim).
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
  v_result jsonb;
  v_tasks jsonb;
begin
  select array_agg(m.msg_id) into v_ids
  from pgmq.read(read_and_claim_tasks.queue_name, read_and_claim_tasks.vt, read_and_claim_tasks.qty) m;
  if v_ids is null then
    return jsonb_build_object('outcome', 'claimed', 'tasks', '[]'::jsonb, 'deferred', '[]'::jsonb,
      'archived', '[]'::jsonb, 'waiting', '[]'::jsonb, 'unsupported', null, 'disabled', null);
  end if;

  v_result := pgflow.claim_tasks(read_and_claim_tasks.queue_name, read_and_claim_tasks.flow_slug,
                                 read_and_claim_tasks.step_slug, v_ids, read_and_claim_tasks.worker_id);

  if v_result ->> 'outcome' = 'claimed' and jsonb_array_length(v_result -> 'tasks') > 0 then
    select jsonb_agg(x.e || jsonb_build_object('attempts_count', t.attempts_count) order by x.o)
    into v_tasks
    from jsonb_array_elements(v_result -> 'tasks') with ordinality as x(e, o)
    join pgflow.step_tasks t
      on t.run_id = (x.e ->> 'run_id')::uuid
     and t.step_slug = x.e ->> 'step_slug'
     and t.task_index = (x.e ->> 'task_index')::int;
    v_result := jsonb_set(v_result, '{tasks}', v_tasks);
  end if;
  return v_result;
end;
$$;
