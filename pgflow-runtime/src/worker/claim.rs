//! Claiming: one round trip (`pgflow.exchange`) records finished outputs, reads messages and claims their
//! tasks; the rows are decoded into types here and nowhere else.

use serde::Deserialize;
use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use super::result::{Completion, OutputColumns, TaskResult};
use crate::decode::{text_enum, Recorded, TaskStatus};
use crate::pooling::run;
use crate::statements;

/// One claimed task, ready to run.
#[derive(Debug)]
pub(crate) struct Claimed {
    pub(crate) flow_slug: String,
    pub(crate) run_id: Uuid,
    pub(crate) step_slug: String,
    pub(crate) task_index: i32,
    pub(crate) msg_id: i64,
    pub(crate) input: Value,
    pub(crate) flow_input: Option<Value>,
    /// The attempt this claim started; every result of it carries this number (the fence).
    pub(crate) attempt: i32,
    /// The step's effective timeout in seconds, from the database at claim time.
    pub(crate) timeout: i64,
    /// When the claim came back (the task then waits for a handler slot).
    pub(crate) claimed_at: std::time::Instant,
    /// The run's W3C trace context (`{"traceparent", "tracestate"}`), when it was started in one.
    #[cfg_attr(not(feature = "otel"), allow(dead_code))]
    pub(crate) trace_context: Option<Value>,
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

/// What one claim call found.
#[derive(Debug)]
pub(crate) enum ClaimOutcome {
    /// Tasks claimed (possibly none); duplicates were deferred and finished tasks' messages archived.
    Claimed(Vec<Claimed>),
    /// The batch holds messages this worker must not run; nothing was claimed and the batch is visible again.
    Unsupported(Unsupported),
    /// The worker function is disabled: nothing was claimed.
    Disabled(Disabled),
}

/// Why a claim call failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ClaimError {
    #[error(transparent)]
    Database(sqlx::Error),
    /// The exchange ran (its transaction committed) but its rows cannot be read.
    #[error("cannot decode the claim result: {0}")]
    Decode(String),
}

impl From<sqlx::Error> for ClaimError {
    fn from(e: sqlx::Error) -> Self {
        match e {
            sqlx::Error::ColumnDecode { .. } | sqlx::Error::Decode(_) => {
                ClaimError::Decode(e.to_string())
            }
            e => ClaimError::Database(e),
        }
    }
}

text_enum! {
    /// What one row of `pgflow.exchange` says.
    pub(crate) enum RowOutcome {
        /// A completion this exchange recorded.
        Applied = "applied",
        /// A completion it ignored (the attempt moved on, or the task finished).
        Stale = "stale",
        /// A task claimed for this worker.
        Claimed = "claimed",
        /// A message whose task runs under another claim: left to that attempt.
        Deferred = "deferred",
        /// A message of a finished task, archived.
        Archived = "archived",
        /// A message whose task cannot start yet.
        Waiting = "waiting",
        /// The batch holds messages this worker must not run (with a report).
        Unsupported = "unsupported",
        /// The worker function is disabled (with a report).
        Disabled = "disabled",
    }
}

/// One row of `pgflow.exchange`: a completion's outcome, or one of the claim's rows.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct ClaimRow {
    outcome: RowOutcome,
    msg_id: Option<i64>,
    flow_slug: Option<String>,
    run_id: Option<Uuid>,
    step_slug: Option<String>,
    task_index: Option<i32>,
    input: Option<Value>,
    flow_input: Option<Value>,
    attempts_count: Option<i32>,
    timeout: Option<i32>,
    report: Option<Value>,
    /// A completion's task status after it (completion rows only).
    status: Option<TaskStatus>,
    /// The server process that ran the exchange.
    backend_pid: i32,
}

/// What one exchange did: the outputs it recorded and what it claimed.
#[derive(Debug)]
pub(crate) struct Exchanged {
    pub(crate) completions: Vec<Completion>,
    pub(crate) claim: ClaimOutcome,
    /// Messages read while their task was already running elsewhere: left for that attempt.
    pub(crate) deferred: u64,
    /// The server process that ran it, when it returned rows.
    pub(crate) backend_pid: Option<u32>,
}

