//! A web dashboard for pgflow-rs: an [`axum::Router`] an application mounts with [`Router::nest`], or serves
//! on its own ([`Dashboard::serve`], what `pgflow dashboard --listen` runs).
//!
//! Server-rendered HTML (maud, so every value is HTML-escaped) with a few lines of vendored JavaScript that
//! refresh each page's live part; no CDN, it works offline. Views:
//!
//! - **Runs** (`/runs`): filters by flow or alias, version, status, start-time range and an input value at a
//!   JSON path; counts per status; keyset pages.
//! - **Run** (`/runs/{id}`): the DAG as SVG coloured by step state with map progress k/N, each task's
//!   attempts on a timeline (queued, started, finished, worker and error of each; earlier attempts hatched),
//!   input, output and errors; cancel, retry and replay.
//! - **Queues** (`/queues`): depth, oldest message, claims and completions per minute, routes with work and
//!   no worker, disabled worker functions.
//! - **Workers** (`/workers`): live workers and heartbeats, the queues and versions each serves, aliases with
//!   their versions and whether each is retirable.
//! - **Schedules** (`/schedules`): what the database's schedules look like, when the schema has them.
//!
//! Safety: read-only unless built with [`Dashboard::write_token`]. Writes need a session opened with that
//! token (`/login`), a confirmation page, a CSRF token derived from the write credential, and a same-origin
//! request (`Sec-Fetch-Site`/`Origin`); each one is recorded in `pgflow.operator_actions` (who, what, when,
//! outcome). [`Dashboard::hide_payloads`] keeps run inputs and outputs in the database.
//!
//! ```no_run
//! # async fn example(pool: sqlx::PgPool) -> std::io::Result<()> {
//! use pgflow_dashboard::Dashboard;
//!
//! // Mounted in an application:
//! let app: axum::Router = axum::Router::new().nest("/pgflow", Dashboard::new(pool.clone()).router());
//! // Or served alone, with writes allowed to holders of the token:
//! Dashboard::new(pool).write_token("s3cret").serve("127.0.0.1:8080".parse().unwrap()).await
//! # }
//! ```

mod auth;
mod dag;
mod pages;
mod routes;

use std::net::SocketAddr;
use std::sync::Arc;

use pgflow_runtime::admin::Admin;
use pgflow_runtime::pooling::Pooling;
use pgflow_runtime::Client;
use sqlx::PgPool;

pub use axum::Router;

/// The dashboard's configuration; [`Dashboard::router`] builds it into a router.
#[derive(Debug, Clone)]
pub struct Dashboard {
    pool: PgPool,
    write_token: Option<String>,
    hide_payloads: bool,
    pooling: Pooling,
}

impl Dashboard {
    /// A read-only dashboard over `pool`, with payloads shown and direct connections.
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            write_token: None,
            hide_payloads: false,
            pooling: Pooling::default(),
        }
    }

    /// Allows write actions (cancel, retry, replay, schedule pause and resume) to operators who sign in with
    /// this token. Without it the dashboard shows no write controls and refuses every write request.
    #[must_use]
    pub fn write_token(mut self, token: impl Into<String>) -> Self {
        let token = token.into();
        self.write_token = (!token.is_empty()).then_some(token);
        self
    }

    /// With `true`, no run input, step output or task output is read from the database or shown.
    #[must_use]
    pub fn hide_payloads(mut self, hide: bool) -> Self {
        self.hide_payloads = hide;
        self
    }

    /// How the pool reaches Postgres ([`Pooling::transaction`] behind PgBouncer in transaction mode).
    #[must_use]
    pub fn pooling(mut self, pooling: Pooling) -> Self {
        self.pooling = pooling;
        self
    }

    /// The dashboard as a router, to serve or to mount with [`Router::nest`] (links follow the mount point).
    pub fn router(self) -> Router {
        let admin = Admin::new(self.pool.clone())
            .hide_payloads(self.hide_payloads)
            .with_pooling(self.pooling.clone());
        let client = Client::new(self.pool).with_pooling(self.pooling);
        routes::router(Arc::new(routes::AppState {
            admin,
            client,
            write: self.write_token.map(auth::WriteAuth::new),
        }))
    }

    /// Serves the dashboard on `addr` until the process ends.
    ///
    /// # Errors
    ///
    /// The address cannot be bound, or the server fails.
    pub async fn serve(self, addr: SocketAddr) -> std::io::Result<()> {
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("pgflow dashboard: cannot listen on {addr}: {e}"),
            )
        })?;
        tracing::info!(%addr, "pgflow dashboard listening");
        axum::serve(listener, self.router()).await
    }
}
