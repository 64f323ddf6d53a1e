//! One exchange's round trip, and what the driver does with its outcome: record the outputs, take the claimed
//! tasks, or keep the outputs and back off when the call failed.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use sqlx::PgPool;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

use super::{DriverLoop, Fatal, Held, ACTIVE_FOR, MAX_SPARE};
use crate::worker::background::OwnBackends;
use crate::worker::claim::{ClaimError, ClaimOutcome, Claimed, Claimer, Exchanged};
use crate::worker::record::RECORD_PATIENCE;
use crate::worker::result::TaskResult;
use crate::worker::retry::{jitter, transient};
use crate::worker::StopReason;

/// One finished exchange.
pub(super) struct Cycle {
    /// The connection, unless the call failed (then it is dropped, in case it is broken).
    conn: Option<Held>,
    outputs: Vec<TaskResult>,
    /// One unrecorded-result permit per task asked for.
    rooms: Vec<OwnedSemaphorePermit>,
    result: Result<Exchanged, ClaimError>,
    /// How long the call took (the claim round trip).
    took: Duration,
    /// The driver's count of queue signals when the exchange started.
    wakes: u64,
}

impl DriverLoop {
    /// An exchange ended.
    pub(super) fn on_exchanged(&mut self, cycle: Cycle) {
        let metrics = &self.d.recorder.metrics;
        if let Ok(exchanged) = &cycle.result {
            metrics.claim.record(cycle.took.as_secs_f64());
            metrics.batch_outputs.record(cycle.outputs.len() as f64);
            if let ClaimOutcome::Claimed(tasks) = &exchanged.claim {
                metrics.batch_claimed.record(tasks.len() as f64);
            }
        }
        self.claiming -= cycle.rooms.len();
        self.recording.ended(&cycle.outputs);
        if let Some(mut held) = cycle.conn {
            if self.spare.len() < MAX_SPARE {
                if let Ok(Exchanged {
                    backend_pid: Some(pid),
                    ..
                }) = &cycle.result
                {
                    held.named(*pid);
                }
                self.spare.push((held, Instant::now()));
            }
        }
        match cycle.result {
            Ok(exchanged) => {
                self.on_exchange_ok(exchanged, cycle.outputs, cycle.rooms, cycle.wakes)
            }
            Err(ClaimError::Decode(e)) => {
                // The transaction committed; its rows cannot be read. The outputs are recorded or stale;
                // claimed tasks are recovered by their visibility and timeout.
                tracing::error!(error = %e, "cannot decode the exchange result");
                self.d.recorder.done(cycle.outputs);
                self.hold_until = Some(Instant::now() + self.errors.next_delay());
            }
            Err(ClaimError::Database(e)) => self.on_exchange_failed(e, cycle.outputs),
        }
        let unrecorded = self.d.config.max_unrecorded - self.rooms.available_permits();
        self.d.recorder.metrics.unrecorded.set(unrecorded as f64);
    }

    fn on_exchange_ok(
        &mut self,
        exchanged: Exchanged,
        outputs: Vec<TaskResult>,
        rooms: Vec<OwnedSemaphorePermit>,
        wakes: u64,
    ) {
        self.errors.reset();
        self.hold_until = None;
        let recorder = &self.d.recorder;
        recorder.recorded(exchanged.completions, &outputs);
        recorder.done(outputs);
        if exchanged.deferred > 0 {
            recorder.metrics.deferred.increment(exchanged.deferred);
            recorder
                .stats
                .deferred
                .fetch_add(exchanged.deferred, Ordering::Relaxed);
            tracing::debug!(
                deferred = exchanged.deferred,
                "read messages whose task is running elsewhere; left to that attempt"
            );
        }
        match exchanged.claim {
            ClaimOutcome::Claimed(tasks) => self.on_claimed(tasks, rooms, wakes),
            ClaimOutcome::Unsupported(unsupported) => {
                recorder.metrics.unsupported.increment(1);
                self.fatal.get_or_insert(Fatal(unsupported));
                self.d.stop.cancel();
            }
            ClaimOutcome::Disabled(disabled) => {
                tracing::warn!(worker_id = %self.d.claimer.worker_id, reason = ?disabled.reason,
                    "worker function disabled: no more claims, draining");
                self.d
                    .reason
                    .lock()
                    .expect("stop reason lock")
                    .get_or_insert(StopReason::Disabled);
                self.d.stop.cancel();
            }
        }
    }

