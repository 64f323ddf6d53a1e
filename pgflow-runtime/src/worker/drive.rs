//! The worker's driver: one loop that claims tasks, starts their handlers and records their outputs.
//!
//! Its unit of work is one `pgflow.exchange` call, one round trip and one transaction that records the
//! outputs finished so far and claims the next tasks. A completion that makes dependent tasks ready puts
//! their messages on the queue inside that transaction, so the same call can claim them: a worker with a
//! free slot goes from a step to its dependent without a poll. The messages are ordinary queue messages:
//! any worker of the queue may claim them first.
//!
//! - **Claim-ahead.** A claim asks for the free handler slots plus the tasks the slots are expected to get
//!   through in the next [`WorkerConfig::prefetch`] (from a moving average of handler run times), at most
//!   `batch_size` (or the free slots, when more are free). With fast handlers a worker of one slot then
//!   records and claims several tasks per round trip; with slow ones it claims only what it can start.
//!   Tasks claimed ahead wait locally, each holding an unrecorded-result permit, and start as slots free.
//!   One exchange is in flight at a time, and results that finish meanwhile gather into the next one;
//!   only with a backlog (`batch_size` outputs waiting, or a full claim after the last claim came back
//!   full) does another start beside it, up to `completion_flushers`. Before an exchange records the
//!   outputs already in, it waits a moment for fast handlers still running (twice their average run
//!   time, at most 1 ms), so that siblings started together share one exchange. An exchange that starts
//!   beside others leaves out the outputs of runs they are recording: recording an output locks its run's
//!   row, so such an exchange would wait for theirs to commit, its claim with it; those outputs go in the
//!   next exchange instead (see [`Recording`]).
//! - **Idle.** After a claim finds fewer tasks than it asked for, the driver waits for a queue signal
//!   (`LISTEN pgflow_queue_signal`, see `background::listen`), for a result, or for the poll timer:
//!   `poll_interval` while claims found tasks within the last [`ACTIVE_FOR`] (signals are throttled per
//!   queue, so a busy queue can hold tasks no signal announced), then doubling to `max_poll_wait`; with
//!   jitter, so that idle workers do not poll in lockstep.
//! - **Connections.** The driver keeps the connection of its last exchange for a moment ([`SPARE_FOR`])
//!   and reuses it, so a busy worker does not pay the pool's checkout round trips per exchange; an idle
//!   one hands it back to the pool.
//! - **Failures** are recorded one by one with `pgflow.fail_task`, beside the loop; a batch of outputs
//!   the database refuses as a whole is recorded one by one (see `record.rs`).
//! - **Database errors** keep the outputs and retry them with backoff, for at most `RECORD_PATIENCE`
//!   each; after that recovery runs their tasks again.
//! - **Stopping.** Claims stop, tasks claimed ahead are dropped (`release_worker_tasks` hands them back),
//!   handlers get `shutdown_grace`, then are cancelled and get `cancel_grace`; outputs keep being
//!   recorded until then.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres};
use tokio::sync::{mpsc, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::claim::{ClaimError, ClaimOutcome, Claimed, Claimer, Exchanged, Unsupported};
use super::execute::{self, Shared};
use super::record::{describe, Recorder, RECORD_PATIENCE};
use super::result::TaskResult;
use super::retry::{jitter, transient, Backoff};
use super::StopReason;
use crate::config::WorkerConfig;

/// How long the driver keeps an unused connection before handing it back to the pool.
const SPARE_FOR: Duration = Duration::from_millis(100);

/// How long after its last claimed task the driver keeps polling at `poll_interval` before it backs off.
const ACTIVE_FOR: Duration = Duration::from_secs(1);

/// How many unused connections the driver keeps (a pool may be shared by several workers).
const MAX_SPARE: usize = 1;

/// Longest wait for the results of handlers still running before an exchange records the ones already in
/// (see `gather_for`).
const GATHER_MAX: Duration = Duration::from_millis(1);

/// What stopped the driver with an error to report.
pub(crate) struct Fatal(pub(crate) Unsupported);

/// Everything the driver works with.
pub(crate) struct Driver {
    pub(crate) pool: PgPool,
    pub(crate) claimer: Arc<Claimer>,
    pub(crate) config: WorkerConfig,
    pub(crate) shared: Arc<Shared>,
    pub(crate) recorder: Arc<Recorder>,
    /// Claiming stops when this fires (shutdown, deprecation, the fence, a fatal claim).
    pub(crate) stop: CancellationToken,
    pub(crate) reason: Arc<Mutex<Option<StopReason>>>,
    /// Fired by queue signals: new work may be waiting.
    pub(crate) wake: Arc<Notify>,
    /// The server processes of this worker's exchanges, whose queue signals it ignores.
    pub(crate) own: OwnBackends,
}

/// The server processes of a worker's exchanges. A signal sent by the worker's own exchange is about
/// tasks that exchange has just claimed (or left for later claims it makes anyway): waking for it would
/// only spend a round trip on an empty claim. Other workers of the queue still wake for it.
#[derive(Clone, Default)]
pub(crate) struct OwnBackends(Arc<Mutex<Vec<u32>>>);

impl OwnBackends {
    /// Connections come and go with the pool: only the most recent few are remembered.
    const KEEP: usize = 16;

    fn add(&self, pid: u32) {
        let mut pids = self.0.lock().expect("backend list lock");
        if !pids.contains(&pid) {
            if pids.len() == Self::KEEP {
                pids.remove(0);
            }
            pids.push(pid);
        }
    }

    /// Whether `pid` ran one of this worker's exchanges.
    pub(crate) fn contains(&self, pid: u32) -> bool {
        self.0.lock().expect("backend list lock").contains(&pid)
    }
}

/// The runs whose outputs the exchanges in flight are recording, with how many outputs each.
///
/// Recording an output takes its run's row lock (`_complete_tasks`, lock order 2) until the exchange commits.
/// A second exchange in flight that records an output of the same run waits for that commit, and its claim
/// waits with it; in a bulk drain two exchanges in flight overlap in this way often (the branches of one
/// diamond finishing on either side of an exchange's start), which left a core idle. So an exchange takes
/// only outputs of runs no exchange in flight is recording; the others wait for the next one, which is no
/// later than the lock would have let them through.
#[derive(Default)]
struct Recording(HashMap<Uuid, usize>);

impl Recording {
    /// Whether no exchange in flight records an output of `run_id`.
    fn free(&self, run_id: &Uuid) -> bool {
        !self.0.contains_key(run_id)
    }

    /// How many of `outputs` an exchange started now could take.
    fn takeable(&self, outputs: &[TaskResult]) -> usize {
        outputs.iter().filter(|o| self.free(&o.key.run_id)).count()
    }

    /// Takes up to `limit` outputs of free runs, oldest first, for an exchange starting now; the rest stay in
    /// `outputs`, in order.
    fn take(&mut self, outputs: &mut Vec<TaskResult>, limit: usize) -> Vec<TaskResult> {
        let (mut batch, mut kept) = (Vec::new(), Vec::with_capacity(outputs.len()));
        for output in outputs.drain(..) {
            if batch.len() < limit && self.free(&output.key.run_id) {
                batch.push(output);
            } else {
                kept.push(output);
            }
        }
        *outputs = kept;
        for output in &batch {
            *self.0.entry(output.key.run_id).or_default() += 1;
        }
        batch
    }

    /// An exchange carrying `outputs` has ended (whatever its result).
    fn ended(&mut self, outputs: &[TaskResult]) {
        for output in outputs {
            if let Some(n) = self.0.get_mut(&output.key.run_id) {
                *n -= 1;
                if *n == 0 {
                    self.0.remove(&output.key.run_id);
                }
            }
        }
    }
}

/// One finished exchange.
struct Cycle {
    /// The connection, unless the call failed (then it is dropped, in case it is broken).
    conn: Option<PoolConnection<Postgres>>,
    outputs: Vec<TaskResult>,
    /// One unrecorded-result permit per task asked for.
    rooms: Vec<OwnedSemaphorePermit>,
    result: Result<Exchanged, ClaimError>,
}

/// Where a stopping driver is.
struct Stopping {
    since: Instant,
    handlers_cancelled: bool,
}

/// A moving average of handler run times.
#[derive(Default)]
struct RunTime(Option<f64>);

impl RunTime {
    fn add(&mut self, sample: Duration) {
        let s = sample.as_secs_f64();
        self.0 = Some(self.0.map_or(s, |avg| 0.8 * avg + 0.2 * s));
    }

    /// How long an exchange waits for the results of handlers still running: twice the average run time,
    /// when that is under [`GATHER_MAX`] (siblings started together, such as the two branches of a diamond,
    /// then share one exchange instead of taking one each); nothing for slower handlers.
    fn gather_for(&self) -> Duration {
        match self.0 {
            Some(avg) if avg * 2.0 <= GATHER_MAX.as_secs_f64() => {
                Duration::from_secs_f64(avg * 2.0)
            }
            _ => Duration::ZERO,
        }
    }

    /// Tasks one slot gets through in `window`, by the average (0 before the first sample).
    fn per_slot(&self, window: Duration) -> usize {
        match self.0 {
            Some(avg) => (window.as_secs_f64() / avg.max(1e-6)).min(1e6) as usize,
            None => 0,
        }
    }
}

impl Driver {
    /// Runs until stopped and drained; returns the fatal claim that stopped it, if any.
    pub(crate) async fn run(
        self,
        mut results: mpsc::UnboundedReceiver<TaskResult>,
    ) -> Option<Fatal> {
        let config = &self.config;
        let slots = Arc::new(Semaphore::new(config.max_concurrent));
        let rooms = Arc::new(Semaphore::new(config.max_unrecorded));
        let mut handlers: JoinSet<()> = JoinSet::new();
        let mut side: JoinSet<()> = JoinSet::new();
        let mut ready: VecDeque<(Claimed, OwnedSemaphorePermit)> = VecDeque::new();
        let mut outputs: Vec<TaskResult> = Vec::new();
        let mut recording = Recording::default();
        let mut inflight: FuturesUnordered<BoxFuture<'static, Cycle>> = FuturesUnordered::new();
        let mut claiming = 0usize;
        let mut spare: Vec<(PoolConnection<Postgres>, Instant)> = Vec::new();
        let mut run_time = RunTime::default();
        let mut want_claim = true;
        // Whether the last claim came back with every task it asked for (so more are likely waiting).
        let mut last_claim_full = false;
        let mut poll_at: Option<Instant> = None;
        let mut idle = Backoff::new(config.poll_interval, config.max_poll_wait);
        let mut last_found = Instant::now();
        let mut errors = Backoff::database(config.poll_error_backoff_max);
        let mut hold_until: Option<Instant> = None;
        let mut gather_until: Option<Instant> = None;
        let mut stopping: Option<Stopping> = None;
        let mut fatal: Option<Fatal> = None;

        loop {
            let now = Instant::now();

            // Start what was claimed, as slots allow.
            while stopping.is_none() && !ready.is_empty() {
                let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                    break;
                };
                let (task, room) = ready.pop_front().expect("not empty");
                handlers.spawn(execute::execute(Arc::clone(&self.shared), task, slot, room));
            }

            // Stopping: cancel handlers after the grace; end once everything is recorded or time is up.
            if let Some(s) = &mut stopping {
                let cancel_at = s.since + config.shutdown_grace;
                let deadline = cancel_at + config.cancel_grace;
                if !s.handlers_cancelled && now >= cancel_at && !handlers.is_empty() {
                    tracing::warn!(
                        left = handlers.len(),
                        "shutdown grace over; cancelling handlers"
                    );
                    self.shared.handlers.cancel();
                    s.handlers_cancelled = true;
                }
                if now >= deadline {
                    handlers.abort_all();
                    while handlers.join_next().await.is_some() {}
                    self.give_up_pending();
                    break;
                }
                if handlers.is_empty() && inflight.is_empty() && side.is_empty() {
                    // Every handler has sent its result by now.
                    while let Ok(item) = results.try_recv() {
                        self.sort(item, &mut outputs, &mut side, &mut run_time);
                    }
                    if outputs.is_empty() && side.is_empty() {
                        break;
                    }
                }
            }

            // Start an exchange when there is something to record or room to claim.
            if hold_until.is_some_and(|t| now >= t) {
                hold_until = None;
            }
            let held = hold_until.is_some();
            // Outputs wait a moment for fast handlers still running (at most `gather_for`).
            let running = slots.available_permits() < config.max_concurrent;
            if outputs.is_empty() || !running || stopping.is_some() {
                gather_until = None;
            } else if gather_until.is_none() {
                gather_until = Some(now + run_time.gather_for());
            }
            let gathering = gather_until.is_some_and(|t| now < t);
            let qty = if stopping.is_none() {
                let ahead = if config.prefetch.is_zero() {
                    0
                } else {
                    run_time
                        .per_slot(config.prefetch)
                        .saturating_mul(config.max_concurrent)
                };
                let free = slots.available_permits();
                let capacity = free.saturating_add(ahead);
                capacity
                    .saturating_sub(ready.len() + claiming)
                    .min(config.batch_size.max(free))
                    .min(rooms.available_permits())
            } else {
                0
            };
            // One exchange at a time, unless there is a backlog: a further exchange in flight carries a full
            // batch, of outputs waiting or of a claim after the last claim came back full. Under a trickle of
            // work, exchanges side by side would each carry a few tasks and contend for the same runs' rows;
            // one at a time gathers what finishes meanwhile. A backlog keeps the server's cores busy. A queue
            // signal or the poll timer alone is no backlog: the claim it asks for waits for the exchange in
            // flight (which may claim the same tasks anyway).
            let takeable = recording.takeable(&outputs);
            let backlog = takeable >= config.batch_size
                || (want_claim && last_claim_full && qty >= config.batch_size);
            let room =
                inflight.is_empty() || (inflight.len() < config.completion_flushers && backlog);
            if room && !held && !gathering {
                // With outputs to record the claim rides along (that is how dependents go straight to
                // this worker); alone, it waits for a reason to look.
                let qty = if want_claim || takeable > 0 { qty } else { 0 };
                if takeable > 0 || qty > 0 {
                    let batch = recording.take(&mut outputs, config.completion_batch_size);
                    let permits: Vec<OwnedSemaphorePermit> = (0..qty)
                        .map(|_| {
                            Arc::clone(&rooms)
                                .try_acquire_owned()
                                .expect("free room was counted")
                        })
                        .collect();
                    claiming += permits.len();
                    gather_until = None;
                    let conn = spare.pop().map(|(c, _)| c);
                    inflight.push(exchange(
                        self.pool.clone(),
                        Arc::clone(&self.claimer),
                        conn,
                        batch,
                        permits,
                    ));
                    continue;
                }
            }

            // Hand back connections unused for a while.
            spare.retain(|(_, since)| now.duration_since(*since) < SPARE_FOR);

            // Wait for the next thing to happen.
            let timer = [
                poll_at.filter(|_| !want_claim),
                hold_until,
                gather_until.filter(|t| now < *t),
                spare.first().map(|(_, since)| *since + SPARE_FOR),
                stopping.as_ref().map(|s| {
                    if s.handlers_cancelled {
                        s.since + config.shutdown_grace + config.cancel_grace
                    } else {
                        s.since + config.shutdown_grace
                    }
                }),
            ]
            .into_iter()
            .flatten()
            .min();
            tokio::select! {
                biased;
                _ = self.stop.cancelled(), if stopping.is_none() => {
                    stopping = Some(Stopping { since: Instant::now(), handlers_cancelled: false });
                    // Claimed ahead but not started: release_worker_tasks hands them back.
                    ready.clear();
                    let in_flight = handlers.len();
                    if in_flight > 0 {
                        tracing::info!(in_flight, grace_s = config.shutdown_grace.as_secs_f64(),
                            "waiting for in-flight tasks");
                    }
                }
                Some(cycle) = inflight.next(), if !inflight.is_empty() => {
                    claiming -= cycle.rooms.len();
                    recording.ended(&cycle.outputs);
                    if let Some(conn) = cycle.conn {
                        if spare.len() < MAX_SPARE {
                            spare.push((conn, Instant::now()));
                        }
                    }
                    let asked = cycle.rooms.len();
                    match cycle.result {
                        Ok(exchanged) => {
                            if let Some(pid) = exchanged.backend_pid {
                                self.own.add(pid);
                            }
                            errors.reset();
                            hold_until = None;
                            self.recorder.recorded(exchanged.completions, &cycle.outputs);
                            self.recorder.done(cycle.outputs);
                            if exchanged.deferred > 0 {
                                self.recorder.stats.deferred.fetch_add(exchanged.deferred, Ordering::Relaxed);
                                tracing::debug!(deferred = exchanged.deferred,
                                    "read messages whose task is running elsewhere; left to that attempt");
                            }
                            match exchanged.claim {
                                ClaimOutcome::Claimed(tasks) => {
                                    if asked > 0 {
                                        // Short of what it asked for: look again on a signal, a result or
                                        // the poll timer, which backs off only once claims have found
                                        // nothing for a while (signals are throttled, so a busy queue
                                        // can have work that no signal announced).
                                        let now = Instant::now();
                                        if !tasks.is_empty() {
                                            last_found = now;
                                        }
                                        if now.duration_since(last_found) < ACTIVE_FOR {
                                            idle.reset();
                                        }
                                        want_claim = tasks.len() == asked;
                                        last_claim_full = want_claim;
                                        poll_at = (!want_claim).then(|| now + jitter(idle.next_delay()));
                                    }
                                    let mut permits = cycle.rooms.into_iter();
                                    for task in tasks {
                                        let room = permits.next().expect("never more tasks than asked for");
                                        if stopping.is_some() {
                                            continue;
                                        }
                                        ready.push_back((task, room));
                                    }
                                }
                                ClaimOutcome::Unsupported(unsupported) => {
                                    fatal.get_or_insert(Fatal(unsupported));
                                    self.stop.cancel();
                                }
                                ClaimOutcome::Disabled(disabled) => {
                                    tracing::warn!(worker_id = %self.claimer.worker_id, reason = ?disabled.reason,
                                        "worker function disabled: no more claims, draining");
                                    self.reason.lock().expect("stop reason lock")
                                        .get_or_insert(StopReason::Disabled);
                                    self.stop.cancel();
                                }
                            }
                        }
                        Err(ClaimError::Decode(e)) => {
                            // The transaction committed; its rows cannot be read. The outputs are recorded
                            // or stale; claimed tasks are recovered by their visibility and timeout.
                            tracing::error!(error = %e, "cannot decode the exchange result");
                            self.recorder.done(cycle.outputs);
                            hold_until = Some(Instant::now() + errors.next_delay());
                        }
                        Err(ClaimError::Database(e)) => {
                            let wait = errors.next_delay();
                            hold_until = Some(Instant::now() + wait);
                            if !cycle.outputs.is_empty() && !transient(&e) {
                                // Refused as a whole (an output it cannot store): one by one.
                                let recorder = Arc::clone(&self.recorder);
                                side.spawn(async move { recorder.complete(cycle.outputs).await });
                                hold_until = None;
                            } else {
                                tracing::warn!(queue = %self.claimer.queue, error = %e,
                                    retry_in_ms = wait.as_millis() as u64, outputs = cycle.outputs.len(),
                                    "exchange failed; backing off");
                                let now = Instant::now();
                                let (expired, kept): (Vec<_>, Vec<_>) = cycle.outputs.into_iter()
                                    .map(|mut o| { o.first_error.get_or_insert(now); o })
                                    .partition(|o| o.first_error.is_some_and(|t| now.duration_since(t) >= RECORD_PATIENCE));
                                if !expired.is_empty() {
                                    self.recorder.give_up(expired, &e);
                                }
                                outputs.splice(0..0, kept);
                            }
                        }
                    }
                }
                Some(item) = results.recv() => {
                    self.sort(item, &mut outputs, &mut side, &mut run_time);
                    while let Ok(item) = results.try_recv() {
                        self.sort(item, &mut outputs, &mut side, &mut run_time);
                    }
                }
                Some(joined) = handlers.join_next(), if !handlers.is_empty() => log_join(joined),
                Some(joined) = side.join_next(), if !side.is_empty() => log_join(joined),
                () = self.wake.notified(), if stopping.is_none() => {
                    want_claim = true;
                    idle.reset();
                    poll_at = None;
                }
                () = sleep_until(timer), if timer.is_some() => {
                    if poll_at.is_some_and(|t| Instant::now() >= t) {
                        want_claim = true;
                        poll_at = None;
                    }
                }
            }
        }
        fatal
    }

    /// Outputs wait for the next exchange; failures are recorded beside the loop.
    fn sort(
        &self,
        mut item: TaskResult,
        outputs: &mut Vec<TaskResult>,
        side: &mut JoinSet<()>,
        run_time: &mut RunTime,
    ) {
        run_time.add(item.ran_for);
        if item.sort() {
            outputs.push(item);
        } else {
            let recorder = Arc::clone(&self.recorder);
            side.spawn(async move { recorder.fail(item).await });
        }
    }

    /// Logs every result still unrecorded when the shutdown grace is over (recovery runs those tasks again).
    fn give_up_pending(&self) {
        let left: Vec<String> = self
            .recorder
            .pending
            .lock()
            .expect("pending lock")
            .values()
            .map(describe)
            .collect();
        if !left.is_empty() {
            tracing::warn!(unrecorded = ?left,
                "shutdown grace over with results not recorded; recovery will run these tasks again");
        }
    }
}

