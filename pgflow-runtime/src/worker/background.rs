//! Background duties: heartbeats (deprecation, the fence, revival after being declared dead), queue
//! signals (idle workers wake when work arrives), and maintenance (stalled and dead-worker recovery,
//! retention).

use crate::pooling::run;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::types::PgInterval;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use sqlx::types::Json;
use sqlx::PgPool;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::answers::{Heartbeat, MaintenanceReport};
use super::retry::Backoff;
use super::StopReason;
use crate::statements;

/// What the heartbeat needs besides the stop signals.
pub(crate) struct Beat {
    pub(crate) pool: PgPool,
    pub(crate) pooled: bool,
    pub(crate) worker_id: Uuid,
    pub(crate) interval: Duration,
    /// Where each answer's count of live workers on the queue goes.
    pub(crate) peers: Peers,
}

/// Beats every `interval` until `done` fires, keeping `peers` current; on deprecation or a disabled
/// function, records why and fires `stop` (claiming stops, in-flight work drains).
pub(crate) async fn heartbeat(
    beat: Beat,
    stop: CancellationToken,
    reason: &Mutex<Option<StopReason>>,
    done: CancellationToken,
) {
    let Beat {
        pool,
        pooled,
        worker_id,
        interval,
        peers,
    } = beat;
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = done.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let beat: Result<Option<Json<Heartbeat>>, sqlx::Error> = run!(
            pooled,
            &pool,
            sqlx::query_scalar(statements::HEARTBEAT).bind(worker_id),
            fetch_one
        )
        .await;
        let state = match beat {
            Ok(Some(Json(state))) => state,
            Ok(None) => {
                tracing::warn!(%worker_id, "heartbeat found no `pgflow.workers` row for this worker");
                continue;
            }
            Err(e) => {
                tracing::warn!(%worker_id, error = %e, "heartbeat failed");
                continue;
            }
        };
        peers.set(state.peers);
        if state.revived {
            tracing::warn!(%worker_id, "this worker was declared dead (its heartbeat went missing) and registered again; \
                the tasks it had started were recovered, and their late results will be ignored as stale");
        }
        let why = if state.deprecated {
            StopReason::Deprecated
        } else if !state.enabled {
            StopReason::Disabled
        } else {
            continue;
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

/// How many live workers share this worker's queue, as its last heartbeat learned (1 until then).
///
/// Each exchange in flight is a transaction that holds the messages it claims and the run rows it
/// records, and every claim on the queue reads past the messages other claims hold. A few exchanges at
/// once keep the server's cores busy; many workers each running their full `completion_flushers` would
/// multiply them, and the claims would spend the cores reading past each other's messages instead. So the
/// queue's workers share the setting out: each runs at most `completion_flushers / peers` (rounded up,
/// at least one).
#[derive(Clone, Debug)]
pub(crate) struct Peers(Arc<AtomicUsize>);

impl Default for Peers {
    fn default() -> Self {
        Peers(Arc::new(AtomicUsize::new(1)))
    }
}

impl Peers {
    pub(crate) fn set(&self, live: usize) {
        self.0.store(live, Ordering::Relaxed);
    }

    /// This worker's share of `flushers` exchanges in flight.
    pub(crate) fn share(&self, flushers: usize) -> usize {
        flushers
            .div_ceil(self.0.load(Ordering::Relaxed).max(1))
            .max(1)
    }
}

/// The channel on which new tasks signal their queue (payload: the queue name; see
/// `pgflow._signal_queues` in `pgflow-sql/schema/03_events.sql`).
const QUEUE_SIGNAL: &str = "pgflow_queue_signal";

/// The server processes behind the connections the worker's driver holds (in an exchange, or kept for the
/// next one). A signal sent by one of them is the worker's own exchange's: about tasks that exchange has just
/// claimed (or left for later claims it makes anyway), so waking for it would only spend a round trip on an
/// empty claim. Other workers of the queue still wake for it. A connection handed back to the pool is
/// forgotten at once: another client of the pool (a client starting runs, say) may send from it next.
///
/// Behind a transaction pooler a server process serves every client in turn, so nothing is remembered there
/// and every signal wakes the worker.
#[derive(Clone)]
pub(crate) struct OwnBackends(Option<Arc<Mutex<Vec<u32>>>>);

impl OwnBackends {
    /// Remembers the driver's server processes, unless `pooled` (behind a transaction pooler).
    pub(crate) fn new(pooled: bool) -> Self {
        Self((!pooled).then(Arc::default))
    }

    /// The driver holds a connection to server process `pid`.
    pub(crate) fn hold(&self, pid: u32) {
        if let Some(pids) = &self.0 {
            pids.lock().expect("backend list lock").push(pid);
        }
    }

    /// The driver let go of its connection to `pid`.
    pub(crate) fn release(&self, pid: u32) {
        if let Some(pids) = &self.0 {
            let mut pids = pids.lock().expect("backend list lock");
            if let Some(i) = pids.iter().position(|p| *p == pid) {
                pids.swap_remove(i);
            }
        }
    }

    /// Whether the driver holds a connection to `pid`.
    pub(crate) fn contains(&self, pid: u32) -> bool {
        self.0
            .as_ref()
            .is_some_and(|pids| pids.lock().expect("backend list lock").contains(&pid))
    }
}

/// Listens for signals of `queue` and fires `wake` on each (except those of `own` exchanges), until `done`. It listens on a connection of its
/// own, opened with `options` (the pool's, or the direct connection given behind a transaction pooler) but outside the pool, so that it never takes a connection the worker's
/// exchanges or its handlers need. After a lost connection it listens again and fires `wake` once (a
/// signal may have been missed); the driver's poll timer covers the gap.
pub(crate) async fn listen(
    options: PgConnectOptions,
    queue: String,
    wake: std::sync::Arc<Notify>,
    own: OwnBackends,
    done: CancellationToken,
) {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_lazy_with(options);
    let mut retry = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
    loop {
        let mut listener = match subscribe(&pool).await {
            Ok(listener) => listener,
            Err(e) => {
                tracing::debug!(error = %e, "cannot listen for queue signals; polling meanwhile");
                if sleep_or_done(retry.next_delay(), &done).await {
                    return;
                }
                continue;
            }
        };
        retry.reset();
        wake.notify_one();
        loop {
            let received = tokio::select! {
                _ = done.cancelled() => return,
                r = listener.try_recv() => r,
            };
            match received {
                Ok(Some(n)) if n.payload() == queue && !own.contains(n.process_id()) => {
                    wake.notify_one()
                }
                Ok(Some(_)) => {}
                // The connection was lost and sqlx listens again on a new one.
                Ok(None) => wake.notify_one(),
                Err(e) => {
                    tracing::debug!(error = %e, "queue signal listener failed; listening again");
                    break;
                }
            }
        }
    }
}

/// A listener on the queue signal channel.
async fn subscribe(pool: &PgPool) -> Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(QUEUE_SIGNAL).await?;
    Ok(listener)
}

/// Sleeps `d`; `true` when `done` fired first.
async fn sleep_or_done(d: Duration, done: &CancellationToken) -> bool {
    tokio::select! {
        _ = done.cancelled() => true,
        _ = tokio::time::sleep(d) => false,
    }
}

/// What a maintenance sweep is asked to do.
pub(crate) struct Maintenance {
    pub(crate) interval: Duration,
    pub(crate) dead_after: Option<Duration>,
    pub(crate) retention: Option<Duration>,
    pub(crate) retention_batch: usize,
    /// Behind a transaction pooler (see [`Pooling`](crate::pooling::Pooling)).
    pub(crate) pooled: bool,
}

fn interval(d: Duration) -> PgInterval {
    PgInterval {
        months: 0,
        days: 0,
        microseconds: i64::try_from(d.as_micros()).unwrap_or(i64::MAX),
    }
}

/// Runs `pgflow.run_maintenance` every `interval` (first at startup); the SQL lets one caller at a time work.
///
/// Retention keeps up with any finish rate: while a sweep's retention batch comes back full, the next batch
/// follows at once (each call its own short transaction), until one is not full or the interval has passed.
pub(crate) async fn maintain(pool: PgPool, m: Maintenance, done: CancellationToken) {
    let mut ticker = tokio::time::interval(m.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let batch = i32::try_from(m.retention_batch).unwrap_or(i32::MAX);
    loop {
        tokio::select! {
            _ = done.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let started = std::time::Instant::now();
        while sweep(&pool, &m, batch).await
            && started.elapsed() < m.interval
            && !done.is_cancelled()
        {}
    }
}

/// One `pgflow.run_maintenance` call; returns whether its retention batch was full (more history is due).
async fn sweep(pool: &PgPool, m: &Maintenance, batch: i32) -> bool {
    let result: Result<Json<MaintenanceReport>, sqlx::Error> = run!(
        m.pooled,
        pool,
        sqlx::query_scalar(statements::RUN_MAINTENANCE)
            .bind(m.dead_after.map(interval))
            .bind(m.retention.map(interval))
            .bind(batch),
        fetch_one
    )
    .await;
    match result {
        Ok(Json(r)) => {
            if r.stalled > 0 {
                tracing::warn!(requeued = r.stalled, "requeued stalled tasks");
            }
            if r.dead > 0 {
                tracing::warn!(
                    recovered = r.dead,
                    "recovered the tasks of workers whose heartbeat stopped"
                );
            }
            let pruned = r.pruned.map_or(0, |p| {
                if p.runs > 0 {
                    tracing::debug!(
                        runs = p.runs,
                        archived_messages = p.archived_messages,
                        workers = p.workers,
                        "retention pruned finished history"
                    );
                }
                p.runs
            });
            pruned >= i64::from(batch)
        }
        Err(e) => {
            tracing::warn!(error = %e, "maintenance failed");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio_util::sync::CancellationToken;

    use super::{sleep_or_done, OwnBackends, Peers};

    /// The listener's retry sleep ends early at shutdown and says so, so that a worker whose listen
    /// connection cannot be opened still stops at once.
    #[tokio::test(start_paused = true)]
    async fn the_retry_sleep_tells_whether_shutdown_came_first() {
        let done = CancellationToken::new();
        assert!(!sleep_or_done(Duration::from_millis(10), &done).await);
        let cancel = done.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            cancel.cancel();
        });
        assert!(sleep_or_done(Duration::from_secs(3600), &done).await);
    }

    #[test]
    fn workers_of_one_queue_share_the_exchanges_in_flight() {
        let peers = Peers::default();
        assert_eq!(peers.share(3), 3, "alone until a heartbeat says otherwise");
        for (live, share) in [(1, 3), (2, 2), (3, 1), (4, 1), (16, 1), (0, 3)] {
            peers.set(live);
            assert_eq!(peers.share(3), share, "{live} live workers");
        }
        peers.set(2);
        assert_eq!(peers.share(8), 4);
        assert_eq!(peers.share(1), 1);
    }

    #[test]
    fn own_backends_are_those_held_until_released() {
        let own = OwnBackends::new(false);
        own.hold(1);
        own.hold(2);
        assert!(own.contains(1) && own.contains(2) && !own.contains(3));
        own.release(1);
        assert!(!own.contains(1) && own.contains(2));
    }

    #[test]
    fn behind_a_transaction_pooler_no_backend_is_the_workers_own() {
        let own = OwnBackends::new(true);
        own.hold(1);
        assert!(!own.contains(1));
    }
}