    /// Claimed tasks wait for slots; a claim short of what it asked for sets the poll timer. An empty claim
    /// during which a queue signal came (`wakes`: the signals taken when it started) is followed by another
    /// claim at once instead: the signal's tasks may have been committed after the claim read the queue, and
    /// an idle driver's timer can be `max_poll_wait` away. After a claim that found tasks the timer is at
    /// most `poll_interval` away, and the found tasks' outputs carry a claim sooner, so a signal that came
    /// meanwhile waits for those rather than costing a round trip of its own under load.
    fn on_claimed(&mut self, tasks: Vec<Claimed>, rooms: Vec<OwnedSemaphorePermit>, wakes: u64) {
        let asked = rooms.len();
        if asked > 0 {
            // Short of what it asked for: look again on a signal, a result or the poll timer, which backs
            // off only once claims have found nothing for a while (signals are throttled, so a busy queue can
            // have work that no signal announced).
            let now = Instant::now();
            if !tasks.is_empty() {
                self.last_found = now;
            }
            if now.duration_since(self.last_found) < ACTIVE_FOR {
                self.idle.reset();
            }
            self.last_claim_full = tasks.len() == asked;
            self.want_claim = self.last_claim_full || (tasks.is_empty() && self.wakes != wakes);
            self.poll_at = (!self.want_claim).then(|| now + jitter(self.idle.next_delay()));
        }
        let mut permits = rooms.into_iter();
        let metrics = &self.d.recorder.metrics;
        for task in &tasks {
            metrics.on(&task.flow_slug, &task.step_slug, |m| m.claimed.increment(1));
        }
        for task in tasks {
            let room = permits.next().expect("never more tasks than asked for");
            if self.stopping.is_none() {
                self.ready.push_back((task, room));
            }
        }
    }

    /// The exchange failed: its outputs are kept and retried with backoff (or, refused as a whole,
    /// recorded one by one).
    fn on_exchange_failed(&mut self, e: sqlx::Error, outputs: Vec<TaskResult>) {
        let wait = self.errors.next_delay();
        self.hold_until = Some(Instant::now() + wait);
        if !outputs.is_empty() && !transient(&e) {
            // Refused as a whole (an output it cannot store): one by one.
            let recorder = Arc::clone(&self.d.recorder);
            self.side
                .spawn(async move { recorder.complete(outputs).await });
            self.hold_until = None;
            return;
        }
        tracing::warn!(queue = %self.d.claimer.queue, error = %e,
            retry_in_ms = wait.as_millis() as u64, outputs = outputs.len(),
            "exchange failed; backing off");
        let now = Instant::now();
        let (expired, kept): (Vec<_>, Vec<_>) = outputs
            .into_iter()
            .map(|mut o| {
                o.first_error.get_or_insert(now);
                o
            })
            .partition(|o| {
                o.first_error
                    .is_some_and(|t| now.duration_since(t) >= RECORD_PATIENCE)
            });
        if !expired.is_empty() {
            self.d.recorder.give_up(expired, &e);
        }
        self.outputs.splice(0..0, kept);
    }
}

/// One exchange on `conn` (or a connection from the pool).
pub(super) fn exchange(
    pool: PgPool,
    own: OwnBackends,
    claimer: Arc<Claimer>,
    conn: Option<Held>,
    outputs: Vec<TaskResult>,
    rooms: Vec<OwnedSemaphorePermit>,
    wakes: u64,
) -> BoxFuture<'static, Cycle> {
    async move {
        let mut conn = match conn {
            Some(conn) => conn,
            None => match pool.acquire().await {
                Ok(conn) => Held::new(conn, own),
                Err(e) => {
                    return Cycle {
                        conn: None,
                        outputs,
                        rooms,
                        result: Err(ClaimError::Database(e)),
                        took: Duration::ZERO,
                        wakes,
                    }
                }
            },
        };
        let started = Instant::now();
        let result = claimer
            .exchange(&mut conn.conn, &outputs, rooms.len())
            .await;
        Cycle {
            conn: result.is_ok().then_some(conn),
            outputs,
            rooms,
            result,
            took: started.elapsed(),
            wakes,
        }
    }
    .boxed()
}