impl Exchanged {
    /// Decodes an exchange's rows. An outcome this build does not know, or a row missing a field its
    /// outcome needs, is an error: it is never taken for "claimed" or "applied".
    pub(crate) fn from_rows(rows: Vec<ClaimRow>) -> Result<Self, ClaimError> {
        let mut completions = Vec::new();
        let mut tasks = Vec::new();
        let mut deferred = 0;
        let mut claim = None;
        let backend_pid = rows.first().and_then(|r| u32::try_from(r.backend_pid).ok());
        for row in rows {
            match row.outcome {
                RowOutcome::Applied | RowOutcome::Stale => completions.push(completion(row)?),
                RowOutcome::Claimed => tasks.push(claimed(row)?),
                RowOutcome::Deferred => deferred += 1,
                RowOutcome::Archived | RowOutcome::Waiting => {}
                RowOutcome::Unsupported => {
                    claim = Some(ClaimOutcome::Unsupported(report(row)?));
                }
                RowOutcome::Disabled => claim = Some(ClaimOutcome::Disabled(report(row)?)),
            }
        }
        Ok(Exchanged {
            completions,
            claim: claim.unwrap_or(ClaimOutcome::Claimed(tasks)),
            deferred,
            backend_pid,
        })
    }
}

/// The report of an `unsupported` or `disabled` row.
fn report<T: serde::de::DeserializeOwned>(row: ClaimRow) -> Result<T, ClaimError> {
    let report = row.report.ok_or_else(|| missing(row.outcome, "report"))?;
    serde_json::from_value(report)
        .map_err(|e| ClaimError::Decode(format!("the report of a `{}` row: {e}", row.outcome)))
}

fn completion(row: ClaimRow) -> Result<Completion, ClaimError> {
    let outcome = row.outcome;
    let need = |field: &str| missing(outcome, field);
    Ok(Completion {
        run_id: row.run_id.ok_or_else(|| need("run_id"))?,
        step_slug: row.step_slug.ok_or_else(|| need("step_slug"))?,
        task_index: row.task_index.ok_or_else(|| need("task_index"))?,
        recorded: match outcome {
            RowOutcome::Applied => Recorded::Applied,
            _ => Recorded::Stale,
        },
        status: row.status.ok_or_else(|| need("status"))?,
        current_attempt: row.attempts_count.ok_or_else(|| need("attempts_count"))?,
    })
}

fn missing(outcome: RowOutcome, field: &str) -> ClaimError {
    ClaimError::Decode(format!("a `{outcome}` row without `{field}`"))
}

fn claimed(row: ClaimRow) -> Result<Claimed, ClaimError> {
    let need = |field: &str| missing(RowOutcome::Claimed, field);
    Ok(Claimed {
        flow_slug: row.flow_slug.ok_or_else(|| need("flow_slug"))?,
        run_id: row.run_id.ok_or_else(|| need("run_id"))?,
        step_slug: row.step_slug.ok_or_else(|| need("step_slug"))?,
        task_index: row.task_index.ok_or_else(|| need("task_index"))?,
        msg_id: row.msg_id.ok_or_else(|| need("msg_id"))?,
        input: row.input.unwrap_or(Value::Null),
        flow_input: row.flow_input,
        attempt: row.attempts_count.ok_or_else(|| need("attempts_count"))?,
        timeout: i64::from(row.timeout.ok_or_else(|| need("timeout"))?),
        claimed_at: std::time::Instant::now(),
        trace_context: row.report,
    })
}

/// The claim of one worker: its queue and the exact (flow, step) pairs it runs there.
pub(crate) struct Claimer {
    pub(crate) queue: String,
    pub(crate) flow_slugs: Vec<&'static str>,
    pub(crate) step_slugs: Vec<&'static str>,
    pub(crate) read_visibility_secs: i32,
    pub(crate) worker_id: Uuid,
    /// Behind a transaction pooler (see [`Pooling`](crate::pooling::Pooling)).
    pub(crate) pooled: bool,
}

