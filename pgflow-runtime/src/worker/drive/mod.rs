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
//!   full) does another start beside it, up to this worker's share of `completion_flushers` (the queue's
//!   live workers share it out, see `background::Peers`). Before an exchange records the
//!   outputs already in, it waits a moment for fast handlers still running (twice their average run
//!   time, at most 1 ms), so that siblings started together share one exchange. An exchange that starts
//!   beside others leaves out the outputs of runs they are recording: recording an output locks its run's
//!   row, so such an exchange would wait for theirs to commit, its claim with it; those outputs go in the
//!   next exchange instead (see [`Recording`]).
//! - **Idle.** After a claim finds fewer tasks than it asked for, the driver waits for a queue signal
//!   (`LISTEN pgflow_queue_signal`, see `background::listen`), for a result, or for the poll timer:
//!   `poll_interval` while claims found tasks within the last [`ACTIVE_FOR`] (signals are throttled per
//!   queue, so a busy queue can hold tasks no signal announced), then doubling to `max_poll_wait`; with
//!   jitter, so that idle workers do not poll in lockstep. A signal taken while a claim is in flight may
//!   announce tasks committed after that claim read the queue: when the claim comes back empty, the driver
//!   claims again at once; when it found tasks, the timer is at most `poll_interval` away and their outputs
//!   carry the next claim.
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

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres};
use tokio::sync::{mpsc, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::background::{OwnBackends, Peers};
use super::batch::{Recording, RunTime};
use super::claim::{Claimed, Claimer, Unsupported};
use super::execute::{self, Shared};
use super::record::{describe, Recorder};
use super::result::TaskResult;
use super::retry::Backoff;
use super::StopReason;
use crate::config::WorkerConfig;

mod exchange;

use exchange::{exchange, Cycle};

/// How long the driver keeps an unused connection before handing it back to the pool.
const SPARE_FOR: Duration = Duration::from_millis(100);

/// How long after its last claimed task the driver keeps polling at `poll_interval` before it backs off.
const ACTIVE_FOR: Duration = Duration::from_secs(1);

/// How many unused connections the driver keeps (a pool may be shared by several workers).
const MAX_SPARE: usize = 1;

/// A pool connection the driver holds (in an exchange, or kept for the next one). Once an exchange on it
/// has named its server process, that process counts as the worker's own ([`OwnBackends`]) until the
/// connection is dropped, which hands it back to the pool.
pub(super) struct Held {
    conn: PoolConnection<Postgres>,
    pid: Option<u32>,
    own: OwnBackends,
}

impl Held {
    fn new(conn: PoolConnection<Postgres>, own: OwnBackends) -> Self {
        Held {
            conn,
            pid: None,
            own,
        }
    }

    /// The server process behind the connection, as an exchange on it reported (a connection keeps its
    /// process, so the first report is the one kept).
    fn named(&mut self, pid: u32) {
        if self.pid.is_none() {
            self.pid = Some(pid);
            self.own.hold(pid);
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(pid) = self.pid {
            self.own.release(pid);
        }
    }
}

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
    /// The live workers of the queue, which share `completion_flushers` out.
    pub(crate) peers: Peers,
}

/// Where a stopping driver is.
struct Stopping {
    since: Instant,
    handlers_cancelled: bool,
}

impl Driver {
    /// Runs until stopped and drained; returns the fatal claim that stopped it, if any.
    pub(crate) async fn run(self, results: mpsc::UnboundedReceiver<TaskResult>) -> Option<Fatal> {
        DriverLoop::new(self, results).run().await
    }
}

/// The driver's state while it runs: one method per event of its loop.
struct DriverLoop {
    d: Driver,
    results: mpsc::UnboundedReceiver<TaskResult>,
    /// Handler slots (`max_concurrent`).
    slots: Arc<Semaphore>,
    /// Unrecorded-result permits (`max_unrecorded`).
    rooms: Arc<Semaphore>,
    handlers: JoinSet<()>,
    /// Failures and one-by-one recordings, beside the loop.
    side: JoinSet<()>,
    /// Claimed (ahead) and not started yet.
    ready: VecDeque<(Claimed, OwnedSemaphorePermit)>,
    /// Outputs waiting for the next exchange.
    outputs: Vec<TaskResult>,
    recording: Recording,
    inflight: FuturesUnordered<BoxFuture<'static, Cycle>>,
    /// Tasks asked for by the exchanges in flight.
    claiming: usize,
    spare: Vec<(Held, Instant)>,
    run_time: RunTime,
    want_claim: bool,
    /// Queue signals taken so far. An exchange remembers the count it started with: a signal that came while
    /// it was in flight may announce tasks committed after its claim read the queue (see `on_claimed`).
    wakes: u64,
    /// Whether the last claim came back with every task it asked for (so more are likely waiting).
    last_claim_full: bool,
    poll_at: Option<Instant>,
    idle: Backoff,
    last_found: Instant,
    errors: Backoff,
    hold_until: Option<Instant>,
    gather_until: Option<Instant>,
    stopping: Option<Stopping>,
    fatal: Option<Fatal>,
}

impl DriverLoop {
    fn new(d: Driver, results: mpsc::UnboundedReceiver<TaskResult>) -> Self {
        let config = &d.config;
        DriverLoop {
            results,
            slots: Arc::new(Semaphore::new(config.max_concurrent)),
            rooms: Arc::new(Semaphore::new(config.max_unrecorded)),
            handlers: JoinSet::new(),
            side: JoinSet::new(),
            ready: VecDeque::new(),
            outputs: Vec::new(),
            recording: Recording::default(),
            inflight: FuturesUnordered::new(),
            claiming: 0,
            spare: Vec::new(),
            run_time: RunTime::default(),
            want_claim: true,
            wakes: 0,
            last_claim_full: false,
            poll_at: None,
            idle: Backoff::new(config.poll_interval, config.max_poll_wait),
            last_found: Instant::now(),
            errors: Backoff::database(config.poll_error_backoff_max),
            hold_until: None,
            gather_until: None,
            stopping: None,
            fatal: None,
            d,
        }
    }

    async fn run(mut self) -> Option<Fatal> {
        loop {
            let now = Instant::now();
            self.start_ready();
            if self.stopping.is_some() && self.check_stopping(now).await {
                break;
            }
            if self.start_exchange(now) {
                continue;
            }
            // Hand back connections unused for a while.
            self.spare
                .retain(|(_, since)| now.duration_since(*since) < SPARE_FOR);
            let timer = self.timer(now);
            tokio::select! {
                biased;
                _ = self.d.stop.cancelled(), if self.stopping.is_none() => self.on_stop(),
                Some(cycle) = self.inflight.next(), if !self.inflight.is_empty() => self.on_exchanged(cycle),
                Some(item) = self.results.recv() => self.on_results(item),
                Some(joined) = self.handlers.join_next(), if !self.handlers.is_empty() => log_join(joined),
                Some(joined) = self.side.join_next(), if !self.side.is_empty() => log_join(joined),
                () = self.d.wake.notified(), if self.stopping.is_none() => self.on_wake(),
                () = sleep_until(timer), if timer.is_some() => self.on_timer(),
            }
        }
        self.fatal
    }

    /// Starts what was claimed, as slots allow.
    fn start_ready(&mut self) {
        while self.stopping.is_none() && !self.ready.is_empty() {
            let Ok(slot) = Arc::clone(&self.slots).try_acquire_owned() else {
                break;
            };
            let (task, room) = self.ready.pop_front().expect("not empty");
            let shared = Arc::clone(&self.d.shared);
            self.handlers
                .spawn(execute::execute(shared, task, slot, room));
        }
    }

    /// Stopping: cancels handlers after the grace; `true` once everything is recorded or time is up.
    async fn check_stopping(&mut self, now: Instant) -> bool {
        let config = &self.d.config;
        let Some(s) = &mut self.stopping else {
            return false;
        };
        let cancel_at = s.since + config.shutdown_grace;
        let deadline = cancel_at + config.cancel_grace;
        if !s.handlers_cancelled && now >= cancel_at && !self.handlers.is_empty() {
            tracing::warn!(
                left = self.handlers.len(),
                "shutdown grace over; cancelling handlers"
            );
            self.d.shared.handlers.cancel();
            s.handlers_cancelled = true;
        }
        if now >= deadline {
            self.handlers.abort_all();
            while self.handlers.join_next().await.is_some() {}
            self.d.give_up_pending();
            return true;
        }
        if self.handlers.is_empty() && self.inflight.is_empty() && self.side.is_empty() {
            // Every handler has sent its result by now.
            while let Ok(item) = self.results.try_recv() {
                self.sort(item);
            }
            if self.outputs.is_empty() && self.side.is_empty() {
                return true;
            }
        }
        false
    }

    /// How many tasks a claim started now asks for.
    fn claim_qty(&self) -> usize {
        let config = &self.d.config;
        if self.stopping.is_some() {
            return 0;
        }
        let ahead = if config.prefetch.is_zero() {
            0
        } else {
            self.run_time
                .per_slot(config.prefetch)
                .saturating_mul(config.max_concurrent)
        };
        let free = self.slots.available_permits();
        free.saturating_add(ahead)
            .saturating_sub(self.ready.len() + self.claiming)
            .min(config.batch_size.max(free))
            .min(self.rooms.available_permits())
    }

    /// Starts an exchange when there is something to record or room to claim; `true` when it did.
    fn start_exchange(&mut self, now: Instant) -> bool {
        let config = &self.d.config;
        if self.hold_until.is_some_and(|t| now >= t) {
            self.hold_until = None;
        }
        let held = self.hold_until.is_some();
        // Outputs wait a moment for fast handlers still running (at most `gather_for`).
        let running = self.slots.available_permits() < config.max_concurrent;
        if self.outputs.is_empty() || !running || self.stopping.is_some() {
            self.gather_until = None;
        } else if self.gather_until.is_none() {
            self.gather_until = Some(now + self.run_time.gather_for());
        }
        let gathering = self.gather_until.is_some_and(|t| now < t);
        let qty = self.claim_qty();
        // One exchange at a time, unless there is a backlog: a further exchange in flight carries a full
        // batch, of outputs waiting or of a claim after the last claim came back full. Under a trickle of
        // work, exchanges side by side would each carry a few tasks and contend for the same runs' rows;
        // one at a time gathers what finishes meanwhile. A backlog keeps the server's cores busy. A queue
        // signal or the poll timer alone is no backlog: the claim it asks for waits for the exchange in
        // flight (which may claim the same tasks anyway).
        let takeable = self.recording.takeable(&self.outputs);
        let backlog = takeable >= config.batch_size
            || (self.want_claim && self.last_claim_full && qty >= config.batch_size);
        let room = self.inflight.is_empty()
            || (self.inflight.len() < self.d.peers.share(config.completion_flushers) && backlog);
        if !room || held || gathering {
            return false;
        }
        // With outputs to record the claim rides along (that is how dependents go straight to this worker);
        // alone, it waits for a reason to look.
        let qty = if self.want_claim || takeable > 0 {
            qty
        } else {
            0
        };
        if takeable == 0 && qty == 0 {
            return false;
        }
        let batch = self
            .recording
            .take(&mut self.outputs, config.completion_batch_size);
        let permits: Vec<OwnedSemaphorePermit> = (0..qty)
            .map(|_| {
                Arc::clone(&self.rooms)
                    .try_acquire_owned()
                    .expect("free room was counted")
            })
            .collect();
        self.claiming += permits.len();
        self.gather_until = None;
        let conn = self.spare.pop().map(|(c, _)| c);
        self.inflight.push(exchange(
            self.d.pool.clone(),
            self.d.own.clone(),
            Arc::clone(&self.d.claimer),
            conn,
            batch,
            permits,
            self.wakes,
        ));
        true
    }

    /// When the loop must look again without any other event.
    fn timer(&self, now: Instant) -> Option<Instant> {
        let config = &self.d.config;
        [
            self.poll_at.filter(|_| !self.want_claim),
            self.hold_until,
            self.gather_until.filter(|t| now < *t),
            self.spare.first().map(|(_, since)| *since + SPARE_FOR),
            self.stopping.as_ref().map(|s| {
                if s.handlers_cancelled {
                    s.since + config.shutdown_grace + config.cancel_grace
                } else {
                    s.since + config.shutdown_grace
                }
            }),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// The stop token fired: claims stop, and what was claimed ahead is dropped.
    fn on_stop(&mut self) {
        self.stopping = Some(Stopping {
            since: Instant::now(),
            handlers_cancelled: false,
        });
        // Claimed ahead but not started: release_worker_tasks hands them back.
        self.ready.clear();
        let in_flight = self.handlers.len();
        if in_flight > 0 {
            tracing::info!(
                in_flight,
                grace_s = self.d.config.shutdown_grace.as_secs_f64(),
                "waiting for in-flight tasks"
            );
        }
    }

    /// Handlers sent results: take every one waiting.
    fn on_results(&mut self, item: TaskResult) {
        self.sort(item);
        while let Ok(item) = self.results.try_recv() {
            self.sort(item);
        }
    }

    /// A queue signal: new work may be waiting.
    fn on_wake(&mut self) {
        self.want_claim = true;
        self.wakes += 1;
        self.idle.reset();
        self.poll_at = None;
    }

    /// The timer fired: the poll time may have come.
    fn on_timer(&mut self) {
        if self.poll_at.is_some_and(|t| Instant::now() >= t) {
            self.want_claim = true;
            self.poll_at = None;
        }
    }

    /// Outputs wait for the next exchange; failures are recorded beside the loop.
    fn sort(&mut self, mut item: TaskResult) {
        self.run_time.add(item.ran_for);
        if item.sort() {
            self.outputs.push(item);
        } else {
            let recorder = Arc::clone(&self.d.recorder);
            self.side.spawn(async move { recorder.fail(item).await });
        }
    }
}

impl Driver {
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
