-- The operator's record: one row per write action taken from an operator tool (the dashboard's cancel, retry,
-- replay, schedule pause and resume), whether it succeeded or was refused by the SQL core.
--
-- Owns: the table operator_actions. The actions themselves go through the functions of 13_run_control.sql and
-- 15_schedules.sql; the tool records each one here in the same transaction as its outcome is known. Nothing
-- here is PUBLIC's: the tool connects as a role that owns pgflow or is granted insert and select on this table.

create table pgflow.operator_actions (
  action_id bigint generated always as identity primary key,
  -- When, who (the name the tool authenticated, e.g. the dashboard's operator), and from where.
  at timestamptz not null default now(),
  actor text not null,
  source text not null default 'dashboard',
  -- What: 'cancel', 'retry', 'replay', 'pause_schedule', 'resume_schedule'; the run or schedule it targeted.
  action text not null,
  run_id uuid,
  schedule_name text,
  -- The action's arguments (a cancel reason, the step a replay starts from) and its result (the replay's new
  -- run id, the status afterwards), or the error that refused it.
  detail jsonb not null default '{}'::jsonb,
  succeeded boolean not null,
  error text,
  constraint operator_actions_action_valid check (
    action in ('cancel', 'retry', 'replay', 'pause_schedule', 'resume_schedule')),
  constraint operator_actions_target check (run_id is not null or schedule_name is not null),
  constraint operator_actions_error_when_failed check (succeeded = (error is null))
);

-- The newest actions first, and the actions on one run.
create index idx_operator_actions_at on pgflow.operator_actions (at);
create index idx_operator_actions_run_id on pgflow.operator_actions (run_id) where run_id is not null;
