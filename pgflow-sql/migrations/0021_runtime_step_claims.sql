-- pgflow-rs SQL core, migration 0021: the per-step worker's classifying claim in one round trip.
--
-- Addition only: read_and_claim_tasks reads from PGMQ and calls claim_tasks (0013) for the worker's exact
-- subscription.

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
