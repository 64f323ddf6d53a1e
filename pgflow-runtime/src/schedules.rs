//! Durable cron schedules: declared in Rust (or created in SQL with `pgflow.set_schedule`), stored in
//! Postgres, fired by any worker, exactly one run per (schedule, fire time).
//!
//! ```no_run
//! # use pgflow_runtime::schedules::{Missed, Overlap, Schedule};
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let nightly = Schedule::new("nightly-report", "report", "0 3 * * *")
//!     .time_zone("Europe/Paris")
//!     .input(serde_json::json!({"kind": "daily"}))
//!     .missed(Missed::CatchUp(3))
//!     .overlap(Overlap::Skip);
//! nightly.set(&pool).await?;
//! # Ok(()) }
//! ```
//!
//! Every worker looks for due schedules every `schedule_interval` (1 s by default) and fires them through
//! `pgflow.fire_schedule`, which locks the schedule row, checks that its next fire time is still the one
//! the worker computed from, records one row per fire time (primary key `(schedule_name, fire_at)`) and
//! starts the runs in the same transaction. Of several workers, one fires and the others find the next fire
//! time moved on. Cron parsing, time zones and daylight-saving transitions come from `croner` and
//! `chrono-tz`.

use crate::pooling::run;
use std::collections::VecDeque;
use std::time::Duration;

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::Flow;

/// What happens to fires missed while no worker ran (or the database was unreachable).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(try_from = "MissedColumns")]
pub enum Missed {
    /// Drop them and go on with the next fire. A fire counts as missed when no worker fired it within
    /// [`MISSED_GRACE`] of its time.
    #[default]
    Skip,
    /// Start runs for at most this many missed fires (the most recent ones), then go on. 1 to 1000.
    CatchUp(u32),
}

impl Missed {
    /// The policy's SQL text (`pgflow.schedules.missed`): `skip` or `catch_up`.
    pub const fn as_str(self) -> &'static str {
        self.kind().as_str()
    }

    /// How many missed fires it catches up at most (`None` for [`Missed::Skip`]).
    pub const fn catch_up_max(self) -> Option<u32> {
        match self {
            Missed::Skip => None,
            Missed::CatchUp(n) => Some(n),
        }
    }

    const fn kind(self) -> MissedKind {
        match self {
            Missed::Skip => MissedKind::Skip,
            Missed::CatchUp(_) => MissedKind::CatchUp,
        }
    }
}

impl std::fmt::Display for Missed {
    /// `skip`, or `catch_up (at most N)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Missed::Skip => f.write_str("skip"),
            Missed::CatchUp(n) => write!(f, "catch_up (at most {n})"),
        }
    }
}

crate::decode::text_enum! {
    /// The text of a missed-fire policy (`pgflow.schedules.missed`); its bound is `catch_up_max`.
    pub(crate) enum MissedKind {
        Skip = "skip",
        CatchUp = "catch_up",
    }
}

/// A schedule's two missed-fire columns, as SQL selects them with
/// `jsonb_build_object('missed', missed, 'catch_up_max', catch_up_max)`.
#[derive(serde::Deserialize)]
struct MissedColumns {
    missed: MissedKind,
    catch_up_max: i64,
}

impl TryFrom<MissedColumns> for Missed {
    type Error = String;

    fn try_from(c: MissedColumns) -> Result<Self, String> {
        Ok(match c.missed {
            MissedKind::Skip => Missed::Skip,
            MissedKind::CatchUp => {
                Missed::CatchUp(u32::try_from(c.catch_up_max).map_err(|_| {
                    format!(
                        "catch_up_max must be 1 to 1000, the database holds {}",
                        c.catch_up_max
                    )
                })?)
            }
        })
    }
}

/// The missed-fire policy of `pgflow.schedules` as one JSON column (see [`Missed`]'s decoding).
pub(crate) const MISSED_COLUMN: &str =
    "jsonb_build_object('missed', s.missed, 'catch_up_max', s.catch_up_max)";

crate::decode::text_enum! {
    /// What a fire does while the schedule's previous run is still running.
    #[derive(Default)]
    pub enum Overlap {
        /// Start a run anyway.
        #[default]
        Allow = "allow",
        /// Start none; the fire is recorded as `skipped_overlap` in `pgflow.schedule_fires`.
        Skip = "skip",
    }
}

/// How late a fire may be and still start a run under [`Missed::Skip`].
pub const MISSED_GRACE: Duration = Duration::from_secs(60);

/// The most fire times computed for one schedule in one tick (a per-second cron after a long downtime).
const MAX_SCAN: usize = 100_000;

