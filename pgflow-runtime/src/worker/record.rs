//! Recording results. Outputs normally travel in the worker's exchanges (`drive.rs`); this module holds
//! everything else: failures one by one (`pgflow.fail_task`), a refused batch of outputs recorded one by one
//! (`pgflow.complete_tasks`), what a recorded output's row means, and giving up. Every result is fenced to
//! the attempt that produced it and retried through database errors, and bounded: each waiting result holds
//! one of `max_unrecorded` permits, so claiming pauses while results pile up.

use crate::pooling::run;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::PgPool;
use tokio::time::Instant;
use uuid::Uuid;

use super::result::{Completion, Outcome, OutputColumns, TaskKey, TaskResult};
use super::retry::{retry, transient, Backoff, GaveUp};
use crate::decode::{Recorded, TaskStatus};
use crate::observability::worker::WorkerMetrics;
use crate::statements;

/// How long a result is retried through database errors before it is left to recovery (a database restart
/// fits in it).
pub(crate) const RECORD_PATIENCE: Duration = Duration::from_secs(60);

/// Counters shared by the worker's parts.
#[derive(Default)]
pub(crate) struct Stats {
    pub(crate) completed: AtomicU64,
    pub(crate) failed: AtomicU64,
    pub(crate) stale: AtomicU64,
    pub(crate) deferred: AtomicU64,
}

/// Results not recorded yet, by message id (logged with their ids when shutdown gives up on them).
pub(crate) type Pending = Arc<Mutex<HashMap<i64, TaskKey>>>;

/// The recording side of a worker.
pub(crate) struct Recorder {
    pub(crate) metrics: Arc<WorkerMetrics>,
    pub(crate) pool: PgPool,
    pub(crate) worker_id: Uuid,
    pub(crate) backoff_max: Duration,
    pub(crate) stats: Arc<Stats>,
    pub(crate) pending: Pending,
    /// Behind a transaction pooler (see [`Pooling`](crate::pooling::Pooling)).
    pub(crate) pooled: bool,
}

impl Recorder {
    /// Records a batch of outputs. A batch the database refuses as a whole for a reason retrying cannot fix
    /// (an output it cannot store) is recorded item by item, so one bad output fails only its own task.
    pub(crate) async fn complete(&self, items: Vec<TaskResult>) {
        match self.complete_batch(&items).await {
            Ok(()) => self.done(items),
            // Recorded (the transaction committed), but the answer cannot be read: nothing to redo.
            Err(GaveUp::Permanent(e)) if is_decode(&e) => self.give_up(items, &e),
            Err(GaveUp::Permanent(e)) if items.len() > 1 => {
                tracing::warn!(error = %e, tasks = items.len(), "a batch of outputs was refused; recording them one by one");
                for item in items {
                    Box::pin(self.complete(vec![item])).await;
                }
            }
            Err(GaveUp::Permanent(e)) => {
                let item = items.into_iter().next().expect("one item");
                let message = format!(
                    "step `{}` of flow `{}` returned an output PostgreSQL cannot store: {}",
                    item.key.step_slug,
                    item.key.flow_slug,
                    database_message(&e)
                );
                self.fail(TaskResult {
                    outcome: Outcome::Failure {
                        message,
                        retry_after: None,
                        terminal: true,
                    },
                    ..item
                })
                .await;
            }
            Err(GaveUp::Deadline(e)) => self.give_up(items, &e),
        }
    }

    async fn complete_batch(&self, items: &[TaskResult]) -> Result<(), GaveUp<sqlx::Error>> {
        let c = OutputColumns::of(items);
        let completions: Vec<Completion> = self
            .with_retries("recording outputs", || {
                run!(
                    self.pooled,
                    &self.pool,
                    sqlx::query_as(statements::COMPLETE_TASKS)
                        .bind(&c.run_ids)
                        .bind(&c.step_slugs)
                        .bind(&c.task_indexes)
                        .bind(&c.outputs)
                        .bind(&c.attempts)
                        .bind(self.worker_id),
                    fetch_all
                )
            })
            .await?;
        self.recorded(completions, items);
        Ok(())
    }

