//! A task's result on its way to the database, and what recording it did: the types the claiming side
//! (`claim.rs`, which records outputs in its exchanges) and the recording side (`record.rs`) share.

use std::time::Duration;

use serde_json::Value;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use uuid::Uuid;

use crate::decode::{Recorded, TaskStatus};

/// Which attempt of which task a result belongs to.
#[derive(Debug, Clone)]
pub(crate) struct TaskKey {
    pub(crate) run_id: Uuid,
    pub(crate) flow_slug: String,
    pub(crate) step_slug: String,
    pub(crate) task_index: i32,
    pub(crate) msg_id: i64,
    pub(crate) attempt: i32,
}

/// What a task's handler produced.
#[derive(Debug)]
pub(crate) enum Outcome {
    Output(Value),
    Failure {
        message: String,
        retry_after: Option<Duration>,
        terminal: bool,
    },
}

/// A result on its way to the database; holds its `max_unrecorded` permit until recorded or given up.
pub(crate) struct TaskResult {
    pub(crate) key: TaskKey,
    pub(crate) outcome: Outcome,
    /// How long the handler ran (the worker sizes its claims by it).
    pub(crate) ran_for: Duration,
    /// When recording it first failed, if it did (it is given up after `RECORD_PATIENCE`).
    pub(crate) first_error: Option<Instant>,
    pub(crate) _permit: OwnedSemaphorePermit,
}

impl TaskResult {
    /// An output PostgreSQL cannot store (a NUL character) becomes the terminal failure it will be; `true`
    /// when the result is then an output to record.
    pub(crate) fn sort(&mut self) -> bool {
        match &self.outcome {
            Outcome::Output(v) if contains_nul(v) => {
                self.outcome = Outcome::Failure {
                    message: format!(
                        "step `{}` of flow `{}` returned an output PostgreSQL cannot store: a string in it contains the NUL character (\\u0000); remove it or encode the data (for example as base64)",
                        self.key.step_slug, self.key.flow_slug
                    ),
                    retry_after: None,
                    terminal: true,
                };
                false
            }
            Outcome::Output(_) => true,
            Outcome::Failure { .. } => false,
        }
    }
}

/// How one recorded output came out (a row of `pgflow.complete_tasks`, or a completion row of
/// `pgflow.exchange`).
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct Completion {
    pub(crate) run_id: Uuid,
    pub(crate) step_slug: String,
    pub(crate) task_index: i32,
    /// Recorded, or stale (its attempt is no longer current, or the task already finished).
    #[sqlx(rename = "outcome")]
    pub(crate) recorded: Recorded,
    /// The task's status after the call.
    pub(crate) status: TaskStatus,
    /// The task's current attempt.
    #[sqlx(rename = "attempts_count")]
    pub(crate) current_attempt: i32,
}

impl Completion {
    /// Whether this row is about the task of `key` (any attempt: a stale row names the current one).
    pub(crate) fn is_for(&self, key: &TaskKey) -> bool {
        self.run_id == key.run_id
            && self.step_slug == key.step_slug
            && self.task_index == key.task_index
    }
}

/// A batch of outputs as the parallel arrays that `pgflow.complete_tasks` and `pgflow.exchange` take.
pub(crate) struct OutputColumns<'a> {
    pub(crate) run_ids: Vec<Uuid>,
    pub(crate) step_slugs: Vec<&'a str>,
    pub(crate) task_indexes: Vec<i32>,
    pub(crate) outputs: Vec<&'a Value>,
    pub(crate) attempts: Vec<i32>,
}

impl<'a> OutputColumns<'a> {
    /// The columns of `items`, each of which must be an [`Outcome::Output`] (failures are recorded one by
    /// one with `fail_task`).
    pub(crate) fn of(items: &'a [TaskResult]) -> Self {
        let n = items.len();
        let mut columns = OutputColumns {
            run_ids: Vec::with_capacity(n),
            step_slugs: Vec::with_capacity(n),
            task_indexes: Vec::with_capacity(n),
            outputs: Vec::with_capacity(n),
            attempts: Vec::with_capacity(n),
        };
        for item in items {
            let Outcome::Output(value) = &item.outcome else {
                unreachable!("only outputs are recorded in batches; failures go to fail_task")
            };
            columns.run_ids.push(item.key.run_id);
            columns.step_slugs.push(item.key.step_slug.as_str());
            columns.task_indexes.push(item.key.task_index);
            columns.outputs.push(value);
            columns.attempts.push(item.key.attempt);
        }
        columns
    }
}

/// Whether a JSON value holds a NUL character anywhere (PostgreSQL's jsonb and text cannot store it).
fn contains_nul(v: &Value) -> bool {
    match v {
        Value::String(s) => s.contains('\0'),
        Value::Array(a) => a.iter().any(contains_nul),
        Value::Object(o) => o.iter().any(|(k, v)| k.contains('\0') || contains_nul(v)),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_completion_row_is_matched_to_its_task_by_run_step_and_index() {
        let key = TaskKey {
            run_id: Uuid::new_v4(),
            flow_slug: "f".into(),
            step_slug: "a".into(),
            task_index: 2,
            msg_id: 7,
            attempt: 1,
        };
        let row = |run_id, step_slug: &str, task_index| Completion {
            run_id,
            step_slug: step_slug.into(),
            task_index,
            recorded: Recorded::Stale,
            status: TaskStatus::Started,
            current_attempt: 2,
        };
        assert!(
            row(key.run_id, "a", 2).is_for(&key),
            "another attempt's row"
        );
        assert!(!row(Uuid::new_v4(), "a", 2).is_for(&key), "another run");
        assert!(!row(key.run_id, "b", 2).is_for(&key), "another step");
        assert!(
            !row(key.run_id, "a", 3).is_for(&key),
            "another task of the map"
        );
    }

    #[test]
    fn nul_characters_are_found_in_strings_and_keys_at_any_depth() {
        assert!(!contains_nul(&json!({"a": ["b", 1, null]})));
        assert!(contains_nul(&json!({"a": ["b\u{0}"]})));
        assert!(contains_nul(&json!({"k\u{0}": 1})));
    }
}
