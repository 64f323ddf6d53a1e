//! Compiled versions, aliases, and whether a version can leave a queue's workers.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::types::Json;

use super::{Admin, AdminError};
use crate::decode::QueueMode;
use crate::worker::GapReason;

/// A compiled flow version (`pgflow.flows`).
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
#[non_exhaustive]
pub struct FlowInfo {
    /// Its slug.
    pub flow_slug: String,
    /// How it routes its steps to queues.
    pub queue_mode: QueueMode,
    /// When it was compiled.
    pub created_at: DateTime<Utc>,
    /// Its steps.
    pub steps: i64,
    /// The aliases pointing at it.
    pub aliases: Vec<String>,
}

/// An alias and the versions behind it.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct AliasInfo {
    /// The alias.
    pub alias: String,
    /// The version it points at.
    pub flow_slug: String,
    /// The version it pointed at before its last activation.
    pub previous_flow_slug: Option<String>,
    /// When it was last activated.
    pub activated_at: DateTime<Utc>,
    /// The current version, then the previous one (when it still exists and differs).
    pub versions: Vec<VersionInfo>,
}

/// A version behind an alias and whether it can be retired.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct VersionInfo {
    /// The flow slug.
    pub flow_slug: String,
    /// Whether the alias points at it now.
    pub active: bool,
    /// Per queue it routes to: `pgflow.version_retirable`.
    pub queues: Vec<VersionQueue>,
}

impl VersionInfo {
    /// Whether its workers can stop serving it on every queue.
    pub fn retirable(&self) -> bool {
        self.queues.iter().all(|q| q.retirable)
    }
}

/// Whether a version can leave one queue's workers (`pgflow.version_retirable`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct VersionQueue {
    /// The queue.
    pub queue_name: String,
    /// Whether nothing of the version needs the queue any more.
    pub retirable: bool,
    /// What still needs it (empty when retirable).
    pub blockers: Vec<Blocker>,
}

/// One step of a version that still needs a queue, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Blocker {
    /// The step.
    pub step_slug: String,
    /// Why the queue still needs it.
    pub reason: GapReason,
    /// How many aliases, runs or tasks need it.
    pub count: i64,
    /// Up to three of them: alias names, run ids, or `{"run_id", "msg_id"}` of tasks.
    pub examples: Vec<Value>,
}

impl std::fmt::Display for Blocker {
    /// `step: reason (count)`, as the CLI and dashboard show it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {} ({})", self.step_slug, self.reason, self.count)
    }
}

impl Admin {
    /// Every compiled flow version, by slug, with its aliases.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn flows(&self) -> Result<Vec<FlowInfo>, AdminError> {
        let mut tx = self.read().await?;
        let rows = sqlx::query_as(
            "select f.flow_slug, f.queue_mode, f.created_at, \
             (select count(*) from pgflow.steps s where s.flow_slug = f.flow_slug) as steps, \
             array(select a.alias from pgflow.flow_aliases a where a.flow_slug = f.flow_slug order by a.alias) \
               as aliases \
             from pgflow.flows f order by f.flow_slug",
        )
        .persistent(self.persistent())
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(rows)
    }

    /// Whether version `flow_slug` can leave the workers of `queue_name`, or of every queue its steps route
    /// to when `None` (`pgflow.version_retirable`, one answer per queue, in queue-name order).
    ///
    /// # Errors
    ///
    /// A database error; an unknown slug is the SQL function's error (`PF019`), which lists the known ones.
    pub async fn version_retirable(
        &self,
        flow_slug: &str,
        queue_name: Option<&str>,
    ) -> Result<Vec<VersionQueue>, AdminError> {
        let mut tx = self.read().await?;
        // A slug without steps gets one answer, for the queue its default routing would use: the function
        // then raises its own error for an unknown slug.
        let rows: Vec<Json<VersionQueue>> = sqlx::query_scalar(
            "select pgflow.version_retirable($1, q.queue_name) \
             from (select $2::text as queue_name where $2 is not null \
                   union \
                   select s.queue_name from pgflow.steps s where $2 is null and s.flow_slug = $1 \
                   union \
                   select lower($1) where $2 is null \
                     and not exists (select 1 from pgflow.steps s where s.flow_slug = $1)) q \
             order by q.queue_name",
        )
        .bind(flow_slug)
        .bind(queue_name)
        .persistent(self.persistent())
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(rows.into_iter().map(|Json(v)| v).collect())
    }

    /// Every alias with its current and previous version, and per version and queue whether it is retirable
    /// (`pgflow.version_retirable`).
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn aliases(&self) -> Result<Vec<AliasInfo>, AdminError> {
        type AliasRow = (String, String, Option<String>, DateTime<Utc>);
        type VersionRow = (String, String, bool, Json<VersionQueue>);
        let mut tx = self.read().await?;
        let aliases: Vec<AliasRow> = sqlx::query_as(
            "select a.alias, a.flow_slug, a.previous_flow_slug, a.activated_at from pgflow.flow_aliases a \
             order by a.alias",
        )
        .persistent(self.persistent())
        .fetch_all(&mut *tx)
        .await?;
        let versions: Vec<VersionRow> = sqlx::query_as(
            "select v.alias, v.flow_slug, v.active, pgflow.version_retirable(v.flow_slug, q.queue_name) \
             from (select a.alias, a.flow_slug, true as active from pgflow.flow_aliases a \
                   union all \
                   select a.alias, a.previous_flow_slug, false from pgflow.flow_aliases a \
                   where a.previous_flow_slug is distinct from a.flow_slug and a.previous_flow_slug is not null) v \
             cross join lateral (select distinct s.queue_name from pgflow.steps s \
                                 where s.flow_slug = v.flow_slug) q \
             order by v.alias, v.active desc, q.queue_name",
        )
        .persistent(self.persistent())
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(aliases
            .into_iter()
            .map(|(alias, flow_slug, previous_flow_slug, activated_at)| {
                let mut out: Vec<VersionInfo> = Vec::new();
                for (_, slug, active, Json(queue)) in versions.iter().filter(|v| v.0 == alias) {
                    if out.last().is_none_or(|v| v.flow_slug != *slug) {
                        out.push(VersionInfo {
                            flow_slug: slug.clone(),
                            active: *active,
                            queues: Vec::new(),
                        });
                    }
                    out.last_mut()
                        .expect("pushed above")
                        .queues
                        .push(queue.clone());
                }
                AliasInfo {
                    alias,
                    flow_slug,
                    previous_flow_slug,
                    activated_at,
                    versions: out,
                }
            })
            .collect())
    }
}
