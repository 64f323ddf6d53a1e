-- pgflow-rs SQL core, migration 0018: activating an alias on its own.
--
-- ensure_flow_compiled(..., alias => ...) still compiles and activates in one transaction. Workers now compile
-- first and activate only once their startup checks have passed: the worker function is not fenced, and the
-- queue's coverage holds with the alias pointing at the new version (activation and the coverage check run in
-- one transaction, rolled back on a gap). So a refused or fenced start changes no alias. Operators call
-- activate_alias directly to roll back to an earlier version, or to activate one whose workers run with
-- compilation skipped.
--
-- Lock order (see 0011): activation takes the flow slug's compile lock, then the alias lock (advisory key
-- space 3), both in step 1 of the order, before any row lock.

-- Points `alias` at the compiled concrete flow `flow_slug` (idempotent; records the previous target; emits
-- alias:activated). Returns {"alias", "flow_slug", "previous_flow_slug", "activated_at", "activated"}.
-- Raises PF019 for a flow that is not compiled, PF018 for an alias that is not allowed (see
-- _assert_alias_allowed).
create function pgflow.activate_alias(alias text, flow_slug text)
returns jsonb
language plpgsql
volatile
set search_path = ''
as $$
begin
  -- The concrete-slug lock first (as compilation takes it), then the alias lock inside _activate_alias.
  perform pg_advisory_xact_lock(1, hashtext(lower(activate_alias.flow_slug)));
  perform 1 from pgflow.flows f where f.flow_slug = activate_alias.flow_slug for key share;
  if not found then
    raise exception 'Alias "%" cannot point at flow "%": no flow has that slug.', activate_alias.alias,
        activate_alias.flow_slug
      using errcode = 'PF019',
            hint = 'Compile the flow first (start a worker that serves it, or call pgflow.ensure_flow_compiled), then activate its alias.';
  end if;
  return pgflow._activate_alias(activate_alias.alias, activate_alias.flow_slug);
end;
$$;

create or replace function pgflow._worker_api()
returns text[]
language sql
immutable
as $$
  select array[
    'pgflow.ensure_flow_compiled(text,jsonb,boolean,text,jsonb,text,boolean)',
    'pgflow.activate_alias(text,text)',
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

alter function pgflow.activate_alias(text, text) security definer;
revoke execute on all functions in schema pgflow from public;
