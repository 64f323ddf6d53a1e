-- Privileges: nothing in schema pgflow is usable by PUBLIC; one list of functions per role.
--
-- The entry points a worker or a client calls run with the rights of their owner (the role that installed
-- pgflow: `security definer`, with an empty search_path, written in each function's own definition), so the
-- roles that call them need EXECUTE on exactly those functions and no rights on the tables or on PGMQ.
-- pgflow.grant_worker_privileges(role) and pgflow.grant_client_privileges(role) grant exactly the lists below
-- (OPERATIONS.md shows the same lists); everything else (definitions, deletion, the fence's enable side,
-- operator decisions, retention of all history) stays with the owner.

revoke all on schema pgflow from public;

-- The functions a worker calls: compilation, registration and heartbeats, claiming, results, recovery and
-- retention. Signatures as regprocedure text; a change that adds an entry point adds it here.
create function pgflow._worker_api()
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
    'pgflow.run_maintenance(interval,interval,integer)',
    'pgflow.cancelled_tasks(uuid[],text[],integer[],integer[])',
    'pgflow.queue_stats()',
    'pgflow.set_schedule(text,text,text,text,jsonb,text,integer,text,timestamp with time zone)',
    'pgflow.due_schedules(timestamp with time zone,integer)',
    'pgflow.fire_schedule(text,timestamp with time zone,timestamp with time zone[],timestamp with time zone,text)'
  ]
$$;

-- The functions a client calls: start runs (with idempotency keys and priorities too), read them, and control them (cancel,
-- retry, replay).
create function pgflow._client_api()
returns text[]
language sql
immutable
as $$
  select array[
    'pgflow.start_flow(text,jsonb,uuid)',
    'pgflow.start_flows(text,jsonb[],uuid[])',
    'pgflow.start_flow_with_states(text,jsonb,uuid)',
    'pgflow.get_run_with_states(uuid)',
    'pgflow.run_channel(uuid)',
    'pgflow.resolve_flow_slug(text)',
    'pgflow.watch_run(uuid)',
    'pgflow.unwatch_run(uuid)',
    'pgflow.start_flows_with_keys(text,jsonb[],text[],uuid[],interval)',
    'pgflow.start_flow(text,jsonb,uuid,integer)',
    'pgflow.start_flows(text,jsonb[],uuid[],integer[])',
    'pgflow.start_flows_with_keys(text,jsonb[],text[],uuid[],interval,integer[])',
    'pgflow.cancel_run(uuid,text)',
    'pgflow.cancel_runs(text,text,timestamp with time zone,text[],jsonb,text,integer,boolean)',
    'pgflow.retry_run(uuid,text)',
    'pgflow.replay_run(uuid,text)',
    'pgflow.queue_stats()'
  ]
$$;

-- Grants `role_name` what a pgflow-rs worker needs, and nothing more:
--   usage on schema pgflow; execute on pgflow._worker_api(); select on pgflow.schema_migrations (the worker's
--   schema-version check), pgflow.runs (StepContext::flow_input) and the view pgflow.queue_coverage.
-- Run it as the owner of the pgflow schema (the installing role), again after upgrades that add functions.
create function pgflow.grant_worker_privileges(role_name text)
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_fn text;
begin
  execute format('grant usage on schema pgflow to %I', role_name);
  foreach v_fn in array pgflow._worker_api() loop
    execute format('grant execute on function %s to %I', v_fn::regprocedure, role_name);
  end loop;
  execute format('grant select on pgflow.runs, pgflow.queue_coverage to %I', role_name);
  -- Created by the installer (pgflow_sql::install or the printed script) before the migrations.
  if to_regclass('pgflow.schema_migrations') is not null then
    execute format('grant select on pgflow.schema_migrations to %I', role_name);
  end if;
end;
$$;

-- Grants `role_name` what a client (starting runs, waiting for them, reading their state) needs:
--   usage on schema pgflow; execute on pgflow._client_api(); select on pgflow.runs and pgflow.step_states.
-- Run it as the owner of the pgflow schema.
create function pgflow.grant_client_privileges(role_name text)
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_fn text;
begin
  execute format('grant usage on schema pgflow to %I', role_name);
  foreach v_fn in array pgflow._client_api() loop
    execute format('grant execute on function %s to %I', v_fn::regprocedure, role_name);
  end loop;
  execute format('grant select on pgflow.runs, pgflow.step_states to %I', role_name);
end;
$$;

revoke execute on all functions in schema pgflow from public;
alter default privileges in schema pgflow revoke execute on functions from public;
