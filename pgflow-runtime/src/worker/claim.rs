//! Claiming: one round trip reads messages and claims their tasks. The only piece that knows the claim SQL.

use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use crate::statements as sql;

/// One claimed task, ready to run.
pub(crate) struct Claimed {
    pub(crate) run_id: Uuid,
    pub(crate) step_slug: String,
    pub(crate) task_index: i32,
    pub(crate) msg_id: i64,
    pub(crate) input: Value,
    pub(crate) flow_input: Option<Value>,
    pub(crate) attempt: i32,
}

/// What one claim call found.
pub(crate) enum ClaimOutcome {
    /// Claimed tasks (possibly none).
    Tasks(Vec<Claimed>),
    /// The read batch holds messages this worker must not run; nothing was claimed and the
    /// whole batch is visible again.
    Unsupported {
        /// Every message id of the batch.
        msg_ids: Vec<i64>,
        /// The flows of the unsupported messages (from their tasks or bodies).
        flows: Vec<String>,
        /// Their steps.
        steps: Vec<String>,
    },
    /// The worker function is disabled: nothing was claimed.
    Disabled {
        /// `pgflow.worker_functions.disabled_reason`.
        reason: Option<String>,
    },
}

/// The claim of one worker: fixed queue, flow, worker id and function.
pub(crate) struct Claimer {
    pub(crate) queue: String,
    pub(crate) flow_slug: &'static str,
    /// `None` for a plain worker; the step slug for a step worker.
    pub(crate) step_slug: Option<&'static str>,
    pub(crate) read_visibility_secs: i32,
    pub(crate) worker_id: Uuid,
    pub(crate) function_name: String,
}

impl Claimer {
    /// Reads at most `qty` messages and claims their tasks, in one statement (it never sleeps).
    ///
    /// Every worker uses the classifying `read_and_claim_tasks` for its exact subscription: a step
    /// worker's (flow, step), a plain worker's whole flow on its default queue. The batch is
    /// classified before any mutation and may be reported unsupported.
    pub(crate) async fn claim(
        &self,
        pool: &PgPool,
        qty: usize,
    ) -> Result<ClaimOutcome, sqlx::Error> {
        self.classifying_claim(pool, qty).await
    }
}

#[derive(serde::Deserialize)]
struct ClaimJson {
    outcome: String,
    #[serde(default)]
    tasks: Vec<TaskJson>,
    #[serde(default)]
    unsupported: Option<UnsupportedJson>,
    #[serde(default)]
    disabled: Option<DisabledJson>,
}

#[derive(serde::Deserialize)]
struct TaskJson {
    run_id: Uuid,
    step_slug: String,
    task_index: i32,
    msg_id: i64,
    #[serde(default)]
    input: Option<Value>,
    #[serde(default)]
    flow_input: Option<Value>,
    attempts_count: i32,
}

#[derive(serde::Deserialize)]
struct UnsupportedJson {
    msg_ids: Vec<i64>,
    #[serde(default)]
    flows: Vec<String>,
    #[serde(default)]
    steps: Vec<String>,
}

#[derive(serde::Deserialize)]
struct DisabledJson {
    #[serde(default)]
    reason: Option<String>,
}

impl Claimer {
    async fn classifying_claim(
        &self,
        pool: &PgPool,
        qty: usize,
    ) -> Result<ClaimOutcome, sqlx::Error> {
        let raw: Value = sqlx::query_scalar(sql::READ_AND_CLAIM_TASKS)
            .bind(&self.queue)
            .bind(self.flow_slug)
            .bind(self.step_slug)
            .bind(i32::try_from(qty).unwrap_or(i32::MAX))
            .bind(self.read_visibility_secs)
            .bind(self.worker_id)
            .fetch_one(pool)
            .await?;
        let parsed: ClaimJson =
            serde_json::from_value(raw).map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
        Ok(match parsed.outcome.as_str() {
            "unsupported" => {
                let u = parsed.unsupported.unwrap_or(UnsupportedJson {
                    msg_ids: Vec::new(),
                    flows: Vec::new(),
                    steps: Vec::new(),
                });
                ClaimOutcome::Unsupported {
                    msg_ids: u.msg_ids,
                    flows: u.flows,
                    steps: u.steps,
                }
            }
            "disabled" => ClaimOutcome::Disabled {
                reason: parsed.disabled.and_then(|d| d.reason),
            },
            _ => ClaimOutcome::Tasks(
                parsed
                    .tasks
                    .into_iter()
                    .map(|t| Claimed {
                        run_id: t.run_id,
                        step_slug: t.step_slug,
                        task_index: t.task_index,
                        msg_id: t.msg_id,
                        input: t.input.unwrap_or(Value::Null),
                        flow_input: t.flow_input,
                        attempt: t.attempts_count,
                    })
                    .collect(),
            ),
        })
    }
}
