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
    /// The read batch holds messages this worker must not run; nothing was claimed.
    /// Only a step worker's classifying claim reports this.
    #[allow(dead_code)]
    Unsupported { msg_ids: Vec<i64> },
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

type Row = (Uuid, String, i32, i64, Option<Value>, Option<Value>, i32);

impl Claimer {
    /// Reads at most `qty` messages and claims their tasks, in one statement (it never sleeps).
    ///
    /// A step worker's private queue only ever receives its own step's tasks, so the queue-aware
    /// claim with the flow slug is exact. When the per-step classifying claim lands in SQL, this
    /// is the one function to switch (and it returns [`ClaimOutcome::Unsupported`]).
    pub(crate) async fn claim(
        &self,
        pool: &PgPool,
        qty: usize,
    ) -> Result<ClaimOutcome, sqlx::Error> {
        let _ = self.step_slug;
        let rows: Vec<Row> = sqlx::query_as(sql::READ_AND_START_TASKS)
            .bind(&self.queue)
            .bind(self.flow_slug)
            .bind(i32::try_from(qty).unwrap_or(i32::MAX))
            .bind(self.read_visibility_secs)
            .bind(self.worker_id)
            .bind(&self.function_name)
            .fetch_all(pool)
            .await?;
        Ok(ClaimOutcome::Tasks(
            rows.into_iter()
                .map(
                    |(run_id, step_slug, task_index, msg_id, input, flow_input, attempt)| Claimed {
                        run_id,
                        step_slug,
                        task_index,
                        msg_id,
                        input: input.unwrap_or(Value::Null),
                        flow_input,
                        attempt,
                    },
                )
                .collect(),
        ))
    }
}
