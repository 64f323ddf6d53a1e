//! One run in detail: its row, steps, tasks, retries, replays, its event log and the operator actions taken on it.

use chrono::{DateTime, Utc};
use serde_json::Value;
use uuid::Uuid;

use super::attempts::{attempts_of, Attempt, TaskAttempt};
use super::{Admin, AdminError, OperatorAction, StepType, TaskStatus};
use crate::client::{RunStatus, StepStatus};

/// The most tasks of one step a [`RunDetail`] lists: the first ones by task index, plus up to as many failed
/// ones beyond them. A map step's full count is in [`StepDetail::total_tasks`].
pub(super) const TASKS_PER_STEP: i64 = 200;

/// A run as [`Admin::run`] reports it.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct RunDetail {
    /// The run row.
    pub run: RunInfo,
    /// Its steps in definition order, with their state in this run.
    pub steps: Vec<StepDetail>,
    /// Its tasks by step (in step order) and task index; per step at most the first 200 and the failed ones.
    pub tasks: Vec<TaskDetail>,
    /// The earlier attempts of those tasks (each task's current or last attempt is its [`TaskDetail`]), by
    /// task and then in the order they ended; per task the latest
    /// [`ATTEMPTS_PER_TASK`](super::ATTEMPTS_PER_TASK).
    pub attempts: Vec<TaskAttempt>,
    /// Its retries in place, oldest first (`pgflow.run_retries`).
    pub retries: Vec<RetryRecord>,
    /// The runs that replay it (newest first, at most 50).
    pub replays: Vec<Uuid>,
    /// The operator actions taken on it (newest first, at most 50).
    pub actions: Vec<OperatorAction>,
    /// Its entries in the event log `pgflow.events` (newest first, at most 50): failures, cancellation,
    /// retries, replays, stale results.
    pub events: Vec<RunEvent>,
}

/// An entry of the event log about a run (`pgflow.events`).
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
#[non_exhaustive]
pub struct RunEvent {
    /// Its id, in the order logged.
    pub event_id: i64,
    /// When.
    pub occurred_at: DateTime<Utc>,
    /// What (`task_failed`, `run_failed`, `run_cancelled`, `run_retried`, `run_replayed`, ...).
    pub kind: String,
    /// What made it happen (`attempts_exhausted`, `operator`, ...).
    pub cause: String,
    /// Who: a worker id, or the database role of an operator.
    pub actor: Option<String>,
    /// The step it concerns.
    pub step_slug: Option<String>,
    /// The task it concerns.
    pub task_index: Option<i32>,
    /// The worker it concerns.
    pub worker_id: Option<Uuid>,
    /// Its details.
    pub detail: Value,
}

impl RunDetail {
    /// The tasks that failed for good.
    pub fn failed_tasks(&self) -> impl Iterator<Item = &TaskDetail> {
        self.tasks.iter().filter(|t| t.status == TaskStatus::Failed)
    }

    /// The tasks of one step.
    pub fn tasks_of<'a>(&'a self, step_slug: &'a str) -> impl Iterator<Item = &'a TaskDetail> {
        self.tasks.iter().filter(move |t| t.step_slug == step_slug)
    }

    /// The earlier attempts of one task, in the order they ended (its current or last attempt is its
    /// [`TaskDetail`]).
    pub fn attempts_of<'a>(
        &'a self,
        step_slug: &'a str,
        task_index: i32,
    ) -> impl Iterator<Item = &'a TaskAttempt> {
        self.attempts
            .iter()
            .filter(move |a| a.step_slug == step_slug && a.task_index == task_index)
    }

    /// Every attempt of `task` listed, oldest first: its earlier attempts, then its current or last one (a
    /// task that is queued and never started has that one only, queued).
    pub fn attempt_list<'a>(&'a self, task: &'a TaskDetail) -> Vec<Attempt<'a>> {
        self.attempts_of(&task.step_slug, task.task_index)
            .map(Attempt::earlier)
            .chain(std::iter::once(Attempt::current(task)))
            .collect()
    }

    /// One step.
    pub fn step(&self, step_slug: &str) -> Option<&StepDetail> {
        self.steps.iter().find(|s| s.step_slug == step_slug)
    }
}

/// The run row (`pgflow.runs`).
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
#[non_exhaustive]
pub struct RunInfo {
    /// The run id.
    pub run_id: Uuid,
    /// Its concrete version (flow slug).
    pub flow_slug: String,
    /// The aliases pointing at that version now.
    pub aliases: Vec<String>,
    /// Its status.
    pub status: RunStatus,
    /// Its input (`None` when payloads are hidden).
    pub input: Option<Value>,
    /// Its output, once completed (`None` when payloads are hidden).
    pub output: Option<Value>,
    /// Steps not finished yet.
    pub remaining_steps: i32,
    /// When it started.
    pub started_at: DateTime<Utc>,
    /// When it completed.
    pub completed_at: Option<DateTime<Utc>>,
    /// When it failed.
    pub failed_at: Option<DateTime<Utc>>,
    /// When it was cancelled.
    pub cancelled_at: Option<DateTime<Utc>>,
    /// Why it was cancelled.
    pub cancel_reason: Option<String>,
    /// The run it replays.
    pub replay_of: Option<Uuid>,
    /// How many times it was retried in place.
    pub retry_count: i32,
}

