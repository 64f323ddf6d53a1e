//! Running handlers learn that their task is no longer current: its run was cancelled (`pgflow.cancel_run`),
//! or failed through another task (upstream #646), or the task ended some other way. A background loop asks
//! `pgflow.cancelled_tasks` about every task in flight twice a second; the handler of a task that is no longer
//! current has its `ctx.cancellation()` fired, gets a moment to stop, and is then dropped with its result (the
//! database would refuse it as stale anyway), which frees its slot.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::pooling::run;
use crate::statements;

/// How often the tasks in flight are checked.
pub(crate) const CHECK_EVERY: Duration = Duration::from_millis(500);

/// A task in flight: run, step, task index.
type Key = (Uuid, String, i32);

/// A row of `pgflow.cancelled_tasks`: run, step, task index, attempt, run status, reason.
type Stale = (Uuid, String, i32, i32, Option<String>, Option<String>);

/// The tasks in flight, each with its attempt and the token fired when it is no longer current.
#[derive(Clone, Default)]
pub(crate) struct Revocations(Arc<Mutex<HashMap<Key, (i32, CancellationToken)>>>);

/// A tracked task: its token fires when the task is no longer current; dropping it stops the tracking.
pub(crate) struct Tracked {
    revocations: Revocations,
    key: Key,
    pub(crate) revoked: CancellationToken,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.revocations
            .0
            .lock()
            .expect("revocations lock")
            .remove(&self.key);
    }
}

impl Revocations {
    /// Tracks a task until the returned guard is dropped.
    pub(crate) fn track(
        &self,
        run_id: Uuid,
        step_slug: &str,
        task_index: i32,
        attempt: i32,
    ) -> Tracked {
        let key = (run_id, step_slug.to_owned(), task_index);
        let revoked = CancellationToken::new();
        self.0
            .lock()
            .expect("revocations lock")
            .insert(key.clone(), (attempt, revoked.clone()));
        Tracked {
            revocations: self.clone(),
            key,
            revoked,
        }
    }

    /// Checks every task in flight once; fires the tokens of those no longer current.
    pub(crate) async fn check(&self, pool: &PgPool, pooled: bool) -> Result<usize, sqlx::Error> {
        let (mut runs, mut steps, mut indexes, mut attempts) = (vec![], vec![], vec![], vec![]);
        {
            let map = self.0.lock().expect("revocations lock");
            for ((run_id, step, index), (attempt, _)) in map.iter() {
                runs.push(*run_id);
                steps.push(step.clone());
                indexes.push(*index);
                attempts.push(*attempt);
            }
        }
        if runs.is_empty() {
            return Ok(0);
        }
        let query = sqlx::query_as(statements::CANCELLED_TASKS)
            .bind(&runs)
            .bind(&steps)
            .bind(&indexes)
            .bind(&attempts);
        let rows: Vec<Stale> = run!(pooled, pool, query, fetch_all).await?;
        let map = self.0.lock().expect("revocations lock");
        let mut fired = 0;
        for (run_id, step, index, attempt, run_status, reason) in rows {
            if let Some((current, token)) = map.get(&(run_id, step.clone(), index)) {
                if *current == attempt && !token.is_cancelled() {
                    tracing::info!(%run_id, step = %step, task_index = index, attempt,
                        run_status = run_status.as_deref().unwrap_or("removed"),
                        reason = reason.as_deref().unwrap_or(""),
                        "task no longer current; cancelling its handler");
                    token.cancel();
                    fired += 1;
                }
            }
        }
        Ok(fired)
    }
}

/// Checks the tasks in flight every [`CHECK_EVERY`] until `done` fires.
pub(crate) async fn watch(
    pool: PgPool,
    pooled: bool,
    revocations: Revocations,
    done: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = done.cancelled() => return,
            _ = tokio::time::sleep(CHECK_EVERY) => {}
        }
        if let Err(e) = revocations.check(&pool, pooled).await {
            tracing::debug!(error = %e, "cannot check the tasks in flight for cancellation");
        }
    }
}
