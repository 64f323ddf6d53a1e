-- pgflow-rs SQL core, migration 0013: queue coverage monitoring (which routes have queued work and no worker).
--
-- pgflow.queue_coverage lists every persisted route: one row per step of every flow, in step order.
--   flow_slug, step_slug, step_index, queue_mode, queue_name
--   queued_tasks          tasks of the route waiting in the queue
--   started_tasks         tasks of the route being executed
--   oldest_queued_at      queued_at of the oldest queued task (NULL when none)
--   oldest_queued_age     now() - oldest_queued_at
--   live_workers          workers subscribed to the route whose heartbeat is within
--                         pgflow._worker_liveness_window() (30 s), not stopped, and whose function is enabled
--   live_worker_ids       their ids
--   uncovered             true when the route has queued work and no live worker: tasks wait durably until a
--                         worker for this step (or the flow, in flow mode) starts
-- A worker covers a route when it polls the route's queue and its subscription is the route's flow (or
-- unknown, for workers registered the upstream way) and the route's step (or every step: step_slug NULL).
-- Counting reads only started step states (queued and started tasks exist only there), never task history.
create view pgflow.queue_coverage as
select s.flow_slug,
       s.step_slug,
       s.step_index,
       f.queue_mode,
       s.queue_name,
       coalesce(t.queued, 0) as queued_tasks,
       coalesce(t.started, 0) as started_tasks,
       t.oldest_queued_at,
       now() - t.oldest_queued_at as oldest_queued_age,
       coalesce(w.live, 0) as live_workers,
       coalesce(w.ids, '{}'::uuid[]) as live_worker_ids,
       coalesce(t.queued, 0) > 0 and coalesce(w.live, 0) = 0 as uncovered
from pgflow.steps s
join pgflow.flows f on f.flow_slug = s.flow_slug
left join lateral (
  select count(*) filter (where st.status = 'queued') as queued,
         count(*) filter (where st.status = 'started') as started,
         min(st.queued_at) filter (where st.status = 'queued') as oldest_queued_at
  from pgflow.step_states ss
  join pgflow.step_tasks st on st.run_id = ss.run_id and st.step_slug = ss.step_slug
  where ss.flow_slug = s.flow_slug and ss.step_slug = s.step_slug and ss.status = 'started'
) t on true
left join lateral (
  select count(*) as live, array_agg(wk.worker_id order by wk.worker_id) as ids
  from pgflow.workers wk
  left join pgflow.worker_functions wf on wf.function_name = wk.function_name
  where wk.queue_name = s.queue_name
    and (wk.flow_slug is null or wk.flow_slug = s.flow_slug)
    and (wk.step_slug is null or wk.step_slug = s.step_slug)
    and wk.stopped_at is null
    and wk.last_heartbeat_at > now() - pgflow._worker_liveness_window()
    and coalesce(wf.enabled, true)
) w on true;

comment on view pgflow.queue_coverage is
  'Every persisted route (flow, step, queue mode, queue) with queued/started task counts, the oldest queued task, and live subscribed workers; uncovered = queued work and no live worker.';
