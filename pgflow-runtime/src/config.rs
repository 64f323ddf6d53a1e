//! Worker configuration: every default in one place, validated once.

use std::time::Duration;

use crate::pooling::Pooling;

/// What the worker does with the flow definition at startup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Compilation {
    /// Create the flow when missing, accept an identical one, refuse to start on a different one
    /// (unless the database is local, see `pgflow.is_local()`, and the worker connects with an admin role).
    /// Verification also recreates a queue of the flow that was dropped. The default.
    #[default]
    Verify,
    /// Like `Verify`, but a different stored shape is replaced: **deletes the flow's runs**. Needs an
    /// admin role (the owner of schema `pgflow`); a worker role is refused with `42501`.
    AllowDataLoss,
    /// Do not call `ensure_flow_compiled`; the flow must already exist.
    Skip,
}

/// Worker settings. Build them with the worker builder; every default is listed here.
///
/// | setting | default | meaning |
/// |---|---|---|
/// | `max_concurrent` | 10 | handlers running at once |
/// | `batch_size` | 32 | most messages one claim asks for (the free handler slots, when more are free) |
/// | `max_unrecorded` | 128 | results (outputs and failures) waiting to be recorded; claiming pauses at this many, so a slow database cannot pile up unrecorded work |
/// | `poll_interval` | 25 ms | wait after an empty read; doubles while idle, with ±25 % jitter |
/// | `max_poll_wait` | 1 s | longest wait between reads while idle; new tasks signal their queue (`LISTEN pgflow_queue_signal`), so this bounds the pick-up of work that sends no signal (a retry whose delay ran out, a recovered task) |
/// | `prefetch` | 100 ms | a claim also asks for the tasks the busy slots are expected to finish within this window (by the handlers' average run time), so fast handlers get several tasks per round trip; zero: only free slots |
/// | `read_visibility` | 5 s | how long a read message stays hidden before the claim extends it |
/// | `heartbeat_interval` | 2 s | `pgflow.workers.last_heartbeat_at` updates; deprecation and the fence are seen here |
/// | `dead_worker_timeout` | 10 s (`Some`) | a worker whose heartbeat is older is dead: its started tasks are requeued at once (`None`: leave it to stalled recovery, step timeout + 30 s) |
/// | `maintenance_interval` | 5 s (`Some`) | how often this worker runs `pgflow.run_maintenance` (recovery and retention; one worker at a time) |
/// | `retention` | 7 days (`Some`) | finished runs, their tasks and archived messages, and stopped workers older than this are deleted, in bounded batches, during maintenance (`None`: keep everything) |
/// | `retention_batch` | 1000 | most runs deleted per retention batch; a sweep runs further batches at once while they come back full, up to `maintenance_interval` |
/// | `shutdown_grace` | 30 s | how long in-flight handlers may finish, and their results be recorded, after shutdown is requested |
/// | `cancel_grace` | 2 s | after the grace, how long cancelled handlers may still return |
/// | `schedule_interval` | 1 s (`Some`) | how often this worker fires due schedules (`pgflow.schedules`; any worker may, each fire time starts one run) |
/// | `schedules` | none | schedules this worker declares at startup ([`crate::schedules::Schedule`], see `WorkerBuilder::schedule`) |
/// | `poll_error_backoff_max` | 5 s | longest wait after repeated database errors while polling or recording |
/// | `completion_batch_size` | 64 | most outputs recorded in one exchange |
/// | `completion_flushers` | 3 | most exchanges in flight at once, shared out among the queue's live workers (beyond one, only with a backlog) |
/// | `worker_name` | the queue name | `pgflow.worker_functions.function_name`, the deployment unit |
/// | `compilation` | [`Compilation::Verify`] | see [`Compilation`] |
/// | `auto_install` | `false` | install or upgrade the pgflow schema (and PGMQ) at startup |
/// | `pooling` | [`Pooling::Direct`] | how the pool reaches PostgreSQL; [`Pooling::Transaction`] behind PgBouncer in transaction mode (see `docs/poolers.md`) |
///
/// Each exchange records the finished outputs and claims the next tasks in one round trip and one
/// transaction (`pgflow.exchange`); failures are recorded one by one beside it.
///
/// The pool is the caller's (a worker's connections are the pool's): the worker itself uses at most
/// `completion_flushers + 3` connections at once (exchanges, failures, heartbeats, maintenance), and
/// handlers that query share what is left; a busy worker keeps the connection of its last exchange for up
/// to 100 ms between uses. The queue signal listener has one connection of its own, outside the pool. A
/// zero-configuration worker (`DATABASE_URL`, see
/// [`WorkerConfig::pool_size`]) opens that many plus one per concurrent handler, up to 10.
///
/// Queue-scoped settings (concurrency, batch size, polling, read visibility, the pool) are worker settings;
/// step timeouts and retries are flow and step options, not worker settings: each claim carries the step's
/// effective timeout from the database.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct WorkerConfig {
    /// Handlers running at once.
    pub max_concurrent: usize,
    /// Most messages one claim asks for, unless more handler slots are free.
    pub batch_size: usize,
    /// Results waiting to be recorded at most; claiming pauses while this many wait.
    pub max_unrecorded: usize,
    /// How far ahead a claim looks (see the table).
    pub prefetch: Duration,
    /// Wait after an empty read.
    pub poll_interval: Duration,
    /// Longest wait between reads while idle.
    pub max_poll_wait: Duration,
    /// Visibility of a read message until the claim extends it (whole seconds, at least 1).
    pub read_visibility: Duration,
    /// Heartbeat period.
    pub heartbeat_interval: Duration,
    /// How long a silent worker counts as alive; `None` disables dead-worker recovery by this worker.
    pub dead_worker_timeout: Option<Duration>,
    /// Maintenance period; `None` leaves recovery and retention to someone else (e.g. pg_cron).
    pub maintenance_interval: Option<Duration>,
    /// Age at which finished history is deleted; `None` keeps everything.
    pub retention: Option<Duration>,
    /// Most runs deleted per retention batch (a sweep repeats full batches, for up to one maintenance interval).
    pub retention_batch: usize,
    /// Time in-flight handlers get to finish (and their results to be recorded) on shutdown.
    pub shutdown_grace: Duration,
    /// Time cancelled handlers get to return after the grace.
    pub cancel_grace: Duration,
    /// Cap of the exponential backoff after database errors.
    pub poll_error_backoff_max: Duration,
    /// Most outputs recorded by one exchange.
    pub completion_batch_size: usize,
    /// Most exchanges in flight at once, for the live workers of the queue together: each worker runs at
    /// most its share, `completion_flushers / live workers` rounded up (at least one), counted by its
    /// heartbeat. So 16 worker processes on one queue run one exchange each, not three, and their claims do
    /// not spend the server's cores reading past each other's held messages. Beyond the first, an exchange starts only with a backlog: at
    /// least `batch_size` outputs waiting to be recorded, or a claim of `batch_size` tasks after the last
    /// claim came back full. Such an exchange leaves out the outputs of runs that the exchanges in flight are
    /// recording (they would wait for those exchanges' run-row locks); the next exchange takes them.
    pub completion_flushers: usize,
    /// The worker function name; `None` uses the queue name.
    pub worker_name: Option<String>,
    /// Startup compilation policy.
    pub compilation: Compilation,
    /// Install or upgrade the schema at startup.
    pub auto_install: bool,
    /// How the pool reaches PostgreSQL (directly, or through a transaction pooler).
    pub pooling: Pooling,
    /// How often this worker fires due schedules; `None` leaves schedules to other workers.
    pub schedule_interval: Option<Duration>,
    /// Schedules this worker declares (stores or updates) at startup.
    pub schedules: Vec<crate::schedules::Schedule>,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            max_concurrent: 10,
            batch_size: 32,
            max_unrecorded: 128,
            poll_interval: Duration::from_millis(25),
            max_poll_wait: Duration::from_secs(1),
            prefetch: Duration::from_millis(100),
            read_visibility: Duration::from_secs(5),
            heartbeat_interval: Duration::from_secs(2),
            dead_worker_timeout: Some(Duration::from_secs(10)),
            maintenance_interval: Some(Duration::from_secs(5)),
            retention: Some(Duration::from_secs(7 * 24 * 3600)),
            retention_batch: 1000,
            shutdown_grace: Duration::from_secs(30),
            cancel_grace: Duration::from_secs(2),
            poll_error_backoff_max: Duration::from_secs(5),
            completion_batch_size: 64,
            completion_flushers: 3,
            worker_name: None,
            compilation: Compilation::Verify,
            auto_install: false,
            pooling: Pooling::Direct,
            schedule_interval: Some(Duration::from_secs(1)),
            schedules: Vec::new(),
        }
    }
}

