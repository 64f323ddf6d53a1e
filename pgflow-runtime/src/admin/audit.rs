//! The operator record: who took which write action, when, and how it ended (`pgflow.operator_actions`).

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{Postgres, Transaction};
use uuid::Uuid;

use super::{Admin, AdminError};
use crate::decode::text_enum;

text_enum! {
    /// A write action an operator tool takes (`pgflow.operator_actions.action`).
    #[non_exhaustive]
    pub enum ActionKind {
        /// Cancel a run (`pgflow.cancel_run`).
        Cancel = "cancel",
        /// Retry a failed or cancelled run in place (`pgflow.retry_run`).
        Retry = "retry",
        /// Replay a run from a step (`pgflow.replay_run`).
        Replay = "replay",
        /// Pause a schedule.
        PauseSchedule = "pause_schedule",
        /// Resume a schedule.
        ResumeSchedule = "resume_schedule",
    }
}

/// One recorded operator action.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
#[non_exhaustive]
pub struct OperatorAction {
    /// Its id, in the order recorded.
    pub action_id: i64,
    /// When.
    pub at: DateTime<Utc>,
    /// Who (the name the tool authenticated).
    pub actor: String,
    /// Which tool (`dashboard`, `cli`).
    pub source: String,
    /// What.
    pub action: ActionKind,
    /// The run it targeted.
    pub run_id: Option<Uuid>,
    /// The schedule it targeted.
    pub schedule_name: Option<String>,
    /// Its arguments and result.
    pub detail: Value,
    /// Whether it succeeded.
    pub succeeded: bool,
    /// The error that refused it.
    pub error: Option<String>,
}

/// An action to record with [`Admin::record_action`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct NewAction {
    /// Who.
    pub actor: String,
    /// Which tool.
    pub source: String,
    /// What.
    pub action: ActionKind,
    /// The run it targets.
    pub run_id: Option<Uuid>,
    /// The schedule it targets.
    pub schedule_name: Option<String>,
    /// Its arguments and result.
    pub detail: Value,
    /// `Err(message)` when it was refused or failed.
    pub outcome: Result<(), String>,
}

impl NewAction {
    /// An action on a run, by `actor` from `source`, that succeeded with an empty detail.
    pub fn on_run(
        actor: impl Into<String>,
        source: impl Into<String>,
        action: ActionKind,
        run_id: Uuid,
    ) -> Self {
        Self {
            actor: actor.into(),
            source: source.into(),
            action,
            run_id: Some(run_id),
            schedule_name: None,
            detail: Value::Object(Default::default()),
            outcome: Ok(()),
        }
    }

    /// An action on a schedule, by `actor` from `source`, that succeeded with an empty detail.
    pub fn on_schedule(
        actor: impl Into<String>,
        source: impl Into<String>,
        action: ActionKind,
        schedule_name: impl Into<String>,
    ) -> Self {
        Self {
            schedule_name: Some(schedule_name.into()),
            run_id: None,
            ..Self::on_run(actor, source, action, Uuid::nil())
        }
    }

    /// With this detail (arguments and result).
    #[must_use]
    pub fn detail(mut self, detail: Value) -> Self {
        self.detail = detail;
        self
    }

    /// With this outcome (`Err(message)`: refused or failed).
    #[must_use]
    pub fn outcome(mut self, outcome: Result<(), String>) -> Self {
        self.outcome = outcome;
        self
    }
}

const ACTIONS: &str =
    "select action_id, at, actor, source, action, run_id, schedule_name, detail, succeeded, \
     error from pgflow.operator_actions where ($1::uuid is null or run_id = $1) \
     order by action_id desc limit $2";

const RECORD: &str = "insert into pgflow.operator_actions \
     (actor, source, action, run_id, schedule_name, detail, succeeded, error) \
     values ($1, $2, $3, $4, $5, $6, $7, $8) returning action_id";

impl Admin {
    /// The newest `limit` operator actions, all or those on one run.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn actions(
        &self,
        run_id: Option<Uuid>,
        limit: u32,
    ) -> Result<Vec<OperatorAction>, AdminError> {
        let mut tx = self.read().await?;
        let actions = Self::actions_in(&mut tx, run_id, limit, self.persistent()).await?;
        tx.commit().await?;
        Ok(actions)
    }

    pub(super) async fn actions_in(
        tx: &mut Transaction<'static, Postgres>,
        run_id: Option<Uuid>,
        limit: u32,
        persistent: bool,
    ) -> Result<Vec<OperatorAction>, AdminError> {
        Ok(sqlx::query_as(ACTIONS)
            .bind(run_id)
            .bind(i64::from(limit))
            .persistent(persistent)
            .fetch_all(&mut **tx)
            .await?)
    }

    /// Records an operator action and returns its id.
    ///
    /// # Errors
    ///
    /// A database error (the role needs insert on `pgflow.operator_actions`).
    pub async fn record_action(&self, action: &NewAction) -> Result<i64, AdminError> {
        let (succeeded, error) = match &action.outcome {
            Ok(()) => (true, None),
            Err(e) => (false, Some(e.as_str())),
        };
        Ok(sqlx::query_scalar(RECORD)
            .bind(&action.actor)
            .bind(&action.source)
            .bind(action.action.as_str())
            .bind(action.run_id)
            .bind(action.schedule_name.as_deref())
            .bind(&action.detail)
            .bind(succeeded)
            .bind(error)
            .persistent(self.persistent())
            .fetch_one(&self.pool)
            .await?)
    }
}
