-- pgflow-rs SQL core: the operator's read paths and record.
--
-- * Indexes for the run list, paged newest first on (started_at, run_id): over every run, by flow, by status
--   (the two last replace the single-column indexes on flow_slug and status, which they also serve), and a
--   GIN index on the input for the list's input filter (containment).
-- * pgflow.operator_actions: who took which write action from an operator tool, when, and its outcome.

create index idx_runs_started on pgflow.runs (started_at, run_id);
create index idx_runs_flow_slug_started on pgflow.runs (flow_slug, started_at, run_id);
create index idx_runs_status_started on pgflow.runs (status, started_at, run_id);
create index idx_runs_input on pgflow.runs using gin (input jsonb_path_ops);
drop index pgflow.idx_runs_flow_slug;
drop index pgflow.idx_runs_status;

create table pgflow.operator_actions (
  action_id bigint generated always as identity primary key,
  at timestamptz not null default now(),
  actor text not null,
  source text not null default 'dashboard',
  action text not null,
  run_id uuid,
  schedule_name text,
  detail jsonb not null default '{}'::jsonb,
  succeeded boolean not null,
  error text,
  constraint operator_actions_action_valid check (
    action in ('cancel', 'retry', 'replay', 'pause_schedule', 'resume_schedule')),
  constraint operator_actions_target check (run_id is not null or schedule_name is not null),
  constraint operator_actions_error_when_failed check (succeeded = (error is null))
);
create index idx_operator_actions_at on pgflow.operator_actions (at);
create index idx_operator_actions_run_id on pgflow.operator_actions (run_id) where run_id is not null;