/// One exchange on `conn` (or a connection from the pool).
fn exchange(
    pool: PgPool,
    claimer: Arc<Claimer>,
    conn: Option<PoolConnection<Postgres>>,
    outputs: Vec<TaskResult>,
    rooms: Vec<OwnedSemaphorePermit>,
) -> BoxFuture<'static, Cycle> {
    async move {
        let mut conn = match conn {
            Some(conn) => conn,
            None => match pool.acquire().await {
                Ok(conn) => conn,
                Err(e) => {
                    return Cycle {
                        conn: None,
                        outputs,
                        rooms,
                        result: Err(ClaimError::Database(e)),
                    }
                }
            },
        };
        let result = claimer.exchange(&mut conn, &outputs, rooms.len()).await;
        Cycle {
            conn: result.is_ok().then_some(conn),
            outputs,
            rooms,
            result,
        }
    }
    .boxed()
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn log_join(joined: Result<(), tokio::task::JoinError>) {
    if let Err(e) = joined {
        if e.is_panic() {
            tracing::error!(error = %e, "a task runner panicked outside its handler");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::result::{Outcome, TaskKey};
    use super::*;

    #[test]
    fn run_time_sizes_claim_ahead_only_once_it_has_seen_a_handler() {
        let mut t = RunTime::default();
        assert_eq!(t.per_slot(Duration::from_millis(100)), 0);
        t.add(Duration::from_millis(10));
        assert_eq!(t.per_slot(Duration::from_millis(100)), 10);
        t.add(Duration::from_secs(10));
        assert_eq!(t.per_slot(Duration::from_millis(100)), 0);
    }

    fn output(run: u128, step: &str) -> TaskResult {
        TaskResult {
            key: TaskKey {
                run_id: Uuid::from_u128(run),
                flow_slug: "f".into(),
                step_slug: step.into(),
                task_index: 0,
                msg_id: 1,
                attempt: 1,
            },
            outcome: Outcome::Output(serde_json::Value::Null),
            ran_for: Duration::ZERO,
            first_error: None,
            _permit: Arc::new(Semaphore::new(1))
                .try_acquire_owned()
                .expect("a free permit"),
        }
    }

    fn runs(batch: &[TaskResult]) -> Vec<u128> {
        batch.iter().map(|o| o.key.run_id.as_u128()).collect()
    }

    #[test]
    fn an_exchange_beside_others_leaves_out_the_runs_they_record() {
        let mut recording = Recording::default();
        let mut outputs = vec![output(1, "b"), output(2, "b")];
        let first = recording.take(&mut outputs, 64);
        assert_eq!(runs(&first), [1, 2], "nothing in flight: everything goes");

        // Run 1's other branch finishes while the first exchange is in flight; so do two other runs' tasks.
        outputs = vec![output(1, "c"), output(3, "b"), output(4, "b")];
        assert_eq!(recording.takeable(&outputs), 2);
        let second = recording.take(&mut outputs, 1);
        assert_eq!(runs(&second), [3], "oldest free run first, up to the limit");
        assert_eq!(runs(&outputs), [1, 4], "the rest keep their order");
        assert_eq!(
            recording.takeable(&outputs),
            1,
            "run 1 is still being recorded"
        );

        recording.ended(&first);
        assert_eq!(recording.takeable(&outputs), 2, "run 1 is free again");
        assert!(recording.free(&Uuid::from_u128(1)));
        assert!(!recording.free(&Uuid::from_u128(3)));
        let third = recording.take(&mut outputs, 64);
        assert_eq!(runs(&third), [1, 4]);
        recording.ended(&second);
        recording.ended(&third);
        assert!(
            recording.0.is_empty(),
            "every run is released once its exchanges end"
        );
    }

    #[test]
    fn exchanges_wait_for_fast_siblings_only() {
        let mut t = RunTime::default();
        assert_eq!(t.gather_for(), Duration::ZERO, "no handler seen yet");
        t.add(Duration::from_micros(100));
        assert_eq!(t.gather_for(), Duration::from_micros(200));
        t.add(Duration::from_millis(50));
        assert_eq!(
            t.gather_for(),
            Duration::ZERO,
            "slow handlers: record at once"
        );
    }
}
