//! How the runtime's pool reaches PostgreSQL: directly, or through a transaction pooler such as
//! PgBouncer in `pool_mode = transaction`.
//!
//! Behind a transaction pooler, consecutive transactions of one client connection may run on different
//! server connections, and server connections pass from client to client. Named prepared statements (what
//! sqlx uses by default, even with a statement cache of 0) then collide (`42P05 prepared statement
//! "sqlx_s_1" already exists`) or go missing, session state does not last, and `LISTEN` hears nothing.
//! In [`Pooling::Transaction`] mode every statement the runtime sends is an unnamed statement inside a
//! transaction of its own, so it needs nothing to survive past its transaction; queue signals and run
//! notifications are not listened for (waits poll), unless a direct connection for `LISTEN` is given.
//! The direct mode is unchanged: cached named statements, one round trip per call.

use sqlx::postgres::PgConnectOptions;

/// How the pool given to a worker or a client reaches PostgreSQL.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub enum Pooling {
    /// Direct connections, or a pooler in session mode: named prepared statements are cached per
    /// connection, and `LISTEN` runs on a connection of the pool's. The default.
    #[default]
    Direct,
    /// A pooler in transaction mode (PgBouncer `pool_mode = transaction`): no named prepared statements,
    /// no session state. Each statement is unnamed and runs in its own transaction (two more round trips
    /// than in the direct mode).
    Transaction {
        /// A direct connection (bypassing the pooler) for `LISTEN`: one per worker, and one per client
        /// while it waits. `None`: nothing listens, and idle workers and waits poll (a worker's pick-up
        /// of new work is then bounded by `max_poll_wait`, a wait's by the client's poll fallback).
        listen: Option<Box<PgConnectOptions>>,
    },
}

impl Pooling {
    /// A transaction pooler, without a direct connection for `LISTEN` (idle workers and waits poll).
    pub fn transaction() -> Self {
        Pooling::Transaction { listen: None }
    }

    /// A transaction pooler, with a direct connection for `LISTEN`.
    pub fn transaction_with_listen(direct: PgConnectOptions) -> Self {
        Pooling::Transaction {
            listen: Some(Box::new(direct)),
        }
    }

    /// Whether statements must not rely on anything surviving their transaction.
    pub fn is_transaction(&self) -> bool {
        matches!(self, Pooling::Transaction { .. })
    }

    /// Where to `LISTEN`: `None` when nothing may listen (a transaction pooler without a direct
    /// connection); `Some(None)` on the pool; `Some(Some(options))` on a direct connection.
    pub(crate) fn listen_on(&self) -> Option<Option<&PgConnectOptions>> {
        match self {
            Pooling::Direct => Some(None),
            Pooling::Transaction { listen } => listen.as_deref().map(Some),
        }
    }
}

/// Runs `$query.$method(executor)` (a future of `Result<_, sqlx::Error>`) on `$conn` (a `&PgPool` or a
/// `&mut PgConnection`): as it is when `$pooled` is false; otherwise as an unnamed statement inside a
/// transaction of its own, so nothing has to outlive the transaction behind a transaction pooler.
macro_rules! run {
    ($pooled:expr, $conn:expr, $query:expr, $method:ident) => {
        async {
            if $pooled {
                let mut tx = sqlx::Acquire::begin($conn).await?;
                let out = $query.persistent(false).$method(&mut *tx).await?;
                tx.commit().await?;
                Ok::<_, sqlx::Error>(out)
            } else {
                $query.$method($conn).await
            }
        }
    };
}
pub(crate) use run;
