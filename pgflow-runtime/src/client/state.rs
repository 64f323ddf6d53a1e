//! A run and its step states, as the SQL core reports them.

use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::Value;
use uuid::Uuid;

use crate::decode::text_enum;

text_enum! {
    /// A run's status (`pgflow.runs.status`).
    #[non_exhaustive]
    pub enum RunStatus {
        /// Running.
        Started = "started",
        /// Every step finished.
        Completed = "completed",
        /// A step failed the run.
        Failed = "failed",
        /// Cancelled (`pgflow.cancel_run`); see [`RunRow::cancel_reason`].
        Cancelled = "cancelled",
    }
}

text_enum! {
    /// A step's status in a run (`pgflow.step_states.status`).
    #[non_exhaustive]
    pub enum StepStatus {
        /// Waiting for its dependencies.
        Created = "created",
        /// Its tasks are queued or running.
        Started = "started",
        /// Every task finished.
        Completed = "completed",
        /// A task failed it.
        Failed = "failed",
        /// A condition skipped it (see [`StepState::skip_reason`]).
        Skipped = "skipped",
    }
}

/// A run with its step states, as `pgflow.get_run_with_states` returns it.
#[derive(Debug, Clone, Deserialize)]
#[non_exhaustive]
pub struct RunState {
    /// The run row.
    pub run: RunRow,
    /// One entry per step.
    pub steps: Vec<StepState>,
}

impl RunState {
    /// The state of one step.
    pub fn step(&self, step_slug: &str) -> Option<&StepState> {
        self.steps.iter().find(|s| s.step_slug == step_slug)
    }
}

/// `pgflow.runs`.
#[derive(Debug, Clone, Deserialize)]
#[non_exhaustive]
pub struct RunRow {
    /// The run id.
    pub run_id: Uuid,
    /// The flow slug.
    pub flow_slug: String,
    /// The status.
    pub status: RunStatus,
    /// The input.
    pub input: Value,
    /// The output (set when completed).
    #[serde(default)]
    pub output: Option<Value>,
    /// Steps not finished yet.
    #[serde(default)]
    pub remaining_steps: Option<i32>,
    /// Start time.
    pub started_at: DateTime<Utc>,
    /// Completion time.
    #[serde(default)]
    pub completed_at: Option<DateTime<Utc>>,
    /// Failure time.
    #[serde(default)]
    pub failed_at: Option<DateTime<Utc>>,
    /// Cancellation time.
    #[serde(default)]
    pub cancelled_at: Option<DateTime<Utc>>,
    /// Why the run was cancelled.
    #[serde(default)]
    pub cancel_reason: Option<String>,
    /// The run this run replays (`pgflow.replay_run`).
    #[serde(default)]
    pub replay_of: Option<Uuid>,
    /// How many times the run was retried in place (`pgflow.retry_run`).
    #[serde(default)]
    pub retry_count: Option<i32>,
}

/// `pgflow.step_states`.
#[derive(Debug, Clone, Deserialize)]
#[non_exhaustive]
pub struct StepState {
    /// The step slug.
    pub step_slug: String,
    /// The status.
    pub status: StepStatus,
    /// Tasks not finished yet.
    #[serde(default)]
    pub remaining_tasks: Option<i32>,
    /// The step output (map steps: the array of task outputs).
    #[serde(default)]
    pub output: Option<Value>,
    /// The error of a failed (or handler-failed skipped) step.
    #[serde(default)]
    pub error_message: Option<String>,
    /// Why the step was skipped.
    #[serde(default)]
    pub skip_reason: Option<String>,
}