/// A schedule: a flow or alias, a cron expression with a time zone, an input and two policies.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    name: String,
    flow: String,
    cron: String,
    time_zone: String,
    input: serde_json::Value,
    missed: Missed,
    overlap: Overlap,
    input_error: Option<String>,
}

/// A schedule that cannot be stored or fired.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ScheduleError {
    /// The cron expression does not parse.
    #[error("schedule `{schedule}`: invalid cron expression \"{cron}\": {reason}; use 5 fields (minute hour day-of-month month day-of-week), 6 with seconds first, or @hourly, @daily...")]
    InvalidCron {
        /// The schedule's name.
        schedule: String,
        /// The expression as given.
        cron: String,
        /// What the parser says.
        reason: String,
    },
    /// The time zone is not an IANA zone name.
    #[error("schedule `{schedule}`: unknown time zone \"{time_zone}\"; use an IANA name such as \"UTC\" or \"Europe/Paris\"")]
    InvalidTimeZone {
        /// The schedule's name.
        schedule: String,
        /// The zone as given.
        time_zone: String,
    },
    /// `Missed::CatchUp` outside 1..=1000.
    #[error("schedule `{schedule}`: catch up at most 1 to 1000 missed fires, got {given}")]
    InvalidCatchUp {
        /// The schedule's name.
        schedule: String,
        /// The value given.
        given: u32,
    },
    /// The input does not serialize to JSON.
    #[error("schedule `{schedule}`: the input does not serialize to JSON: {reason}")]
    InvalidInput {
        /// The schedule's name.
        schedule: String,
        /// The serializer's error.
        reason: String,
    },
    /// The database refused it (an unknown flow or alias, an invalid name...) or could not be reached.
    #[error("schedule `{schedule}`: {source}")]
    Database {
        /// The schedule's name.
        schedule: String,
        /// The database error.
        #[source]
        source: sqlx::Error,
    },
}

/// A parsed cron expression in its time zone.
#[derive(Debug, Clone)]
struct When {
    cron: croner::Cron,
    tz: Tz,
}

impl When {
    fn parse(schedule: &str, cron: &str, time_zone: &str) -> Result<When, ScheduleError> {
        let tz: Tz = time_zone
            .parse()
            .map_err(|_| ScheduleError::InvalidTimeZone {
                schedule: schedule.to_owned(),
                time_zone: time_zone.to_owned(),
            })?;
        let cron = croner::Cron::new(cron.trim())
            .with_seconds_optional()
            .parse()
            .map_err(|e| ScheduleError::InvalidCron {
                schedule: schedule.to_owned(),
                cron: cron.to_owned(),
                reason: e.to_string(),
            })?;
        Ok(When { cron, tz })
    }

    /// The first fire time strictly after `t`.
    fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.cron
            .find_next_occurrence(&t.with_timezone(&self.tz), false)
            .ok()
            .map(|d| d.with_timezone(&Utc))
    }

    /// The fire times in `from..=until` (from inclusive), keeping the last `keep`.
    fn due(&self, from: DateTime<Utc>, until: DateTime<Utc>, keep: usize) -> Vec<DateTime<Utc>> {
        let mut kept = VecDeque::with_capacity(keep.min(1024));
        let mut at = self
            .cron
            .find_next_occurrence(&from.with_timezone(&self.tz), true)
            .ok();
        let mut scanned = 0;
        while let Some(t) = at {
            let t = t.with_timezone(&Utc);
            if t > until || scanned >= MAX_SCAN {
                break;
            }
            if kept.len() == keep {
                kept.pop_front();
            }
            kept.push_back(t);
            scanned += 1;
            at = self.next_after(t).map(|n| n.with_timezone(&self.tz));
        }
        kept.into()
    }
}

impl Schedule {
    /// A schedule named `name` (1 to 128 letters, digits, `_ . : -`) that starts `flow` (a flow slug or an
    /// alias, resolved at each fire) at the times of `cron` (5 fields, or 6 with seconds first; UTC unless
    /// [`time_zone`](Self::time_zone) says otherwise), with input `{}`, [`Missed::Skip`] and
    /// [`Overlap::Allow`].
    pub fn new(name: impl Into<String>, flow: impl Into<String>, cron: impl Into<String>) -> Self {
        Schedule {
            name: name.into(),
            flow: flow.into(),
            cron: cron.into(),
            time_zone: "UTC".to_owned(),
            input: serde_json::json!({}),
            missed: Missed::Skip,
            overlap: Overlap::Allow,
            input_error: None,
        }
    }