impl Claimer {
    /// Records `outputs` (each must be an [`Outcome::Output`]; fenced to its attempt) and reads, classifies
    /// and claims at most `qty` messages (0: none), in one statement and one transaction. It never sleeps.
    pub(crate) async fn exchange(
        &self,
        conn: &mut PgConnection,
        outputs: &[TaskResult],
        qty: usize,
    ) -> Result<Exchanged, ClaimError> {
        let c = OutputColumns::of(outputs);
        let query = sqlx::query_as(statements::EXCHANGE)
            .bind(&self.queue)
            .bind(self.worker_id)
            .bind(&self.flow_slugs)
            .bind(&self.step_slugs)
            .bind(i32::try_from(qty).unwrap_or(i32::MAX))
            .bind(self.read_visibility_secs)
            .bind(&c.run_ids)
            .bind(&c.step_slugs)
            .bind(&c.task_indexes)
            .bind(&c.outputs)
            .bind(&c.attempts);
        let rows: Vec<ClaimRow> = run!(self.pooled, &mut *conn, query, fetch_all).await?;
        Exchanged::from_rows(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn row(outcome: RowOutcome) -> ClaimRow {
        ClaimRow {
            outcome,
            msg_id: None,
            flow_slug: None,
            run_id: None,
            step_slug: None,
            task_index: None,
            input: None,
            flow_input: None,
            attempts_count: None,
            timeout: None,
            report: None,
            status: None,
            backend_pid: 1,
        }
    }

    #[test]
    fn claimed_rows_decode_with_attempt_and_timeout_and_other_rows_are_skipped() {
        let claimed = ClaimRow {
            msg_id: Some(7),
            flow_slug: Some("f".into()),
            run_id: Some(Uuid::nil()),
            step_slug: Some("a".into()),
            task_index: Some(0),
            input: Some(json!({})),
            flow_input: Some(json!({"x": 1})),
            attempts_count: Some(2),
            timeout: Some(30),
            ..row(RowOutcome::Claimed)
        };
        let deferred = ClaimRow {
            msg_id: Some(8),
            ..row(RowOutcome::Deferred)
        };
        let done = ClaimRow {
            run_id: Some(Uuid::nil()),
            step_slug: Some("a".into()),
            task_index: Some(0),
            attempts_count: Some(1),
            status: Some(TaskStatus::Completed),
            ..row(RowOutcome::Applied)
        };
        let exchanged = Exchanged::from_rows(vec![done, claimed, deferred]).unwrap();
        assert_eq!(exchanged.deferred, 1);
        assert_eq!(exchanged.completions[0].recorded, Recorded::Applied);
        let ClaimOutcome::Claimed(tasks) = exchanged.claim else {
            panic!("claimed")
        };
        assert_eq!(tasks.len(), 1);
        assert_eq!((tasks[0].attempt, tasks[0].timeout), (2, 30));
    }

    #[test]
    fn an_unknown_outcome_or_a_claimed_row_without_its_attempt_is_an_error_not_a_claim() {
        assert!(RowOutcome::parse("maybe").is_err());
        assert!(Exchanged::from_rows(vec![row(RowOutcome::Stale)]).is_err());
        let incomplete = ClaimRow {
            msg_id: Some(1),
            flow_slug: Some("f".into()),
            run_id: Some(Uuid::nil()),
            step_slug: Some("a".into()),
            task_index: Some(0),
            timeout: Some(30),
            ..row(RowOutcome::Claimed)
        };
        assert!(Exchanged::from_rows(vec![incomplete]).is_err());
    }

    #[test]
    fn unsupported_and_disabled_carry_their_reports() {
        let u = ClaimRow {
            report: Some(
                json!({"msg_ids": [1, 2], "flows": ["x"], "steps": ["y"], "queue_name": "q"}),
            ),
            ..row(RowOutcome::Unsupported)
        };
        assert!(matches!(
            Exchanged::from_rows(vec![u]).unwrap().claim,
            ClaimOutcome::Unsupported(u) if u.msg_ids == [1, 2]
        ));
        let d = ClaimRow {
            report: Some(json!({"function_name": "f", "reason": "deploy", "disabled_at": null})),
            ..row(RowOutcome::Disabled)
        };
        assert!(matches!(
            Exchanged::from_rows(vec![d]).unwrap().claim,
            ClaimOutcome::Disabled(d) if d.reason.as_deref() == Some("deploy")
        ));
    }
}
