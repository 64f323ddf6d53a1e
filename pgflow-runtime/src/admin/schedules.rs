//! Schedules as the operator sees them: when each fires next, how its last fire went.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{Admin, AdminError};
use crate::client::RunStatus;
use crate::schedules::{Missed, Overlap, MISSED_COLUMN};

/// A schedule (`pgflow.schedules`) with the status of the run its last fire started.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
#[non_exhaustive]
pub struct ScheduleInfo {
    /// Its name.
    pub schedule_name: String,
    /// The flow (slug or alias) it starts.
    pub flow_slug: String,
    /// Its cron expression.
    pub cron: String,
    /// The time zone of the expression.
    pub time_zone: String,
    /// Whether it is paused.
    pub paused: bool,
    /// When it fires next (`None` until a worker computes it, e.g. just after a resume).
    pub next_fire_at: Option<DateTime<Utc>>,
    /// When it last fired.
    pub last_fire_at: Option<DateTime<Utc>>,
    /// The run its last fire started.
    pub last_run_id: Option<Uuid>,
    /// That run's status (`None` when it started none, or retention removed it).
    pub last_run_status: Option<RunStatus>,
    /// Why a worker paused it, if one did.
    pub last_error: Option<String>,
    /// What happens to fires missed while no worker ticked.
    #[sqlx(json)]
    pub missed: Missed,
    /// What a fire does while the previous run is still going.
    pub overlap: Overlap,
}

impl Admin {
    /// Every schedule by name, with the status of its last run.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn schedules(&self) -> Result<Vec<ScheduleInfo>, AdminError> {
        let mut tx = self.read().await?;
        let sql = format!(
            "select s.schedule_name, s.flow_slug, s.cron, s.time_zone, s.paused, s.next_fire_at, \
             s.last_fire_at, s.last_run_id, r.status as last_run_status, s.last_error, \
             {MISSED_COLUMN} as missed, s.overlap \
             from pgflow.schedules s left join pgflow.runs r on r.run_id = s.last_run_id \
             order by s.schedule_name"
        );
        let rows = sqlx::query_as(&sql)
            .persistent(self.persistent())
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(rows)
    }
}
