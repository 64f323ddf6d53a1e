//! The run list: filters, keyset pages and counts per status.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{Postgres, QueryBuilder};
use uuid::Uuid;

use super::{Admin, AdminError};
use crate::client::RunStatus;

/// The most runs one page holds ([`RunFilter::limit`] is capped to it).
pub const MAX_PAGE: u32 = 500;

/// Counts per status stop at this many runs ([`StatusCount::capped`]): a count over a long history would read
/// all of it, and an operator needs to know "more than 10,000", not the exact figure.
pub const COUNT_CAP: u64 = 10_000;

/// The statuses a run can have, in the order counts are reported.
const STATUSES: [RunStatus; 4] = [
    RunStatus::Started,
    RunStatus::Completed,
    RunStatus::Failed,
    RunStatus::Cancelled,
];

/// Which runs [`Admin::runs`] and [`Admin::run_counts`] return: the runs matching every filter set, newest
/// first. Built from [`RunFilter::new`] with its methods, or by setting its fields.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct RunFilter {
    /// A flow: a concrete flow slug, or an alias. An alias matches the runs of the version it points at and of
    /// the version it pointed at before its last activation (during a rollout, both have runs); a slug
    /// matches that version's runs.
    pub flow: Option<String>,
    /// One concrete version (flow slug), exactly.
    pub version: Option<String>,
    /// The runs' status. [`Admin::run_counts`] ignores it (it counts every status).
    pub status: Option<RunStatus>,
    /// Runs started at or after this time.
    pub started_after: Option<DateTime<Utc>>,
    /// Runs started before this time.
    pub started_before: Option<DateTime<Utc>>,
    /// Runs whose input at this JSON path (object keys, or array positions as digits) equals this value.
    pub input_equals: Option<(Vec<String>, Value)>,
    /// The page after this cursor (a previous page's [`Page::next`]); `None`: the newest page.
    pub after: Option<Cursor>,
    /// Runs per page: 50 when unset, at most [`MAX_PAGE`].
    pub limit: Option<u32>,
}

impl RunFilter {
    /// Every run, newest first (narrow it with the other methods).
    pub fn new() -> Self {
        Self::default()
    }

    /// Only runs of this flow slug or alias (see [`RunFilter::flow`](RunFilter#structfield.flow)).
    #[must_use]
    pub fn flow(mut self, flow_or_alias: impl Into<String>) -> Self {
        self.flow = Some(flow_or_alias.into());
        self
    }

    /// Only runs of this concrete version.
    #[must_use]
    pub fn version(mut self, flow_slug: impl Into<String>) -> Self {
        self.version = Some(flow_slug.into());
        self
    }

    /// Only runs in this status.
    #[must_use]
    pub fn status(mut self, status: RunStatus) -> Self {
        self.status = Some(status);
        self
    }

    /// Only runs started at or after `at`.
    #[must_use]
    pub fn started_after(mut self, at: DateTime<Utc>) -> Self {
        self.started_after = Some(at);
        self
    }

    /// Only runs started before `at`.
    #[must_use]
    pub fn started_before(mut self, at: DateTime<Utc>) -> Self {
        self.started_before = Some(at);
        self
    }

    /// Only runs whose input at `path` equals `value`.
    #[must_use]
    pub fn input_equals<P: Into<String>>(
        mut self,
        path: impl IntoIterator<Item = P>,
        value: Value,
    ) -> Self {
        self.input_equals = Some((path.into_iter().map(Into::into).collect(), value));
        self
    }

    /// The page after `cursor`.
    #[must_use]
    pub fn after(mut self, cursor: Cursor) -> Self {
        self.after = Some(cursor);
        self
    }

    /// Runs per page (1 to [`MAX_PAGE`]).
    #[must_use]
    pub fn limit(mut self, limit: u32) -> Self {
        self.limit = Some(limit);
        self
    }

    fn page_size(&self) -> u32 {
        self.limit.unwrap_or(50).clamp(1, MAX_PAGE)
    }

