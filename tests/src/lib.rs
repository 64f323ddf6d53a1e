//! Helpers shared by every integration test binary: a fresh database per test, and bounded waits.
//!
//! Every test that touches the database gets its own database on a real PostgreSQL with real PGMQ
//! (see [`pgflow_sql::throwaway`]): the server in `DATABASE_URL`, or a throwaway cluster. [`state`]
//! starts runs and reads the rows the tests assert on. Helpers that only one binary needs live in
//! that binary's `support` module.

use std::future::Future;
use std::time::{Duration, Instant};

pub use pgflow_sql::throwaway::{Contents, FreshDatabase as TestDb};

pub mod deployed;
pub mod state;

/// The generous limit of bounded waits on work a worker or the database does in the background.
pub const LIMIT: Duration = Duration::from_secs(30);

/// A fresh database with PGMQ and every pgflow migration installed.
pub async fn test_db() -> TestDb {
    db_with(Contents::Pgflow).await
}

/// A fresh database with the given contents (empty, PGMQ only, or PGMQ and pgflow).
pub async fn db_with(contents: Contents) -> TestDb {
    init_tracing();
    pgflow_sql::throwaway::fresh_database(contents)
        .await
        .unwrap_or_else(|e| panic!("cannot provide a test database: {e}"))
}

/// Polls `check` every 20 ms until it returns true; panics naming `what` after `limit`.
pub async fn wait_until<F, Fut>(limit: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        if check().await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Installs a `tracing` subscriber once (respects `RUST_LOG`, defaults to warnings).
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
}

/// A flow shared by the integration tests and the `crashy_worker` binary.
///
/// Its one step blocks forever in a process that set [`crash_flow::BLOCK`] (only the
/// `crashy_worker` child, which the test kills mid-task), and returns its input doubled otherwise.
/// The switch is process-local state rather than an environment variable, so nothing the test
/// process inherits can make its own worker block. The step timeout is long (10 minutes) so that
/// stalled-task recovery cannot rescue a killed worker's task within a test: only dead-worker
/// recovery (a missing heartbeat) can.
#[pgflow_runtime::flow(slug = "crashFlow", input = i64, timeout = 600)]
pub mod crash_flow {
    use std::sync::atomic::{AtomicBool, Ordering};

    use pgflow_runtime::StepError;

    /// Set by the `crashy_worker` binary at startup: its `work` tasks never finish.
    pub static BLOCK: AtomicBool = AtomicBool::new(false);

    /// Blocks in the crashy child; doubles elsewhere.
    #[step]
    async fn work(n: i64) -> Result<i64, StepError> {
        if BLOCK.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        Ok(n * 2)
    }
}

/// A flow of mixed shapes for the fault tests: two roots, a map over the first root's array, and a join of
/// the map and the second root. Every handler pauses a few milliseconds, so a killed worker is usually in
/// the middle of some. `expected_total(n)` is the `total` a correct run of input `n` produces.
#[pgflow_runtime::flow(slug = "mixedFlow", input = u32, max_attempts = 10, timeout = 30)]
pub mod mixed_flow {
    use std::time::Duration;

    use pgflow_runtime::StepError;

    async fn pause(seed: u32) {
        tokio::time::sleep(Duration::from_millis(u64::from(seed % 7) + 1)).await;
    }

    /// `0..(n % 4 + 1)`.
    #[step]
    async fn split(n: u32) -> Result<Vec<u32>, StepError> {
        pause(n).await;
        Ok((0..n % 4 + 1).collect())
    }

    /// `2 n`.
    #[step]
    async fn side(n: u32) -> Result<u32, StepError> {
        pause(n + 3).await;
        Ok(n * 2)
    }

    /// `x + 1` for every element of `split`.
    #[step(map = split)]
    async fn each(x: u32) -> Result<u32, StepError> {
        pause(x).await;
        Ok(x + 1)
    }

    /// The sum of `each`, plus `side`.
    #[step(depends_on = [each, side])]
    async fn total(each: Vec<u32>, side: u32) -> Result<u32, StepError> {
        pause(side).await;
        Ok(each.iter().sum::<u32>() + side)
    }
}

/// The `total` a correct run of `mixedFlow` with input `n` produces.
pub fn expected_total(n: u32) -> u32 {
    let k = n % 4 + 1;
    k * (k + 1) / 2 + 2 * n
}
