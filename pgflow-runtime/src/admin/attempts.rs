//! The earlier attempts of a run's tasks (`pgflow.task_attempts`): the attempts that ended without being their
//! task's last state. A task's current or last attempt is its [`TaskDetail`] itself.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, Postgres};
use uuid::Uuid;

use super::{AdminError, TaskDetail, TaskStatus};
use crate::decode::text_enum;

/// The most earlier attempts of one task a [`RunDetail`](super::RunDetail) lists: the latest ones.
pub const ATTEMPTS_PER_TASK: i64 = 50;

text_enum! {
    /// How an earlier attempt ended (`pgflow.task_attempts.outcome`).
    #[non_exhaustive]
    pub enum AttemptOutcome {
        /// The handler failed and the task was retried (after its backoff).
        Failed = "failed",
        /// No result within the step's timeout: recovery (or an operator resolving a permanently stalled
        /// task) sent it back to the queue.
        Stalled = "stalled",
        /// Its worker stopped heartbeating: recovery sent it back to the queue.
        WorkerLost = "worker_lost",
        /// Its worker handed it back at shutdown (the attempt's number is used again by the next claim).
        Released = "released",
        /// The attempt of the run's earlier try (failed or cancelled) that a retry in place started again.
        RunRetried = "run_retried",
    }
}

/// An earlier attempt of a task (`pgflow.task_attempts`).
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
#[non_exhaustive]
pub struct TaskAttempt {
    /// The step slug.
    pub step_slug: String,
    /// The task index.
    pub task_index: i32,
    /// The attempt's number (the task's attempts count then).
    pub attempt: i32,
    /// When the attempt was queued.
    pub queued_at: DateTime<Utc>,
    /// When it started.
    pub started_at: Option<DateTime<Utc>>,
    /// When it ended (failed, was requeued or released, or the run's try ended).
    pub ended_at: DateTime<Utc>,
    /// The worker that ran it.
    pub worker_id: Option<Uuid>,
    /// That worker's function name (while its worker row is kept).
    pub worker_function: Option<String>,
    /// How it ended.
    pub outcome: AttemptOutcome,
    /// Its error (a failure).
    pub error_message: Option<String>,
}

/// The latest [`ATTEMPTS_PER_TASK`] earlier attempts of each task named, by task and then in the order they
/// ended.
const ATTEMPTS: &str =
    "select a.step_slug, a.task_index, a.attempt, a.queued_at, a.started_at, a.ended_at, \
     a.worker_id, w.function_name as worker_function, a.outcome, a.error_message \
     from unnest($2::text[], $3::int[]) as i(step_slug, task_index) \
     cross join lateral ( \
       select x.* from pgflow.task_attempts x \
       where x.run_id = $1 and x.step_slug = i.step_slug and x.task_index = i.task_index \
       order by x.attempt_id desc limit $4 \
     ) a \
     left join pgflow.workers w on w.worker_id = a.worker_id \
     order by a.step_slug, a.task_index, a.attempt_id";

/// The earlier attempts of `tasks` of run `run_id`.
pub(super) async fn attempts_of(
    conn: &mut PgConnection,
    run_id: Uuid,
    tasks: &[TaskDetail],
    persistent: bool,
) -> Result<Vec<TaskAttempt>, AdminError> {
    let steps: Vec<&str> = tasks.iter().map(|t| t.step_slug.as_str()).collect();
    let indexes: Vec<i32> = tasks.iter().map(|t| t.task_index).collect();
    Ok(sqlx::query_as::<Postgres, TaskAttempt>(ATTEMPTS)
        .bind(run_id)
        .bind(steps)
        .bind(indexes)
        .bind(ATTEMPTS_PER_TASK)
        .persistent(persistent)
        .fetch_all(conn)
        .await?)
}

/// How an attempt in a task's [`Attempt`] list ended, or where the current one stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AttemptEnd {
    /// An earlier attempt, and how it ended.
    Earlier(AttemptOutcome),
    /// The task's current or last attempt: the task's status.
    Current(TaskStatus),
}

impl AttemptEnd {
    /// The SQL text of the outcome or status (`failed`, `stalled`, ..., or `started`, `completed`, ...).
    pub const fn as_str(self) -> &'static str {
        match self {
            AttemptEnd::Earlier(o) => o.as_str(),
            AttemptEnd::Current(s) => s.as_str(),
        }
    }

    /// Whether this is the task's current or last attempt.
    pub const fn is_current(self) -> bool {
        matches!(self, AttemptEnd::Current(_))
    }
}

/// One attempt of a task, earlier or current, as [`RunDetail::attempt_list`](super::RunDetail::attempt_list)
/// gives them.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Attempt<'a> {
    /// The attempt's number.
    pub number: i32,
    /// When it was queued.
    pub queued_at: DateTime<Utc>,
    /// When it started.
    pub started_at: Option<DateTime<Utc>>,
    /// When it ended (`None`: still queued or running, or ended without a time of its own, as a cancelled
    /// task).
    pub ended_at: Option<DateTime<Utc>>,
    /// The worker that ran it.
    pub worker_id: Option<Uuid>,
    /// That worker's function name.
    pub worker_function: Option<&'a str>,
    /// How it ended, or where it stands.
    pub end: AttemptEnd,
    /// Its error.
    pub error_message: Option<&'a str>,
}

impl<'a> Attempt<'a> {
    /// An earlier attempt.
    pub(super) fn earlier(a: &'a TaskAttempt) -> Self {
        Self {
            number: a.attempt,
            queued_at: a.queued_at,
            started_at: a.started_at,
            ended_at: Some(a.ended_at),
            worker_id: a.worker_id,
            worker_function: a.worker_function.as_deref(),
            end: AttemptEnd::Earlier(a.outcome),
            error_message: a.error_message.as_deref(),
        }
    }

    /// The task's current or last attempt. A task keeps the error of its previous failure while it runs again,
    /// so the error is the attempt's own only when the task failed.
    pub(super) fn current(t: &'a TaskDetail) -> Self {
        Self {
            number: t.attempts,
            queued_at: t.attempt_queued_at,
            started_at: t.started_at,
            ended_at: t.completed_at.or(t.failed_at),
            worker_id: t.worker_id,
            worker_function: t.worker_function.as_deref(),
            end: AttemptEnd::Current(t.status),
            error_message: if t.status == TaskStatus::Failed {
                t.error_message.as_deref()
            } else {
                None
            },
        }
    }
}