    /// A schedule of flow `F` (by its slug) with a typed input (an input that does not serialize is
    /// reported by [`validate`](Self::validate)).
    pub fn for_flow<F: Flow>(
        name: impl Into<String>,
        cron: impl Into<String>,
        input: &F::Input,
    ) -> Self {
        let mut s = Schedule::new(name, F::SLUG, cron);
        match serde_json::to_value(input) {
            Ok(v) => s.input = v,
            Err(e) => s.input_error = Some(e.to_string()),
        }
        s
    }

    /// The IANA time zone the cron expression is read in (default `UTC`); daylight-saving transitions
    /// follow it.
    pub fn time_zone(mut self, time_zone: impl Into<String>) -> Self {
        self.time_zone = time_zone.into();
        self
    }

    /// The input of every run the schedule starts (default `{}`).
    pub fn input(mut self, input: serde_json::Value) -> Self {
        self.input = input;
        self.input_error = None;
        self
    }

    /// The missed-fire policy (default [`Missed::Skip`]).
    pub fn missed(mut self, missed: Missed) -> Self {
        self.missed = missed;
        self
    }

    /// The overlap policy (default [`Overlap::Allow`]).
    pub fn overlap(mut self, overlap: Overlap) -> Self {
        self.overlap = overlap;
        self
    }

    /// The schedule's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Checks the cron expression, the time zone and the policies without the database.
    ///
    /// # Errors
    ///
    /// The first invalid part, quoting it.
    pub fn validate(&self) -> Result<(), ScheduleError> {
        When::parse(&self.name, &self.cron, &self.time_zone)?;
        if let Some(reason) = &self.input_error {
            return Err(ScheduleError::InvalidInput {
                schedule: self.name.clone(),
                reason: reason.clone(),
            });
        }
        if let Missed::CatchUp(n) = self.missed {
            if !(1..=1000).contains(&n) {
                return Err(ScheduleError::InvalidCatchUp {
                    schedule: self.name.clone(),
                    given: n,
                });
            }
        }
        Ok(())
    }

    /// The first fire time strictly after `t`.
    ///
    /// # Errors
    ///
    /// As [`validate`](Self::validate).
    pub fn next_fire_after(
        &self,
        t: DateTime<Utc>,
    ) -> Result<Option<DateTime<Utc>>, ScheduleError> {
        Ok(When::parse(&self.name, &self.cron, &self.time_zone)?.next_after(t))
    }

    /// Stores the schedule (creates it, or replaces its definition; an unchanged cron expression and zone
    /// keep its next fire time, and a paused schedule stays paused). Idempotent: a worker declares its
    /// schedules at every start.
    ///
    /// # Errors
    ///
    /// An invalid part (nothing is stored), or the database's refusal (an unknown flow or alias).
    pub async fn set(&self, pool: &PgPool) -> Result<(), ScheduleError> {
        self.set_with(pool, false).await
    }

    /// [`Schedule::set`], behind a transaction pooler when `pooled` (an unnamed statement in its own
    /// transaction).
    pub(crate) async fn set_with(&self, pool: &PgPool, pooled: bool) -> Result<(), ScheduleError> {
        self.validate()?;
        let next = self.next_fire_after(Utc::now())?;
        let catch_up = self
            .missed
            .catch_up_max()
            .map_or(1, |n| i32::try_from(n).unwrap_or(i32::MAX));
        let query = sqlx::query(
            "select 1 from pgflow.set_schedule(schedule_name => $1, flow_slug => $2, cron => $3, \
             time_zone => $4, input => $5, missed => $6, catch_up_max => $7, overlap => $8, \
             next_fire_at => $9)",
        )
        .bind(&self.name)
        .bind(&self.flow)
        .bind(&self.cron)
        .bind(&self.time_zone)
        .bind(&self.input)
        .bind(self.missed.as_str())
        .bind(catch_up)
        .bind(self.overlap.as_str())
        .bind(next);
        run!(pooled, pool, query, execute)
            .await
            .map_err(|source| ScheduleError::Database {
                schedule: self.name.clone(),
                source,
            })?;
        Ok(())
    }
}

/// Pauses schedule `name` (`pgflow.pause_schedule`; the schema owner's right).
///
/// # Errors
///
/// An unknown schedule, or a database error.
pub async fn pause(pool: &PgPool, name: &str) -> Result<(), sqlx::Error> {
    sqlx::query("select 1 from pgflow.pause_schedule(schedule_name => $1)")
        .bind(name)
        .execute(pool)
        .await
        .map(drop)
}

/// Resumes schedule `name`; fires that fell while it was paused are not caught up.
///
/// # Errors
///
/// An unknown schedule, or a database error.
pub async fn resume(pool: &PgPool, name: &str) -> Result<(), sqlx::Error> {
    sqlx::query("select 1 from pgflow.resume_schedule(schedule_name => $1)")
        .bind(name)
        .execute(pool)
        .await
        .map(drop)
}

