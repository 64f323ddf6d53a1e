//! A throwaway PostgreSQL for tests, examples and benchmarks, and cheap fresh databases on it.
//!
//! Two parts:
//!
//! - [`TempPostgres`] (in `cluster`) supervises one server process: `initdb` in a temp directory,
//!   start on 127.0.0.1 as an unprivileged OS user when this process is root (PostgreSQL refuses
//!   root), [`restart`](TempPostgres::restart) on the same data and port, and removal when it is
//!   dropped or when this process exits in any way, a panic or a `SIGKILL` included: a small reaper
//!   process watches a pipe from this process and stops the server and deletes the directory once
//!   the pipe closes.
//! - [`server`] and [`fresh_database`] (in `databases`) give the process one server (the one in
//!   `DATABASE_URL` when it is set, otherwise a [`TempPostgres`] started on first use) and clone
//!   databases from a template that already has PGMQ and pgflow installed, so a new database costs
//!   milliseconds.
//! - [`TempPgBouncer`] (in `bouncer`) puts a PgBouncer in transaction pooling mode in front of a server,
//!   for tests of deployments behind a pooler.

use std::time::Duration;

mod bouncer;
mod cluster;
mod databases;

pub use bouncer::TempPgBouncer;
pub use cluster::{Durability, TempPostgres};
pub use databases::{fresh_database, server, Contents, FreshDatabase, Server};

/// Why a throwaway server or database could not be provided.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ThrowawayError {
    /// No PostgreSQL server binaries were found.
    #[error(
        "no PostgreSQL server binaries (initdb and postgres) found in PATH or /usr/lib/postgresql/*/bin; \
         install them (Debian/Ubuntu: `apt-get install -y postgresql`) or set DATABASE_URL to an existing server"
    )]
    NoBinaries,
    /// Running a PostgreSQL program or preparing its directory failed.
    #[error("throwaway postgres: {what}: {detail}")]
    Setup {
        /// The step that failed.
        what: String,
        /// What went wrong, including the program's output when there was some.
        detail: String,
    },
    /// The server did not accept connections in time.
    #[error("throwaway postgres did not accept connections within {0:?}; its log:\n{1}")]
    NotReady(Duration, String),
    /// A database operation failed.
    #[error("throwaway postgres: database error: {0}")]
    Database(#[from] sqlx::Error),
    /// Installing PGMQ or pgflow into the template failed.
    #[error("throwaway postgres: installing into the template failed: {0}")]
    Install(#[from] crate::InstallError),
}

fn setup_err(what: impl Into<String>, detail: impl ToString) -> ThrowawayError {
    ThrowawayError::Setup {
        what: what.into(),
        detail: detail.to_string(),
    }
}
