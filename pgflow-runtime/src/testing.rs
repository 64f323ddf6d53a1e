//! Helpers to test your own flows (feature `testing`): a throwaway database per test with pgflow
//! installed, a run to completion with an in-process worker, and a context to call a step handler as a
//! plain async function.
//!
//! Add the feature in your `[dev-dependencies]`:
//! `pgflow-runtime = { version = "0.1", features = ["testing"] }`. The database is a real PostgreSQL with
//! real PGMQ: the server in `DATABASE_URL` (whose user may create databases), or, when it is unset, a
//! throwaway cluster started from the PostgreSQL server binaries on `PATH` or in the usual install
//! directories, removed when the test process exits.
//!
//! ```no_run
//! # mod demo {
//! use pgflow_runtime::prelude::*;
//! use pgflow_runtime::testing;
//!
//! #[flow(slug = "greet", input = String)]
//! pub mod greet {
//!     use super::*;
//!
//!     #[step]
//!     async fn hello(name: String) -> Result<String, StepError> {
//!         Ok(format!("hello {name}"))
//!     }
//!
//!     #[cfg(test)]
//!     mod tests {
//!         use super::*;
//!
//!         #[tokio::test]
//!         async fn hello_greets() {
//!             // A step handler is a plain async function.
//!             assert_eq!(hello("Ada".into()).await.unwrap(), "hello Ada");
//!         }
//!     }
//! }
//!
//! async fn whole_flow() -> Result<(), Box<dyn std::error::Error>> {
//!     let db = testing::database().await?;
//!     let out = testing::run::<greet::Greet>(db.pool(), &"Ada".to_owned()).await?;
//!     assert_eq!(out.hello, "hello Ada");
//!     Ok(())
//! }
//! # }
//! # fn main() {}
//! ```

use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

pub use pgflow_sql::throwaway::{FreshDatabase as TestDatabase, ThrowawayError};

use crate::client::{ClientError, WaitError};
use crate::worker::WorkerError;
use crate::{Client, Flow, StepContext, Worker};

/// How long [`run`] waits for a run to finish.
pub const RUN_TIMEOUT: Duration = Duration::from_secs(30);

/// A fresh database of its own for one test, with PGMQ and pgflow installed; dropped with the value.
///
/// # Errors
///
/// [`ThrowawayError`] when no database can be provided: `DATABASE_URL` is invalid or its user may not
/// create databases, or (with it unset) the PostgreSQL server binaries are missing; the message says
/// which package to install.
pub async fn database() -> Result<TestDatabase, ThrowawayError> {
    pgflow_sql::throwaway::fresh_database(pgflow_sql::throwaway::Contents::Pgflow).await
}

/// Why [`run`] gave no output.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TestRunError {
    /// The in-process worker refused to start or failed.
    #[error("the test worker failed: {0}")]
    Worker(#[from] WorkerError),
    /// The run could not be started.
    #[error("the run could not start: {0}")]
    Start(#[from] ClientError),
    /// The run failed, timed out, or its output did not decode.
    #[error("the run did not complete: {0}")]
    Wait(#[from] WaitError),
}

/// Starts a run of `F` with `input`, runs it to completion with an in-process worker, and returns its
/// typed output (waiting at most [`RUN_TIMEOUT`]). The worker compiles `F` into the database first, and
/// is stopped before this returns.
///
/// # Errors
///
/// [`TestRunError`]: the worker refused to start, the run could not start, or it failed or timed out.
pub async fn run<F: Flow>(pool: &PgPool, input: &F::Input) -> Result<F::Output, TestRunError> {
    run_with_timeout::<F>(pool, input, RUN_TIMEOUT).await
}

/// As [`run`], waiting at most `timeout`.
///
/// # Errors
///
/// As [`run`].
pub async fn run_with_timeout<F: Flow>(
    pool: &PgPool,
    input: &F::Input,
    timeout: Duration,
) -> Result<F::Output, TestRunError> {
    let worker = Worker::<F>::builder(pool.clone())
        .poll_interval(Duration::from_millis(10))
        .max_poll_wait(Duration::from_millis(100))
        .shutdown_grace(Duration::from_secs(5))
        .build()
        .map_err(|e| TestRunError::Worker(WorkerError::from(e)))?
        .spawn(CancellationToken::new())
        .await?;
    let outcome = async {
        let run = Client::new(pool.clone()).start::<F>(input).await?;
        Ok::<_, TestRunError>(run.wait(timeout).await?)
    }
    .await;
    let stopped = worker.stop().await;
    let output = outcome?;
    stopped?;
    Ok(output)
}

/// A context for calling a step handler directly: a new run id, attempt 1, task 0, never cancelled. Its
/// [`StepContext::flow_input`] reads the run from `pool` unless set with
/// [`StepContext::with_flow_input`].
pub fn context<F: Flow>(pool: &PgPool, step: F::Step) -> StepContext<F> {
    StepContext::new(Uuid::new_v4(), step, pool.clone())
}