/// An invalid worker setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A count that must be positive is zero.
    #[error("`{setting}` must be at least 1")]
    Zero {
        /// The setting's name.
        setting: &'static str,
    },
    /// A count above its limit.
    #[error("`{setting}` is {value}, the maximum is {max}")]
    TooLarge {
        /// The setting's name.
        setting: &'static str,
        /// The value given.
        value: usize,
        /// The limit.
        max: usize,
    },
    /// A duration below its minimum.
    #[error("`{setting}` is {value:?}, the minimum is {min:?}")]
    TooShort {
        /// The setting's name.
        setting: &'static str,
        /// The value given.
        value: Duration,
        /// The minimum.
        min: Duration,
    },
    /// `max_poll_wait` shorter than `poll_interval`.
    #[error(
        "`max_poll_wait` ({max_poll_wait:?}) is shorter than `poll_interval` ({poll_interval:?})"
    )]
    PollWaitBelowInterval {
        /// The interval.
        poll_interval: Duration,
        /// The maximum wait.
        max_poll_wait: Duration,
    },
    /// `dead_worker_timeout` not comfortably longer than `heartbeat_interval`: live workers would be
    /// declared dead between two heartbeats.
    #[error("`dead_worker_timeout` ({dead_worker_timeout:?}) must be at least three `heartbeat_interval`s ({heartbeat_interval:?})")]
    DeadBeforeHeartbeats {
        /// The heartbeat period.
        heartbeat_interval: Duration,
        /// The dead-worker timeout.
        dead_worker_timeout: Duration,
    },
    /// `auto_install` behind a transaction pooler: installing needs a direct connection.
    #[error("`auto_install` needs a direct connection to PostgreSQL, and `pooling` says the pool goes through a \
        transaction pooler: install with `pgflow-sql install` (or `pgflow_sql::install`) over a direct connection \
        before starting workers, and drop `auto_install`")]
    AutoInstallBehindPooler,
    /// An empty or too long worker name.
    #[error("`worker_name` must be 1 to 128 characters, got {len}")]
    WorkerName {
        /// Its length.
        len: usize,
    },
}