    /// Appends ` and <condition>` for each filter set (`r` is the runs table); the status filter only when
    /// `with_status`.
    fn push_conditions(&self, q: &mut QueryBuilder<'_, Postgres>, with_status: bool) {
        if let Some(flow) = &self.flow {
            // One index range per version: the alias's current and previous version, and the name itself.
            q.push(
                " and r.flow_slug = any (array(select unnest(array[a.flow_slug, a.previous_flow_slug]) \
                 from pgflow.flow_aliases a where a.alias = ",
            )
            .push_bind(flow.clone())
            .push(") || ")
            .push_bind(flow.clone())
            .push("::text)");
        }
        if let Some(version) = &self.version {
            q.push(" and r.flow_slug = ").push_bind(version.clone());
        }
        if let (true, Some(status)) = (with_status, self.status) {
            q.push(" and r.status = ").push_bind(status.as_str());
        }
        if let Some(at) = self.started_after {
            q.push(" and r.started_at >= ").push_bind(at);
        }
        if let Some(at) = self.started_before {
            q.push(" and r.started_at < ").push_bind(at);
        }
        if let Some((path, value)) = &self.input_equals {
            // A containment test first, which the GIN index on input answers (equality at a path of object
            // keys implies it); the path equality keeps the exact meaning. A path with array positions (digits)
            // has no containment form, and reads the runs in order until a page is full.
            if !path.is_empty() && path.iter().all(|k| !k.bytes().all(|b| b.is_ascii_digit())) {
                let doc = path.iter().rev().fold(value.clone(), |inner, key| {
                    Value::Object([(key.clone(), inner)].into_iter().collect())
                });
                q.push(" and r.input @> ").push_bind(doc);
            }
            q.push(" and r.input #> ")
                .push_bind(path.clone())
                .push(" = ")
                .push_bind(value.clone());
        }
    }
}

/// Where a page of runs ends: the last run's start time and id. Its text form (`Display`, `FromStr`) is
/// `<microseconds since 1970>_<run id>`, for a URL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    /// The start time of the last run of the page.
    pub started_at: DateTime<Utc>,
    /// Its id.
    pub run_id: Uuid,
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}_{}", self.started_at.timestamp_micros(), self.run_id)
    }
}

impl FromStr for Cursor {
    type Err = AdminError;

    fn from_str(text: &str) -> Result<Self, AdminError> {
        let bad = || AdminError::BadCursor(text.to_owned());
        let (micros, id) = text.split_once('_').ok_or_else(bad)?;
        let micros: i64 = micros.parse().map_err(|_| bad())?;
        Ok(Cursor {
            started_at: DateTime::from_timestamp_micros(micros).ok_or_else(bad)?,
            run_id: id.parse().map_err(|_| bad())?,
        })
    }
}

/// One page of answers.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Page<T> {
    /// The items, newest first.
    pub items: Vec<T>,
    /// The cursor of the next (older) page, or `None` when this page is the last.
    pub next: Option<Cursor>,
}

/// A run in the run list.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
#[non_exhaustive]
pub struct RunSummary {
    /// The run id.
    pub run_id: Uuid,
    /// Its concrete version (flow slug).
    pub flow_slug: String,
    /// Its status.
    pub status: RunStatus,
    /// When it started.
    pub started_at: DateTime<Utc>,
    /// When it completed, failed or was cancelled.
    pub finished_at: Option<DateTime<Utc>>,
    /// Steps not finished yet.
    pub remaining_steps: i32,
    /// How many times it was retried in place.
    pub retry_count: i32,
    /// The run it replays.
    pub replay_of: Option<Uuid>,
    /// Why it was cancelled.
    pub cancel_reason: Option<String>,
    /// Its input (`None` when payloads are hidden).
    pub input: Option<Value>,
}

/// How many runs of a filter are in one status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct StatusCount {
    /// The status.
    pub status: RunStatus,
    /// How many runs (at most [`COUNT_CAP`]).
    pub count: u64,
    /// Whether there are more than [`COUNT_CAP`] (the count stopped there).
    pub capped: bool,
}

