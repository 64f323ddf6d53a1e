-- pgflow-rs SQL core, migration 0019: generic plans on the hot path, and room for HOT updates of runs.
--
-- PL/pgSQL caches a plan per statement and, under the default plan_cache_mode (auto), plans the first five
-- executions of each statement with their parameter values before it settles on a generic plan. Every new
-- connection (a worker's pool, a client's) therefore pays full planning for each statement of the claim and
-- completion path five times, and statements whose custom plans look cheaper never settle: measured on a
-- single-task exchange, planning was about half its time. The hot-path statements look rows up by key, so
-- the generic plan is the right plan whatever the values: these functions pin it. The setting applies to
-- everything the function calls (a function's SET clause lasts for its whole call). Behaviour is unchanged.
alter function pgflow.exchange(text, uuid, text[], text[], integer, integer, uuid[], text[], integer[], jsonb[], integer[])
  set plan_cache_mode = force_generic_plan;
alter function pgflow.read_and_claim_tasks(text, integer, integer, uuid, text[], text[])
  set plan_cache_mode = force_generic_plan;
alter function pgflow.claim_tasks(text, bigint[], uuid, text[], text[])
  set plan_cache_mode = force_generic_plan;
alter function pgflow.start_tasks(text, bigint[], uuid)
  set plan_cache_mode = force_generic_plan;
alter function pgflow.start_tasks(text, bigint[], uuid, text)
  set plan_cache_mode = force_generic_plan;
alter function pgflow.complete_task(uuid, text, integer, jsonb)
  set plan_cache_mode = force_generic_plan;
alter function pgflow.complete_task(uuid, text, integer, jsonb, integer, uuid)
  set plan_cache_mode = force_generic_plan;
alter function pgflow.complete_tasks(uuid[], text[], integer[], jsonb[], integer[], uuid)
  set plan_cache_mode = force_generic_plan;
alter function pgflow.fail_task(uuid, text, integer, text)
  set plan_cache_mode = force_generic_plan;
alter function pgflow.fail_task(uuid, text, integer, text, integer, uuid, integer, boolean)
  set plan_cache_mode = force_generic_plan;
alter function pgflow.start_flow(text, jsonb, uuid)
  set plan_cache_mode = force_generic_plan;
alter function pgflow.start_flow_with_states(text, jsonb, uuid)
  set plan_cache_mode = force_generic_plan;

-- A run row is updated once per finished step (remaining_steps) and once when the run ends. Free space on
-- its page lets PostgreSQL keep those updates on the page without new index entries (HOT updates), so the
-- runs table and its indexes grow with runs, not with steps. Applies to pages written from now on.
alter table pgflow.runs set (fillfactor = 85);