/// A step of the run: its definition and its state.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
#[non_exhaustive]
pub struct StepDetail {
    /// The step slug.
    pub step_slug: String,
    /// Its position in the flow definition.
    pub step_index: i32,
    /// A single step or a map step.
    pub step_type: StepType,
    /// The steps it depends on (from the flow definition).
    pub deps: Vec<String>,
    /// The queue its tasks go to.
    pub queue_name: String,
    /// Its status in this run.
    pub status: StepStatus,
    /// How many tasks it has (a map step: its array's length), once started.
    pub total_tasks: Option<i32>,
    /// How many of them are not finished, once started.
    pub remaining_tasks: Option<i32>,
    /// Its output (a map step: the array of its tasks' outputs; `None` when payloads are hidden).
    pub output: Option<Value>,
    /// Its error, when it failed.
    pub error_message: Option<String>,
    /// Why it was skipped.
    pub skip_reason: Option<String>,
    /// When its state was created.
    pub created_at: DateTime<Utc>,
    /// When it started.
    pub started_at: Option<DateTime<Utc>>,
    /// When it completed, failed or was skipped.
    pub finished_at: Option<DateTime<Utc>>,
}

impl StepDetail {
    /// `(finished, total)` tasks once the step started (a map step's k of N); `None` before it starts or when
    /// it was skipped.
    pub fn progress(&self) -> Option<(i32, i32)> {
        if matches!(self.status, StepStatus::Created | StepStatus::Skipped) {
            return None;
        }
        let total = self.total_tasks?;
        Some((total - self.remaining_tasks.unwrap_or(total), total))
    }

    /// Whether this is a map step.
    pub fn is_map(&self) -> bool {
        self.step_type == StepType::Map
    }
}

/// A task of the run with its current or last attempt; its earlier attempts are in [`RunDetail::attempts`]
/// ([`RunDetail::attempts_of`]).
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
#[non_exhaustive]
pub struct TaskDetail {
    /// The step slug.
    pub step_slug: String,
    /// The task index (a map step's element).
    pub task_index: i32,
    /// Its status.
    pub status: TaskStatus,
    /// Attempts made in all (the latest attempt's number).
    pub attempts: i32,
    /// Attempts made before the run's last retry in place (the attempt budget counts from here).
    pub attempts_base: i32,
    /// When it was first queued (or queued again by the run's last retry in place).
    pub queued_at: DateTime<Utc>,
    /// When its current or last attempt was queued: the latest of `queued_at`, its last requeue by recovery
    /// and the end of its previous attempt.
    pub attempt_queued_at: DateTime<Utc>,
    /// When its latest attempt started.
    pub started_at: Option<DateTime<Utc>>,
    /// When it completed.
    pub completed_at: Option<DateTime<Utc>>,
    /// When it failed (its latest failure; a task that will be retried is queued again).
    pub failed_at: Option<DateTime<Utc>>,
    /// The worker of its latest attempt.
    pub worker_id: Option<Uuid>,
    /// That worker's function name.
    pub worker_function: Option<String>,
    /// Its latest error.
    pub error_message: Option<String>,
    /// Its output (`None` when payloads are hidden).
    pub output: Option<Value>,
    /// Its queue and message id.
    pub queue_name: String,
    /// Its PGMQ message id.
    pub message_id: Option<i64>,
    /// How many times recovery sent it back to the queue (a dead worker, a stall).
    pub requeued_count: i32,
}

/// One retry in place of the run (`pgflow.run_retries`).
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
#[non_exhaustive]
pub struct RetryRecord {
    /// 1 for the first retry.
    pub retry_number: i32,
    /// When.
    pub retried_at: DateTime<Utc>,
    /// By whom (the role).
    pub retried_by: String,
    /// The run's status before it.
    pub previous_status: String,
    /// The cancel reason before it.
    pub previous_cancel_reason: Option<String>,
    /// The failed tasks of the earlier try: `[{step_slug, task_index, attempts, error_message}]`.
    pub errors: Value,
}

const RUN: &str = "select r.run_id, r.flow_slug, \
     array(select a.alias from pgflow.flow_aliases a where a.flow_slug = r.flow_slug order by a.alias) as aliases, \
     r.status, case when $2 then null else r.input end as input, \
     case when $2 then null else r.output end as output, r.remaining_steps, r.started_at, r.completed_at, \
     r.failed_at, r.cancelled_at, r.cancel_reason, r.replay_of, r.retry_count \
     from pgflow.runs r where r.run_id = $1";