impl Admin {
    /// One page of the runs matching `filter`, newest first (by start time, then run id), with the cursor of
    /// the next page. Each page reads about as many index entries as it returns, however long the history.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn runs(&self, filter: &RunFilter) -> Result<Page<RunSummary>, AdminError> {
        let limit = filter.page_size();
        let mut q = QueryBuilder::<Postgres>::new(
            "select r.run_id, r.flow_slug, r.status, r.started_at, \
             coalesce(r.completed_at, r.failed_at, r.cancelled_at) as finished_at, r.remaining_steps, \
             r.retry_count, r.replay_of, r.cancel_reason, ",
        );
        q.push(if self.hide_payloads {
            "null::jsonb as input"
        } else {
            "r.input"
        });
        q.push(" from pgflow.runs r where true");
        filter.push_conditions(&mut q, true);
        if let Some(cursor) = filter.after {
            q.push(" and (r.started_at, r.run_id) < (")
                .push_bind(cursor.started_at)
                .push(", ")
                .push_bind(cursor.run_id)
                .push(")");
        }
        q.push(" order by r.started_at desc, r.run_id desc limit ")
            .push_bind(i64::from(limit) + 1);
        let mut tx = self.read().await?;
        let mut items: Vec<RunSummary> = q
            .build_query_as()
            // Unnamed, so planned for its values each time: a cached generic plan cannot know whether the status
            // or flow it filters on is 1% or 98% of the history, and picked plans 20 times slower.
            .persistent(false)
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        let more = items.len() > limit as usize;
        items.truncate(limit as usize);
        let next = more.then(|| {
            let last = items
                .last()
                .expect("a page with more after it is not empty");
            Cursor {
                started_at: last.started_at,
                run_id: last.run_id,
            }
        });
        Ok(Page { items, next })
    }

    /// How many runs match `filter` in each status (its status filter and cursor are ignored), each count
    /// stopping at [`COUNT_CAP`]. In the order started, completed, failed, cancelled.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn run_counts(&self, filter: &RunFilter) -> Result<Vec<StatusCount>, AdminError> {
        let cap = i64::try_from(COUNT_CAP).unwrap_or(i64::MAX);
        let mut q = QueryBuilder::<Postgres>::new("select ");
        for (i, status) in STATUSES.iter().enumerate() {
            if i > 0 {
                q.push(", ");
            }
            q.push("(select count(*) from (select 1 from pgflow.runs r where r.status = ")
                .push_bind(status.as_str());
            filter.push_conditions(&mut q, false);
            q.push(" limit ").push_bind(cap + 1).push(") x)");
        }
        let mut tx = self.read().await?;
        let row: (i64, i64, i64, i64) = q
            .build_query_as()
            // Unnamed, so planned for its values each time: a cached generic plan cannot know whether the status
            // or flow it filters on is 1% or 98% of the history, and picked plans 20 times slower.
            .persistent(false)
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        let counts = [row.0, row.1, row.2, row.3];
        Ok(STATUSES
            .iter()
            .zip(counts)
            .map(|(&status, n)| {
                let n = u64::try_from(n).unwrap_or(0);
                StatusCount {
                    status,
                    count: n.min(COUNT_CAP),
                    capped: n > COUNT_CAP,
                }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_reads_back_what_it_wrote_and_a_bad_one_is_refused() {
        let cursor = Cursor {
            started_at: DateTime::from_timestamp_micros(1_700_000_000_123_456).unwrap(),
            run_id: Uuid::new_v4(),
        };
        assert_eq!(cursor.to_string().parse::<Cursor>().unwrap(), cursor);
        for bad in ["", "12", "x_y", "12_not-a-uuid"] {
            let e = bad.parse::<Cursor>().unwrap_err();
            assert!(e.to_string().contains(&format!("`{bad}`")), "{e}");
        }
    }

    #[test]
    fn the_page_size_defaults_and_is_capped() {
        assert_eq!(RunFilter::new().page_size(), 50);
        assert_eq!(RunFilter::new().limit(0).page_size(), 1);
        assert_eq!(RunFilter::new().limit(10_000).page_size(), MAX_PAGE);
    }
}