    /// Counts recorded outputs and logs the stale ones with both attempts.
    pub(crate) fn recorded(
        &self,
        completions: impl IntoIterator<Item = Completion>,
        items: &[TaskResult],
    ) {
        for c in completions {
            let item = items.iter().find(|i| c.is_for(&i.key));
            let applied = c.recorded == Recorded::Applied;
            if let Some(i) = item {
                self.metrics.on(&i.key.flow_slug, &i.key.step_slug, |m| {
                    if applied {
                        m.completed.increment(1)
                    } else {
                        m.stale.increment(1)
                    }
                });
            }
            if applied {
                self.stats.completed.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            self.stats.stale.fetch_add(1, Ordering::Relaxed);
            let ours = item.map(|i| i.key.attempt);
            tracing::warn!(run_id = %c.run_id, step = %c.step_slug, task_index = c.task_index, attempt = ?ours,
                current_attempt = c.current_attempt, status = %c.status,
                "stale output ignored: the task moved on to another attempt or finished");
        }
    }

    /// Records one failure (fenced), retried through database errors.
    pub(crate) async fn fail(&self, item: TaskResult) {
        let Outcome::Failure {
            message,
            retry_after,
            terminal,
        } = &item.outcome
        else {
            return;
        };
        let message = storable(message);
        let delay = retry_after.map(|d| i32::try_from(d.as_secs()).unwrap_or(i32::MAX));
        let key = &item.key;
        let row: Result<Option<(Recorded, TaskStatus, i32)>, _> = self
            .with_retries("recording a failure", || {
                run!(
                    self.pooled,
                    &self.pool,
                    sqlx::query_as(statements::FAIL_TASK)
                        .bind(key.run_id)
                        .bind(&key.step_slug)
                        .bind(key.task_index)
                        .bind(&message)
                        .bind(key.attempt)
                        .bind(self.worker_id)
                        .bind(delay)
                        .bind(*terminal),
                    fetch_optional
                )
            })
            .await;
        let span = tracing::info_span!("pgflow.task", flow = %key.flow_slug, step = %key.step_slug,
            run_id = %key.run_id, task_index = key.task_index, msg_id = key.msg_id, attempt = key.attempt);
        let _entered = span.enter();
        match row {
            Ok(Some((Recorded::Applied, status, current))) => {
                self.stats.failed.fetch_add(1, Ordering::Relaxed);
                self.metrics.on(&key.flow_slug, &key.step_slug, |m| {
                    if status == TaskStatus::Queued {
                        m.retried.increment(1)
                    } else {
                        m.failed.increment(1)
                    }
                });
                if status == TaskStatus::Queued {
                    tracing::warn!(error = %message, retry_in_s = ?delay, "task failed; it will be retried");
                } else {
                    tracing::error!(error = %message, terminal, attempt = current, "task failed for good");
                }
            }
            Ok(Some((_, status, current))) => {
                self.stats.stale.fetch_add(1, Ordering::Relaxed);
                self.metrics
                    .on(&key.flow_slug, &key.step_slug, |m| m.stale.increment(1));
                tracing::warn!(error = %message, current_attempt = current, status = %status,
                    "stale failure ignored: the task moved on to another attempt or finished");
            }
            Ok(None) => {
                tracing::warn!(error = %message, "failure of a task that no longer exists ignored")
            }
            Err(GaveUp::Deadline(e)) | Err(GaveUp::Permanent(e)) => {
                drop(_entered);
                self.give_up(vec![item], &e);
                return;
            }
        }
        drop(_entered);
        self.done(vec![item]);
    }

    async fn with_retries<T, Fut>(
        &self,
        what: &'static str,
        mut op: impl FnMut() -> Fut,
    ) -> Result<T, GaveUp<sqlx::Error>>
    where
        Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
    {
        retry(
            Backoff::database(self.backoff_max),
            Instant::now() + RECORD_PATIENCE,
            transient,
            |e, attempt, wait| {
                tracing::warn!(error = %e, attempt, retry_in_ms = wait.as_millis() as u64, "{what} failed; retrying")
            },
            &mut op,
        )
        .await
    }

    /// Forgets recorded (or given up) results; their permits are released.
    pub(crate) fn done(&self, items: Vec<TaskResult>) {
        let mut pending = self.pending.lock().expect("pending lock");
        for item in &items {
            pending.remove(&item.key.msg_id);
        }
    }

    /// Logs results that cannot be recorded (recovery runs their tasks again) and forgets them.
    pub(crate) fn give_up(&self, items: Vec<TaskResult>, e: &dyn std::fmt::Display) {
        let ids: Vec<String> = items.iter().map(|i| describe(&i.key)).collect();
        tracing::error!(error = %e, tasks = ?ids,
            "cannot record these results; recovery will run the tasks again");
        self.done(items);
    }
}

/// `run/step/index (attempt n, message m)`, the id of an unrecorded result in logs.
pub(crate) fn describe(key: &TaskKey) -> String {
    format!(
        "{}/{}/{} (attempt {}, message {})",
        key.run_id, key.step_slug, key.task_index, key.attempt, key.msg_id
    )
}

/// An error message PostgreSQL can store: NUL characters become the visible escape `\u0000`.
pub(crate) fn storable(message: &str) -> String {
    if message.contains('\0') {
        message.replace('\0', "\\u0000")
    } else {
        message.to_owned()
    }
}

/// Whether the statement ran but its answer could not be decoded.
fn is_decode(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::ColumnDecode { .. } | sqlx::Error::Decode(_))
}