const STEPS: &str = "select s.step_slug, s.step_index, s.step_type, \
     array(select d.dep_slug from pgflow.deps d where d.flow_slug = s.flow_slug and d.step_slug = s.step_slug \
           order by d.dep_slug) as deps, \
     s.queue_name, ss.status, ss.initial_tasks as total_tasks, ss.remaining_tasks, \
     case when $3 then null else ss.output end as output, ss.error_message, ss.skip_reason, ss.created_at, \
     ss.started_at, coalesce(ss.completed_at, ss.failed_at, ss.skipped_at) as finished_at \
     from pgflow.steps s join pgflow.step_states ss on ss.run_id = $1 and ss.step_slug = s.step_slug \
     where s.flow_slug = $2 order by s.step_index";

const TASKS: &str = "select t.step_slug, t.task_index, t.status, t.attempts_count as attempts, t.attempts_base, \
     t.queued_at, greatest(t.queued_at, t.last_requeued_at, \
       (select max(a.ended_at) from pgflow.task_attempts a \
        where a.run_id = t.run_id and a.step_slug = t.step_slug and a.task_index = t.task_index)) \
       as attempt_queued_at, t.started_at, t.completed_at, t.failed_at, t.last_worker_id as worker_id, \
     w.function_name as worker_function, t.error_message, \
     case when $3 then null else t.output end as output, t.queue_name, t.message_id, t.requeued_count \
     from pgflow.steps s \
     cross join lateral ( \
       (select x.* from pgflow.step_tasks x where x.run_id = $1 and x.step_slug = s.step_slug \
        order by x.task_index limit $4) \
       union \
       (select x.* from pgflow.step_tasks x where x.run_id = $1 and x.step_slug = s.step_slug \
        and x.status = 'failed' order by x.task_index limit $4) \
     ) t \
     left join pgflow.workers w on w.worker_id = t.last_worker_id \
     where s.flow_slug = $2 order by s.step_index, t.task_index";

const EVENTS: &str =
    "select event_id, occurred_at, kind, cause, actor, step_slug, task_index, worker_id, detail \
     from pgflow.events where run_id = $1 order by event_id desc limit 50";

const RETRIES: &str =
    "select retry_number, retried_at, retried_by, previous_status, previous_cancel_reason, \
     errors from pgflow.run_retries where run_id = $1 order by retry_number";

const REPLAYS: &str = "select r.run_id from pgflow.runs r where r.replay_of = $1 \
     order by r.started_at desc limit 50";

impl Admin {
    /// Run `run_id` in detail, or `None` when there is no such run (never started, or removed by retention).
    /// A bounded read whatever the history: one run's rows, at most 200 tasks per step plus failed ones.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn run(&self, run_id: Uuid) -> Result<Option<RunDetail>, AdminError> {
        let hide = self.hide_payloads;
        let p = self.persistent();
        let mut tx = self.read().await?;
        let run: Option<RunInfo> = sqlx::query_as(RUN)
            .bind(run_id)
            .bind(hide)
            .persistent(p)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(run) = run else {
            tx.commit().await?;
            return Ok(None);
        };
        let steps: Vec<StepDetail> = sqlx::query_as(STEPS)
            .bind(run_id)
            .bind(&run.flow_slug)
            .bind(hide)
            .persistent(p)
            .fetch_all(&mut *tx)
            .await?;
        let tasks: Vec<TaskDetail> = sqlx::query_as(TASKS)
            .bind(run_id)
            .bind(&run.flow_slug)
            .bind(hide)
            .bind(TASKS_PER_STEP)
            .persistent(p)
            .fetch_all(&mut *tx)
            .await?;
        let attempts = attempts_of(&mut tx, run_id, &tasks, p).await?;
        let retries: Vec<RetryRecord> = sqlx::query_as(RETRIES)
            .bind(run_id)
            .persistent(p)
            .fetch_all(&mut *tx)
            .await?;
        let replays: Vec<Uuid> = sqlx::query_scalar(REPLAYS)
            .bind(run_id)
            .persistent(p)
            .fetch_all(&mut *tx)
            .await?;
        let events: Vec<RunEvent> = sqlx::query_as(EVENTS)
            .bind(run_id)
            .persistent(p)
            .fetch_all(&mut *tx)
            .await?;
        let actions = Self::actions_in(&mut tx, Some(run_id), 50, p).await?;
        tx.commit().await?;
        Ok(Some(RunDetail {
            run,
            steps,
            tasks,
            attempts,
            retries,
            replays,
            actions,
            events,
        }))
    }
}
