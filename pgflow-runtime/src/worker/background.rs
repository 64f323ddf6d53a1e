//! Background duties: heartbeats (deprecation and the fence), and stalled-task recovery.

use std::sync::Mutex;
use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::StopReason;
use crate::statements as sql;

/// Beats every `interval` until `done` fires; on deprecation or a disabled function, records why and
/// fires `stop` (claiming stops, in-flight work drains).
pub(crate) async fn heartbeat(
    pool: PgPool,
    worker_id: Uuid,
    interval: Duration,
    stop: CancellationToken,
    reason: &Mutex<Option<StopReason>>,
    done: CancellationToken,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = done.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let beat: Result<Option<(bool, bool)>, sqlx::Error> = sqlx::query_as(sql::HEARTBEAT)
            .bind(worker_id)
            .fetch_optional(&pool)
            .await;
        let why = match beat {
            Ok(Some((true, _))) => StopReason::Deprecated,
            Ok(Some((false, false))) => StopReason::Disabled,
            Ok(Some(_)) => continue,
            Ok(None) => {
                tracing::warn!(%worker_id, "heartbeat found no `pgflow.workers` row for this worker");
                continue;
            }
            Err(e) => {
                tracing::warn!(%worker_id, error = %e, "heartbeat failed");
                continue;
            }
        };
        if !stop.is_cancelled() {
            match why {
                StopReason::Deprecated => {
                    tracing::info!(%worker_id, "worker deprecated: no more claims, draining")
                }
                _ => {
                    tracing::warn!(%worker_id, "worker function disabled: no more claims, draining")
                }
            }
            reason.lock().expect("stop reason lock").get_or_insert(why);
            stop.cancel();
        }
    }
}

/// Runs `requeue_stalled_tasks` every `interval` (first at startup), skipped while another worker holds
/// the recovery lock.
pub(crate) async fn recover_stalled(pool: PgPool, interval: Duration, done: CancellationToken) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = done.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let result: Result<Option<i32>, sqlx::Error> =
            sqlx::query_scalar(sql::REQUEUE_STALLED_TASKS)
                .bind(sql::REQUEUE_LOCK_KEY)
                .fetch_one(&pool)
                .await;
        match result {
            Ok(Some(n)) if n > 0 => tracing::warn!(requeued = n, "requeued stalled tasks"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "stalled-task recovery failed"),
        }
    }
}
