//! Zero configuration: the pool a worker opens on `DATABASE_URL`, sized from its settings.

use std::str::FromStr;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

use super::error::{Context, WorkerError};
use crate::config::WorkerConfig;

/// The environment variable a zero-configuration worker connects with.
pub(crate) const DATABASE_URL: &str = "DATABASE_URL";

/// Opens a pool of [`WorkerConfig::pool_size`] connections on `DATABASE_URL`.
pub(crate) async fn from_env(config: &WorkerConfig) -> Result<PgPool, WorkerError> {
    let url = match std::env::var(DATABASE_URL) {
        Ok(url) if !url.trim().is_empty() => url,
        Ok(_) | Err(std::env::VarError::NotPresent) => return Err(WorkerError::DatabaseUrlMissing),
        Err(std::env::VarError::NotUnicode(_)) => {
            return Err(WorkerError::DatabaseUrlInvalid {
                reason: "it is not valid UTF-8".to_owned(),
            })
        }
    };
    let options = parse(&url)?;
    let size = config.pool_size();
    tracing::info!(
        connections = size,
        "connecting with DATABASE_URL (zero configuration)"
    );
    PgPoolOptions::new()
        .max_connections(size)
        .connect_with(options)
        .await
        .during("connecting with DATABASE_URL")
}

/// Parses a PostgreSQL URL; the error never repeats the value (it may hold a password).
fn parse(url: &str) -> Result<PgConnectOptions, WorkerError> {
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err(WorkerError::DatabaseUrlInvalid {
            reason: "it does not start with postgres:// or postgresql://".to_owned(),
        });
    }
    PgConnectOptions::from_str(url).map_err(|e| WorkerError::DatabaseUrlInvalid {
        reason: match e {
            sqlx::Error::Configuration(cause) => cause.to_string(),
            _ => "it cannot be parsed".to_owned(),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_of_another_scheme_is_refused_without_repeating_it() {
        let err = parse("mysql://user:hunter2@host/db").unwrap_err();
        let text = err.to_string();
        assert!(text.contains("DATABASE_URL"), "{text}");
        assert!(!text.contains("hunter2"), "{text}");
    }

    #[test]
    fn a_postgres_url_parses() {
        assert!(parse("postgres://user:pw@localhost:5432/app").is_ok());
        assert!(parse("postgresql://localhost/app?sslmode=disable").is_ok());
    }
}