impl WorkerConfig {
    /// The connections the pool of a zero-configuration worker gets: what the worker itself uses at most
    /// (`completion_flushers + 3`: exchanges, failures, heartbeats, maintenance) plus one per concurrent
    /// handler, up to 10, for handlers that query (`ctx.pool()`).
    ///
    /// ```
    /// use pgflow_runtime::worker::WorkerConfig;
    /// assert_eq!(WorkerConfig::default().pool_size(), 16);
    /// ```
    pub fn pool_size(&self) -> u32 {
        let own = self.completion_flushers.saturating_add(3);
        let handlers = self.max_concurrent.min(10);
        u32::try_from(own.saturating_add(handlers)).unwrap_or(u32::MAX)
    }

    /// Checks every setting.
    ///
    /// # Errors
    ///
    /// The first invalid setting, as a [`ConfigError`].
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.auto_install && self.pooling.is_transaction() {
            return Err(ConfigError::AutoInstallBehindPooler);
        }
        for (setting, value, max) in [
            ("max_concurrent", self.max_concurrent, 10_000),
            ("batch_size", self.batch_size, 1_000),
            ("max_unrecorded", self.max_unrecorded, 1_000_000),
            ("retention_batch", self.retention_batch, 1_000_000),
            ("completion_batch_size", self.completion_batch_size, 10_000),
            ("completion_flushers", self.completion_flushers, 64),
        ] {
            if value == 0 {
                return Err(ConfigError::Zero { setting });
            }
            if value > max {
                return Err(ConfigError::TooLarge {
                    setting,
                    value,
                    max,
                });
            }
        }
        let ms = Duration::from_millis;
        for (setting, value, min) in [
            ("poll_interval", self.poll_interval, ms(1)),
            ("read_visibility", self.read_visibility, ms(1_000)),
            ("heartbeat_interval", self.heartbeat_interval, ms(10)),
            ("poll_error_backoff_max", self.poll_error_backoff_max, ms(1)),
            (
                "maintenance_interval",
                self.maintenance_interval.unwrap_or(ms(10)),
                ms(10),
            ),
            (
                "dead_worker_timeout",
                self.dead_worker_timeout.unwrap_or(ms(100)),
                ms(100),
            ),
            ("retention", self.retention.unwrap_or(ms(1_000)), ms(1_000)),
            (
                "schedule_interval",
                self.schedule_interval.unwrap_or(ms(10)),
                ms(10),
            ),
        ] {
            if value < min {
                return Err(ConfigError::TooShort {
                    setting,
                    value,
                    min,
                });
            }
        }
        if self.max_poll_wait < self.poll_interval {
            return Err(ConfigError::PollWaitBelowInterval {
                poll_interval: self.poll_interval,
                max_poll_wait: self.max_poll_wait,
            });
        }
        if let Some(dead) = self.dead_worker_timeout {
            if dead < self.heartbeat_interval * 3 {
                return Err(ConfigError::DeadBeforeHeartbeats {
                    heartbeat_interval: self.heartbeat_interval,
                    dead_worker_timeout: dead,
                });
            }
        }
        if let Some(name) = &self.worker_name {
            let len = name.chars().count();
            if len == 0 || len > 128 {
                return Err(ConfigError::WorkerName { len });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        WorkerConfig::default().validate().unwrap();
    }

    #[test]
    fn zero_concurrency_is_rejected_by_name() {
        let c = WorkerConfig {
            max_concurrent: 0,
            ..WorkerConfig::default()
        };
        assert_eq!(
            c.validate(),
            Err(ConfigError::Zero {
                setting: "max_concurrent"
            })
        );
        assert_eq!(
            c.validate().unwrap_err().to_string(),
            "`max_concurrent` must be at least 1"
        );
    }

    #[test]
    fn sub_second_read_visibility_is_rejected() {
        let c = WorkerConfig {
            read_visibility: Duration::from_millis(500),
            ..WorkerConfig::default()
        };
        assert!(matches!(
            c.validate(),
            Err(ConfigError::TooShort {
                setting: "read_visibility",
                ..
            })
        ));
    }

    #[test]
    fn poll_wait_below_interval_is_rejected() {
        let c = WorkerConfig {
            poll_interval: Duration::from_secs(2),
            max_poll_wait: Duration::from_secs(1),
            ..WorkerConfig::default()
        };
        assert!(matches!(
            c.validate(),
            Err(ConfigError::PollWaitBelowInterval { .. })
        ));
    }
}
