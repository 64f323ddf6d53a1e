//! Claiming: one round trip reads messages and claims their tasks; the result is decoded into types.

use serde::Deserialize;
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use crate::statements;

/// One claimed task, ready to run.
#[derive(Debug, Deserialize)]
pub(crate) struct Claimed {
    pub(crate) flow_slug: String,
    pub(crate) run_id: Uuid,
    pub(crate) step_slug: String,
    pub(crate) task_index: i32,
    pub(crate) msg_id: i64,
    #[serde(default)]
    pub(crate) input: Value,
    #[serde(default)]
    pub(crate) flow_input: Option<Value>,
    /// The attempt this claim started; every result of it carries this number (the fence).
    #[serde(rename = "attempts_count")]
    pub(crate) attempt: i32,
    /// The step's effective timeout in seconds, from the database at claim time.
    pub(crate) timeout: i64,
}

/// The messages a worker must not run (no bodies).
#[derive(Debug, Deserialize)]
pub(crate) struct Unsupported {
    /// Every message id of the batch (all visible again).
    pub(crate) msg_ids: Vec<i64>,
    /// Flows named by the unsupported messages.
    #[serde(default)]
    pub(crate) flows: Vec<String>,
    /// Steps named by the unsupported messages.
    #[serde(default)]
    pub(crate) steps: Vec<String>,
}

/// The fence's state when the worker function is disabled.
#[derive(Debug, Deserialize)]
pub(crate) struct Disabled {
    #[serde(default)]
    pub(crate) reason: Option<String>,
}

/// What one claim call found. Decoding fails on an outcome this build does not know: an unknown outcome is
/// never taken for "claimed".
#[derive(Debug, Deserialize)]
#[serde(tag = "outcome", rename_all = "lowercase")]
pub(crate) enum ClaimOutcome {
    /// Tasks claimed (possibly none); duplicates were deferred and finished tasks' messages archived.
    Claimed { tasks: Vec<Claimed> },
    /// The batch holds messages this worker must not run; nothing was claimed and the batch is visible again.
    Unsupported { unsupported: Unsupported },
    /// The worker function is disabled: nothing was claimed.
    Disabled { disabled: Disabled },
}

/// Why a claim call failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ClaimError {
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error("cannot decode the claim result: {0}")]
    Decode(#[from] serde_json::Error),
}

/// The claim of one worker: its queue and subscription, worker id and read visibility.
pub(crate) struct Claimer {
    pub(crate) queue: String,
    pub(crate) flow_slug: &'static str,
    /// `None` for a plain worker (every step of the flow); the step slug for a step worker.
    pub(crate) step_slug: Option<&'static str>,
    pub(crate) read_visibility_secs: i32,
    pub(crate) worker_id: Uuid,
}

impl Claimer {
    /// Reads at most `qty` messages and classifies and claims them in one statement (it never sleeps).
    pub(crate) async fn claim(
        &self,
        pool: &PgPool,
        qty: usize,
    ) -> Result<ClaimOutcome, ClaimError> {
        let raw: Value = sqlx::query_scalar(statements::READ_AND_CLAIM_TASKS)
            .bind(&self.queue)
            .bind(self.flow_slug)
            .bind(self.step_slug)
            .bind(i32::try_from(qty).unwrap_or(i32::MAX))
            .bind(self.read_visibility_secs)
            .bind(self.worker_id)
            .fetch_one(pool)
            .await?;
        Ok(serde_json::from_value(raw)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn claimed_tasks_decode_with_attempt_and_timeout() {
        let outcome: ClaimOutcome = serde_json::from_value(json!({
            "outcome": "claimed",
            "tasks": [{"flow_slug": "f", "run_id": Uuid::nil(), "step_slug": "a", "task_index": 0,
                       "msg_id": 7, "input": {}, "flow_input": {"x": 1}, "attempts_count": 2, "timeout": 30}],
            "deferred": [], "archived": [], "waiting": [], "unsupported": null, "disabled": null
        }))
        .unwrap();
        let ClaimOutcome::Claimed { tasks } = outcome else {
            panic!("claimed")
        };
        assert_eq!((tasks[0].attempt, tasks[0].timeout), (2, 30));
    }

    #[test]
    fn an_unknown_outcome_is_an_error_not_a_claim() {
        let err = serde_json::from_value::<ClaimOutcome>(json!({"outcome": "maybe", "tasks": []}));
        assert!(err.is_err());
    }

    #[test]
    fn unsupported_and_disabled_carry_their_reports() {
        let u: ClaimOutcome = serde_json::from_value(json!({
            "outcome": "unsupported", "tasks": [],
            "unsupported": {"msg_ids": [1, 2], "flows": ["x"], "steps": ["y"], "queue_name": "q"}
        }))
        .unwrap();
        assert!(
            matches!(u, ClaimOutcome::Unsupported { unsupported } if unsupported.msg_ids == [1, 2])
        );
        let d: ClaimOutcome = serde_json::from_value(json!({
            "outcome": "disabled", "disabled": {"function_name": "f", "reason": "deploy", "disabled_at": null}
        }))
        .unwrap();
        assert!(
            matches!(d, ClaimOutcome::Disabled { disabled } if disabled.reason.as_deref() == Some("deploy"))
        );
    }
}