fn database_message(e: &sqlx::Error) -> String {
    e.as_database_error()
        .map(|d| d.message().to_owned())
        .unwrap_or_else(|| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A recorder whose pool never connects (these tests touch no database).
    fn recorder() -> Recorder {
        Recorder {
            metrics: Arc::new(WorkerMetrics::new("q", &["f"], &["s"])),
            pool: sqlx::postgres::PgPoolOptions::new()
                .connect_lazy_with(sqlx::postgres::PgConnectOptions::new()),
            worker_id: Uuid::nil(),
            backoff_max: Duration::from_secs(1),
            stats: Arc::default(),
            pending: Arc::default(),
            pooled: false,
        }
    }

    fn result(msg_id: i64, rooms: &Arc<tokio::sync::Semaphore>) -> TaskResult {
        TaskResult {
            key: TaskKey {
                run_id: Uuid::new_v4(),
                flow_slug: "f".into(),
                step_slug: "s".into(),
                task_index: 0,
                msg_id,
                attempt: 1,
            },
            outcome: Outcome::Output(serde_json::Value::Null),
            ran_for: Duration::ZERO,
            first_error: None,
            _permit: Arc::clone(rooms).try_acquire_owned().expect("a free room"),
        }
    }

    #[tokio::test]
    async fn recorded_and_given_up_results_are_forgotten_and_free_their_rooms() {
        let r = recorder();
        let rooms = Arc::new(tokio::sync::Semaphore::new(3));
        let items: Vec<TaskResult> = (1..=3).map(|id| result(id, &rooms)).collect();
        r.pending
            .lock()
            .unwrap()
            .extend(items.iter().map(|i| (i.key.msg_id, i.key.clone())));
        let mut items = items.into_iter();
        r.done(items.by_ref().take(2).collect());
        assert_eq!(
            r.pending
                .lock()
                .unwrap()
                .keys()
                .copied()
                .collect::<Vec<_>>(),
            vec![3],
            "what is recorded leaves the list of unrecorded results that shutdown logs"
        );
        assert_eq!(rooms.available_permits(), 2);
        r.give_up(items.collect(), &"database gone");
        assert!(r.pending.lock().unwrap().is_empty());
        assert_eq!(rooms.available_permits(), 3);
    }

    #[test]
    fn error_messages_become_storable() {
        assert_eq!(storable("a\0b"), "a\\u0000b");
        assert_eq!(storable("fine"), "fine");
    }
}
