//! Queues, workers and worker functions.

use std::collections::BTreeMap;

use chrono::{DateTime, Duration, DurationRound, Utc};
use serde::Deserialize;
use serde_json::Value;
use sqlx::types::Json;
use uuid::Uuid;

use super::{Admin, AdminError};
use crate::worker::GapReason;

/// A queue pgflow routes tasks to, with its depth.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
#[non_exhaustive]
pub struct QueueInfo {
    /// The PGMQ queue name.
    pub queue_name: String,
    /// Messages in the queue (visible or held by a claim); `None` when the PGMQ queue does not exist.
    pub depth: Option<i64>,
    /// Age in seconds of the oldest message.
    pub oldest_age_seconds: Option<f64>,
    /// Live workers registered on the queue (not stopped, heartbeat within the liveness window).
    pub live_workers: i64,
    /// Of those, the ones whose worker function is disabled (fenced): they claim nothing.
    pub fenced_workers: i64,
}

/// Claims and completions of one queue over recent minutes.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct QueueRates {
    /// The queue.
    pub queue_name: String,
    /// One entry per minute, oldest first, the current (partial) minute last.
    pub minutes: Vec<MinuteCounts>,
}

/// What happened on a queue in one minute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct MinuteCounts {
    /// The minute's start.
    pub minute: DateTime<Utc>,
    /// Tasks whose latest attempt started (was claimed) in the minute.
    pub claimed: i64,
    /// Tasks that completed in the minute.
    pub completed: i64,
    /// Tasks whose latest failure was in the minute.
    pub failed: i64,
}

/// A route with queued work and no live worker that can run it (`pgflow.queue_coverage`, `uncovered`).
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
#[non_exhaustive]
pub struct UncoveredRoute {
    /// The flow version.
    pub flow_slug: String,
    /// The step.
    pub step_slug: String,
    /// Its queue.
    pub queue_name: String,
    /// Its queued tasks.
    pub queued_tasks: i64,
    /// When the oldest of them was queued.
    pub oldest_queued_at: Option<DateTime<Utc>>,
}

/// A (flow, step) pair a queue must carry that its live workers do not declare (`pgflow.queue_coverage_gaps`
/// with the routes of the queue's live workers).
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
#[non_exhaustive]
pub struct CoverageGap {
    /// The queue.
    pub queue_name: String,
    /// The flow version.
    pub flow_slug: String,
    /// The step.
    pub step_slug: String,
    /// Why the queue must carry it.
    pub reason: GapReason,
    /// How many runs or tasks need it.
    pub count: i64,
    /// Examples (alias names or run ids).
    pub examples: Value,
    /// What to do.
    pub repair: String,
}

/// A worker function and its fence (`pgflow.worker_functions`).
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
#[non_exhaustive]
pub struct WorkerFunction {
    /// The function name.
    pub function_name: String,
    /// `false`: disabled (fenced); its workers claim nothing.
    pub enabled: bool,
    /// Why it was disabled.
    pub disabled_reason: Option<String>,
    /// When.
    pub disabled_at: Option<DateTime<Utc>>,
    /// When a worker of it last started.
    pub last_invoked_at: Option<DateTime<Utc>>,
}

/// A (flow, step) pair a worker runs.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[non_exhaustive]
pub struct Route {
    /// The flow version.
    pub flow_slug: String,
    /// The step.
    pub step_slug: String,
}

/// A registered worker (`pgflow.workers`).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct WorkerInfo {
    /// Its id.
    pub worker_id: Uuid,
    /// Its function name.
    pub function_name: String,
    /// The queue it claims from.
    pub queue_name: String,
    /// When it started.
    pub started_at: DateTime<Utc>,
    /// Its last heartbeat.
    pub last_heartbeat_at: DateTime<Utc>,
    /// When it stopped.
    pub stopped_at: Option<DateTime<Utc>>,
    /// Whether it is live: not stopped, heartbeat within the liveness window.
    pub live: bool,
    /// Whether its worker function is enabled.
    pub enabled: bool,
    /// The (flow, step) pairs it runs; empty: its whole queue (registered the upstream way).
    pub routes: Vec<Route>,
}

impl WorkerInfo {
    /// The versions (flow slugs) it serves.
    pub fn versions(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.routes.iter().map(|r| r.flow_slug.as_str()).collect();
        v.dedup();
        v
    }
}

/// The queues pgflow routes to: every step's queue and every shared queue.
const QUEUE_NAMES: &str =
    "select s.queue_name from pgflow.steps s union select q.queue_name from pgflow.shared_queues q";

/// Claims, completions and failures of one minute.
type Counts = (i64, i64, i64);

