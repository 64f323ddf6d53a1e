//! Run control: cancel, retry in place, replay from a step, and keyed (idempotent) starts.

use chrono::{DateTime, Utc};
use serde_json::Value;

use super::state::RunStatus;
use super::{Client, ClientError};
use crate::pooling::run;
use crate::statements;

/// What [`Client::cancel`](super::Client::cancel) did (`pgflow.cancel_run`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CancelOutcome {
    /// The run's status afterwards: `Cancelled`, or the status of a run that had already finished.
    pub status: RunStatus,
    /// Whether this call cancelled the run (`false`: it was already finished, and nothing changed).
    pub changed: bool,
    /// The cancel reason (of this call, or of an earlier cancel).
    pub reason: Option<String>,
    /// When the run was cancelled.
    pub cancelled_at: Option<DateTime<Utc>>,
}

/// Which runs [`Client::cancel_runs`](super::Client::cancel_runs) cancels: started runs matching every filter
/// set. Built with its methods from [`CancelFilter::new`].
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct CancelFilter {
    /// A concrete flow slug or an alias.
    pub flow_slug: Option<String>,
    /// Runs started before this time.
    pub started_before: Option<DateTime<Utc>>,
    /// Runs whose input at this JSON path equals this value.
    pub input_equals: Option<(Vec<String>, Value)>,
    /// The reason recorded on every cancelled run.
    pub reason: Option<String>,
    /// Runs cancelled per transaction (default 1000).
    pub batch_size: Option<u32>,
}

impl CancelFilter {
    /// Every started run (narrow it with the other methods).
    pub fn new() -> Self {
        Self::default()
    }

    /// Only runs of this flow slug or alias.
    #[must_use]
    pub fn flow(mut self, flow_slug: impl Into<String>) -> Self {
        self.flow_slug = Some(flow_slug.into());
        self
    }

    /// Only runs started before `at`.
    #[must_use]
    pub fn started_before(mut self, at: DateTime<Utc>) -> Self {
        self.started_before = Some(at);
        self
    }

    /// Only runs whose input at `path` (keys or array positions) equals `value`.
    #[must_use]
    pub fn input_equals<P: Into<String>>(
        mut self,
        path: impl IntoIterator<Item = P>,
        value: Value,
    ) -> Self {
        self.input_equals = Some((path.into_iter().map(Into::into).collect(), value));
        self
    }

    /// The reason recorded on each cancelled run.
    #[must_use]
    pub fn reason(mut self, reason: impl Into<String>) -> Self {
        self.reason = Some(reason.into());
        self
    }

    /// Runs cancelled per transaction (at least 1).
    #[must_use]
    pub fn batch_size(mut self, n: u32) -> Self {
        self.batch_size = Some(n.max(1));
        self
    }
}

impl CancelFilter {
    /// The input filter's path and value, as `cancel_runs` takes them.
    fn input_parts(&self) -> (Option<Vec<String>>, Option<Value>) {
        match &self.input_equals {
            Some((path, value)) => (Some(path.clone()), Some(value.clone())),
            None => (None, None),
        }
    }
}

impl Client {
    /// Cancels every started run matching `filter`, one bounded batch (one transaction) at a time, and returns
    /// how many it cancelled.
    ///
    /// # Errors
    ///
    /// A database error (a batch already committed stays cancelled).
    pub async fn cancel_runs(&self, filter: &CancelFilter) -> Result<u64, ClientError> {
        let batch = u64::from(filter.batch_size.unwrap_or(1000).max(1));
        let mut total = 0u64;
        loop {
            let n = self.cancel_runs_batch(filter).await?;
            total += n;
            if n < batch {
                return Ok(total);
            }
        }
    }

    /// Cancels one batch of the started runs matching `filter`: at most [`CancelFilter::batch_size`] (1000 by
    /// default) in one transaction, and returns how many it cancelled. A batch smaller than the batch size is
    /// the last; [`Client::cancel_runs`] calls this until then, and a caller that reports progress calls it
    /// itself.
    ///
    /// # Errors
    ///
    /// A database error (nothing of this batch is cancelled).
    pub async fn cancel_runs_batch(&self, filter: &CancelFilter) -> Result<u64, ClientError> {
        let batch = i32::try_from(filter.batch_size.unwrap_or(1000).max(1)).unwrap_or(i32::MAX);
        self.call_cancel_runs(filter, batch, false).await
    }

    /// How many started runs match `filter` now: what [`Client::cancel_runs`] would cancel, counted by the same
    /// selection (`pgflow.cancel_runs` with `dry_run`), changing and locking nothing. A caller that reports
    /// progress asks for it first.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn count_runs_to_cancel(&self, filter: &CancelFilter) -> Result<u64, ClientError> {
        self.call_cancel_runs(filter, i32::MAX, true).await
    }

    /// One call of `pgflow.cancel_runs` with `filter`: at most `batch` runs, or only counted with `dry_run`.
    async fn call_cancel_runs(
        &self,
        filter: &CancelFilter,
        batch: i32,
        dry_run: bool,
    ) -> Result<u64, ClientError> {
        let (path, value) = filter.input_parts();
        let query = sqlx::query_scalar(statements::CANCEL_RUNS)
            .bind(filter.flow_slug.as_deref())
            .bind(filter.started_before)
            .bind(path.as_deref())
            .bind(value.as_ref())
            .bind(filter.reason.as_deref())
            .bind(batch)
            .bind(dry_run);
        let n: i32 = run!(self.pooling.is_transaction(), &self.pool, query, fetch_one).await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }
}

/// One start of [`Client::start`](super::Client::start) or [`Client::start_many`](super::Client::start_many):
/// an input, and optionally an idempotency key and a priority. A plain `&input` converts into a start without
/// a key, at priority 0.
///
/// With a key, starting again with the same key (for the same flow slug or alias, within the key window)
/// returns the run the first start created instead of a second one; the same key with another input is an
/// error naming the key (SQLSTATE `PF035`).
#[derive(Debug)]
#[non_exhaustive]
pub struct Start<'a, I> {
    /// The input.
    pub input: &'a I,
    /// The idempotency key.
    pub idempotency_key: Option<String>,
    /// The run's priority (default 0): on a queue with priorities enabled
    /// ([`flow_control::set_queue_priority`](crate::flow_control::set_queue_priority)), higher is claimed
    /// first; elsewhere it changes nothing.
    pub priority: i32,
}

impl<'a, I> Start<'a, I> {
    /// A start of `input` without a key.
    pub fn new(input: &'a I) -> Self {
        Start {
            input,
            idempotency_key: None,
            priority: 0,
        }
    }

    /// With idempotency key `key`.
    #[must_use]
    pub fn idempotency_key(mut self, key: impl Into<String>) -> Self {
        self.idempotency_key = Some(key.into());
        self
    }

    /// At priority `priority` (higher is claimed first on queues with priorities enabled; a run found by its
    /// idempotency key keeps the priority it was started with).
    #[must_use]
    pub fn priority(mut self, priority: i32) -> Self {
        self.priority = priority;
        self
    }
}

impl<'a, I> From<&'a I> for Start<'a, I> {
    fn from(input: &'a I) -> Self {
        Start::new(input)
    }
}
