-- pgflow-rs SQL core, migration 0010: storage for private per-step queues (seed 1, seed 2 Stage 2).
--
--   * flows.queue_mode                'flow' (every step on the flow's default queue, upstream's behaviour) or
--                                     'step' (every step on its own private queue). Deployment metadata,
--                                     persisted and compared separately from the flow shape.
--   * steps.queue_name                (from 0003) now also holds generated per-step names; the ordered
--                                     (step_slug, queue_name) pairs by step_index are the flow's route map.
--   * workers.flow_slug / step_slug   the exact subscription a worker registered with (NULL step_slug: every
--                                     step of the flow on its queue, the plain-flow worker).
--   * worker_functions.disabled_reason / disabled_at
--                                     the fence: a function disabled by pgflow.disable_worker_function().

alter table pgflow.flows
  add column queue_mode text not null default 'flow',
  add constraint queue_mode_is_valid check (queue_mode in ('flow', 'step'));

alter table pgflow.workers
  add column flow_slug text,
  add column step_slug text;

alter table pgflow.worker_functions
  add column disabled_reason text,
  add column disabled_at timestamptz;

-- Ownership checks (is a queue name already routed by some flow?) and coverage look steps up by queue.
create index idx_steps_queue_name on pgflow.steps (queue_name);
