-- pgflow-rs SQL core, migration 0020: index probes, not sequential scans, on the hot path.
--
-- 0019 pinned the claim, completion, failure and start functions to generic plans. A generic plan does not
-- know how many keys an array parameter holds, so `run_id = any($1)` is costed as ten lookups. On the small
-- tables a busy but well-pruned installation has (a few thousand runs, tasks and step states), that makes a
-- sequential scan look cheaper than ten index probes, and the generic plans of the completion path scanned
-- runs, step_states and step_tasks whole. Measured on one session driving a diamond flow (four tasks a run)
-- hop by hop over 1,500 tasks of history: 26 ms of server time a run with those plans, 14 ms with index
-- probes. Large tables were never affected (the planner picks the index there anyway), which is why the
-- history benchmark stayed flat while the small-table case was slow.
--
-- Every statement on these paths looks rows up by key, so the functions turn sequential scans off for their
-- calls (a function's SET clause lasts for its whole call, nested calls included). A statement with no usable
-- index still runs as before: the setting only steers the planner where an index exists. Behaviour is
-- unchanged.
alter function pgflow.exchange(text, uuid, text[], text[], integer, integer, uuid[], text[], integer[], jsonb[], integer[])
  set enable_seqscan = off;
alter function pgflow.read_and_claim_tasks(text, integer, integer, uuid, text[], text[])
  set enable_seqscan = off;
alter function pgflow.claim_tasks(text, bigint[], uuid, text[], text[])
  set enable_seqscan = off;
alter function pgflow.start_tasks(text, bigint[], uuid)
  set enable_seqscan = off;
alter function pgflow.start_tasks(text, bigint[], uuid, text)
  set enable_seqscan = off;
alter function pgflow.complete_task(uuid, text, integer, jsonb)
  set enable_seqscan = off;
alter function pgflow.complete_task(uuid, text, integer, jsonb, integer, uuid)
  set enable_seqscan = off;
alter function pgflow.complete_tasks(uuid[], text[], integer[], jsonb[], integer[], uuid)
  set enable_seqscan = off;
alter function pgflow.fail_task(uuid, text, integer, text)
  set enable_seqscan = off;
alter function pgflow.fail_task(uuid, text, integer, text, integer, uuid, integer, boolean)
  set enable_seqscan = off;
alter function pgflow.start_flow(text, jsonb, uuid)
  set enable_seqscan = off;
alter function pgflow.start_flow_with_states(text, jsonb, uuid)
  set enable_seqscan = off;