/// Deletes schedule `name` and its fire records (not its runs); whether it existed.
///
/// # Errors
///
/// A database error.
pub async fn delete(pool: &PgPool, name: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("select pgflow.delete_schedule(schedule_name => $1)")
        .bind(name)
        .fetch_one(pool)
        .await
}

/// One fire recorded by [`fire_due`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fired {
    /// The schedule.
    pub schedule: String,
    /// The fire time.
    pub fire_at: DateTime<Utc>,
    /// The run it started; `None` when skipped for overlap.
    pub run_id: Option<Uuid>,
}

#[derive(sqlx::FromRow)]
struct Due {
    schedule_name: String,
    cron: String,
    time_zone: String,
    #[sqlx(json)]
    missed: Missed,
    next_fire_at: Option<DateTime<Utc>>,
}

/// Fires every schedule due at `now` (pass `Utc::now()`; tests pass a fixed time) and returns the fires this
/// call recorded. A schedule another caller fired meanwhile is left alone; one whose stored cron expression
/// or time zone does not parse is paused with `last_error` set.
///
/// # Errors
///
/// A database error (schedules fired before it stay fired).
pub async fn fire_due(pool: &PgPool, now: DateTime<Utc>) -> Result<Vec<Fired>, sqlx::Error> {
    fire_due_with(pool, now, false).await
}

/// [`fire_due`], behind a transaction pooler when `pooled`.
async fn fire_due_with(
    pool: &PgPool,
    now: DateTime<Utc>,
    pooled: bool,
) -> Result<Vec<Fired>, sqlx::Error> {
    let sql = format!(
        "select s.schedule_name, s.cron, s.time_zone, {MISSED_COLUMN} as missed, s.next_fire_at \
         from pgflow.due_schedules(as_of => $1) s"
    );
    let query = sqlx::query_as(&sql).bind(now);
    let due: Vec<Due> = run!(pooled, pool, query, fetch_all).await?;
    let mut fired = Vec::new();
    for d in due {
        let (times, next, error) = match When::parse(&d.schedule_name, &d.cron, &d.time_zone) {
            Err(e) => {
                tracing::warn!(schedule = %d.schedule_name, error = %e, "pausing a schedule that cannot be parsed");
                (Vec::new(), None, Some(e.to_string()))
            }
            Ok(when) => {
                let times = match d.next_fire_at {
                    None => Vec::new(),
                    Some(from) => {
                        if let Missed::CatchUp(keep) = d.missed {
                            let keep = usize::try_from(keep.max(1)).unwrap_or(1);
                            when.due(from, now, keep)
                        } else {
                            let grace = chrono::Duration::from_std(MISSED_GRACE)
                                .unwrap_or(chrono::Duration::MAX);
                            when.due(from, now, 1)
                                .into_iter()
                                .filter(|t| now - *t <= grace)
                                .collect()
                        }
                    }
                };
                match when.next_after(now) {
                    Some(next) => (times, Some(next), None),
                    None => (
                        Vec::new(),
                        None,
                        Some(format!(
                            "cron expression \"{}\" has no next fire time",
                            d.cron
                        )),
                    ),
                }
            }
        };
        let query = sqlx::query_as(
            "select fire_at, run_id, outcome from pgflow.fire_schedule(schedule_name => $1, \
             expected_next_fire_at => $2, fire_times => $3, next_fire_at => $4, error => $5)",
        )
        .bind(&d.schedule_name)
        .bind(d.next_fire_at)
        .bind(&times)
        .bind(next)
        .bind(error);
        let rows: Vec<(DateTime<Utc>, Option<Uuid>, String)> =
            run!(pooled, pool, query, fetch_all).await?;
        fired.extend(rows.into_iter().map(|(fire_at, run_id, _)| Fired {
            schedule: d.schedule_name.clone(),
            fire_at,
            run_id,
        }));
    }
    Ok(fired)
}

/// Fires due schedules every `interval` until `done` (a worker's background duty).
pub(crate) async fn tick(pool: PgPool, pooled: bool, interval: Duration, done: CancellationToken) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = done.cancelled() => return,
            _ = ticker.tick() => {}
        }
        match fire_due_with(&pool, Utc::now(), pooled).await {
            Ok(fired) => {
                for f in fired {
                    tracing::debug!(schedule = %f.schedule, fire_at = %f.fire_at, run_id = ?f.run_id, "schedule fired");
                }
            }
            Err(e) => tracing::warn!(error = %e, "firing due schedules failed"),
        }
    }
}