/// Live workers: not stopped, heartbeat within the liveness window.
const LIVE: &str =
    "w.stopped_at is null and w.last_heartbeat_at > now() - pgflow._worker_liveness_window()";

impl Admin {
    /// Every queue pgflow routes to, by name, with its depth, oldest message age and live workers. Counts each
    /// queue's messages (PGMQ keeps no count), so its cost follows the messages waiting, not the history.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn queues(&self) -> Result<Vec<QueueInfo>, AdminError> {
        let sql = format!(
            "select q.queue_name, \
             (select count(*) from pgflow.workers w where w.queue_name = q.queue_name and {LIVE}) as live_workers, \
             (select count(*) from pgflow.workers w join pgflow.worker_functions f \
                on f.function_name = w.function_name and not f.enabled \
              where w.queue_name = q.queue_name and {LIVE}) as fenced_workers, \
             to_regclass(format('pgmq.%I', 'q_' || q.queue_name)) is not null as has_table \
             from ({QUEUE_NAMES}) q order by q.queue_name"
        );
        let mut tx = self.read().await?;
        let rows: Vec<(String, i64, i64, bool)> = sqlx::query_as(&sql)
            .persistent(self.persistent())
            .fetch_all(&mut *tx)
            .await?;
        let mut out = Vec::with_capacity(rows.len());
        for (queue_name, live_workers, fenced_workers, has_table) in rows {
            // The queue's message table, read directly: its name is a validated pgflow queue name, quoted.
            let (depth, oldest_age_seconds) = if has_table {
                let table = format!("\"q_{}\"", queue_name.replace('"', "\"\""));
                let (depth, age): (i64, Option<f64>) = sqlx::query_as(&format!(
                    "select count(*), extract(epoch from now() - min(enqueued_at))::float8 from pgmq.{table}"
                ))
                .persistent(false)
                .fetch_one(&mut *tx)
                .await?;
                (Some(depth), age)
            } else {
                (None, None)
            };
            out.push(QueueInfo {
                queue_name,
                depth,
                oldest_age_seconds,
                live_workers,
                fenced_workers,
            });
        }
        tx.commit().await?;
        Ok(out)
    }

    /// Claims, completions and failures per queue and minute over the last `minutes` minutes (1 to 120), from
    /// the tasks' timestamps. Reads only the tasks of runs that are started or finished within the window
    /// (a task claimed in the window belongs to one of them), through the runs' status and finish-time
    /// indexes, so its cost follows recent work, not the length of the history.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn queue_rates(&self, minutes: u32) -> Result<Vec<QueueRates>, AdminError> {
        let minutes = minutes.clamp(1, 120);
        let sql = "with recent as ( \
               select r.run_id from pgflow.runs r where r.status = 'started' \
               union all \
               select r.run_id from pgflow.runs r where r.status <> 'started' \
                 and coalesce(r.completed_at, r.failed_at, r.cancelled_at) >= $1 \
             ) \
             select t.queue_name, date_trunc('minute', v.at) as minute, \
                    count(*) filter (where v.kind = 1) as claimed, \
                    count(*) filter (where v.kind = 2) as completed, \
                    count(*) filter (where v.kind = 3) as failed \
             from recent join pgflow.step_tasks t on t.run_id = recent.run_id \
             cross join lateral (values (1, t.started_at), (2, t.completed_at), (3, t.failed_at)) v(kind, at) \
             where v.at >= $1 \
             group by 1, 2";
        let now = Utc::now();
        let first = (now - Duration::minutes(i64::from(minutes) - 1))
            .duration_trunc(Duration::minutes(1))
            .unwrap_or(now);
        let mut tx = self.read().await?;
        let rows: Vec<(String, DateTime<Utc>, i64, i64, i64)> = sqlx::query_as(sql)
            .bind(first)
            .persistent(self.persistent())
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        let mut by_queue: BTreeMap<String, BTreeMap<DateTime<Utc>, Counts>> = BTreeMap::new();
        for (queue, minute, claimed, completed, failed) in rows {
            by_queue
                .entry(queue)
                .or_default()
                .insert(minute, (claimed, completed, failed));
        }
        Ok(by_queue
            .into_iter()
            .map(|(queue_name, counts)| QueueRates {
                queue_name,
                minutes: (0..i64::from(minutes))
                    .map(|i| {
                        let minute = first + Duration::minutes(i);
                        let (claimed, completed, failed) =
                            counts.get(&minute).copied().unwrap_or_default();
                        MinuteCounts {
                            minute,
                            claimed,
                            completed,
                            failed,
                        }
                    })
                    .collect(),
            })
            .collect())
    }

    /// Routes with queued tasks and no live, enabled worker that runs them (`pgflow.queue_coverage`).
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn uncovered_routes(&self) -> Result<Vec<UncoveredRoute>, AdminError> {
        let mut tx = self.read().await?;
        let rows = sqlx::query_as(
            "select c.flow_slug, c.step_slug, c.queue_name, c.queued_tasks, c.oldest_queued_at \
             from pgflow.queue_coverage c where c.uncovered order by c.queue_name, c.flow_slug, c.step_index",
        )
        .persistent(self.persistent())
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(rows)
    }

    /// Per queue, what it must carry that its live workers together do not declare
    /// (`pgflow.queue_coverage_gaps`): an active alias's version, started runs that may still create tasks on
    /// it, tasks waiting on it. A queue with a live worker registered the upstream way (serving the whole
    /// queue) has no gap.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn coverage_gaps(&self) -> Result<Vec<CoverageGap>, AdminError> {
        let sql = format!(
            "with live as (select w.worker_id, w.queue_name from pgflow.workers w where {LIVE}), \
             served as ( \
               select q.queue_name, \
                 coalesce(array_agg(wr.flow_slug order by wr.flow_slug, wr.step_slug) \
                          filter (where wr.worker_id is not null), '{{}}') as flows, \
                 coalesce(array_agg(wr.step_slug order by wr.flow_slug, wr.step_slug) \
                          filter (where wr.worker_id is not null), '{{}}') as steps \
               from ({QUEUE_NAMES}) q \
               left join live on live.queue_name = q.queue_name \
               left join pgflow.worker_routes wr on wr.worker_id = live.worker_id \
               where not exists (select 1 from live l where l.queue_name = q.queue_name \
                                 and not exists (select 1 from pgflow.worker_routes r \
                                                 where r.worker_id = l.worker_id)) \
               group by q.queue_name) \
             select s.queue_name, g.flow_slug, g.step_slug, g.reason, g.count, g.examples, g.repair \
             from served s \
             cross join lateral pgflow.queue_coverage_gaps(s.queue_name, s.flows, s.steps) g \
             order by s.queue_name, g.flow_slug, g.step_slug, g.reason"
        );
        let mut tx = self.read().await?;
        let rows = sqlx::query_as(&sql)
            .persistent(self.persistent())
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(rows)
    }

    /// Every tracked worker function with its fence, the disabled ones first.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn worker_functions(&self) -> Result<Vec<WorkerFunction>, AdminError> {
        let mut tx = self.read().await?;
        let rows = sqlx::query_as(
            "select f.function_name, f.enabled, f.disabled_reason, f.disabled_at, f.last_invoked_at \
             from pgflow.worker_functions f order by f.enabled, f.function_name",
        )
        .persistent(self.persistent())
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(rows)
    }

    /// The workers that heartbeat within the last `within` (live ones, and those that stopped or died
    /// recently), live first, newest first; at most 500.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn workers(
        &self,
        within: std::time::Duration,
    ) -> Result<Vec<WorkerInfo>, AdminError> {
        type Row = (
            Uuid,
            String,
            String,
            DateTime<Utc>,
            DateTime<Utc>,
            Option<DateTime<Utc>>,
            bool,
            bool,
            Json<Vec<Route>>,
        );
        let since = Utc::now() - Duration::from_std(within).unwrap_or(Duration::days(1));
        let sql = format!(
            "select w.worker_id, w.function_name, w.queue_name, w.started_at, w.last_heartbeat_at, w.stopped_at, \
             ({LIVE}) as live, coalesce(f.enabled, true) as enabled, \
             coalesce((select jsonb_agg(jsonb_build_object('flow_slug', r.flow_slug, 'step_slug', r.step_slug) \
                                 order by r.flow_slug, r.step_slug) \
                       from pgflow.worker_routes r where r.worker_id = w.worker_id), '[]') as routes \
             from pgflow.workers w left join pgflow.worker_functions f on f.function_name = w.function_name \
             where w.last_heartbeat_at >= $1 \
             order by ({LIVE}) desc, w.started_at desc limit 500"
        );
        let mut tx = self.read().await?;
        let rows: Vec<Row> = sqlx::query_as(&sql)
            .bind(since)
            .persistent(self.persistent())
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(rows
            .into_iter()
            .map(|r| WorkerInfo {
                worker_id: r.0,
                function_name: r.1,
                queue_name: r.2,
                started_at: r.3,
                last_heartbeat_at: r.4,
                stopped_at: r.5,
                live: r.6,
                enabled: r.7,
                routes: r.8 .0,
            })
            .collect())
    }
}
