//! The pgflow SQL core as versioned, checksummed migrations, and the installer that applies them.
//!
//! The readable source of the SQL is `pgflow-sql/schema/`: one file per concern, each function
//! defined once with its security and plan settings ([`SCHEMA`]). What the installer applies are the
//! migrations in `pgflow-sql/migrations/`: a baseline that installs what `schema/` installed when it
//! was created, then one delta per change since ([`MIGRATIONS`]). A test proves that both install
//! the same catalog; `schema/README.md` has the workflow for the next change. Each file applies with
//! `psql -v ON_ERROR_STOP=1 -f FILE` on a database that already has PGMQ; nothing is templated from
//! Rust. [`install`] first makes sure PGMQ is present, then applies the pending migrations and
//! records each version and checksum in `pgflow.schema_migrations`.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), pgflow_sql::InstallError> {
//! let report = pgflow_sql::install(&pool).await?;
//! println!("applied {} migration(s)", report.applied.len());
//! # Ok(()) }
//! ```
//!
//! Teams that apply SQL through their own migration tool can take the complete script from
//! [`install_script`] (or `cargo run -p pgflow-sql -- script`).
//!
//! [`names`] states the slug and queue-name rules of this SQL in plain Rust; [`SqlState`] names the SQLSTATE
//! codes it raises. The installer is the
//! default feature `install`; without it the crate depends on nothing but `thiserror`.

#[cfg(feature = "install")]
mod legacy;
pub mod names;
mod sqlstate;
#[cfg(feature = "throwaway")]
pub mod throwaway;

pub use sqlstate::SqlState;

#[cfg(feature = "install")]
use sha2::{Digest, Sha256};
#[cfg(feature = "install")]
use sqlx::{Connection, PgConnection, PgPool};

/// One embedded migration file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Migration {
    /// Four-digit version, the file-name prefix (`0001`).
    pub version: &'static str,
    /// The topic part of the file name (`pgflow_schema`).
    pub name: &'static str,
    /// The SQL text, exactly as in the file.
    pub sql: &'static str,
}

impl Migration {
    /// The SHA-256 of the SQL text, lowercase hex. Recorded when applied; compared on every install.
    #[cfg(feature = "install")]
    pub fn checksum(&self) -> String {
        hex::encode(Sha256::digest(self.sql.as_bytes()))
    }

    /// The file name this migration came from.
    pub fn file_name(&self) -> String {
        format!("{}_{}.sql", self.version, self.name)
    }
}

/// Every migration of this build, in the order they apply.
pub const MIGRATIONS: &[Migration] = include!(concat!(env!("OUT_DIR"), "/migrations.rs"));

/// One file of `pgflow-sql/schema/`, the readable source of the SQL core.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchemaFile {
    /// The file name (`07_claims.sql`).
    pub name: &'static str,
    /// The SQL text, exactly as in the file.
    pub sql: &'static str,
}

/// Every file of `pgflow-sql/schema/`, in name order. Applied in this order after PGMQ, they install
/// exactly what [`MIGRATIONS`] install (the equality test in `tests/tests/install.rs` checks it).
pub const SCHEMA: &[SchemaFile] = include!(concat!(env!("OUT_DIR"), "/schema.rs"));

/// The files of [`SCHEMA`] as one script, after the installer's bookkeeping table, so that a database
/// built from it has the same catalog as one built from the migrations (PGMQ excluded). For tests
/// and for reading; installs go through [`install`], which applies [`MIGRATIONS`].
pub fn schema_script() -> String {
    let mut script = String::from(CREATE_MIGRATIONS_TABLE);
    for file in SCHEMA {
        script.push_str(&format!("\n-- ==== schema/{} ====\n", file.name));
        script.push_str(file.sql);
    }
    script
}

/// The newest migration version this build knows.
pub fn latest_version() -> &'static str {
    MIGRATIONS.last().map_or("0000", |m| m.version)
}

/// Key of the transaction-scoped advisory lock that serialises concurrent installs.
/// (`hashtext('pgflow-rs install')` would do too; a constant keeps it visible in `pg_locks`.)
pub const INSTALL_LOCK_KEY: i64 = 0x7067_666c_6f77; // "pgflow"

/// What an install did.
#[cfg(feature = "install")]
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct InstallReport {
    /// How PGMQ was found or installed.
    pub pgmq: PgmqStatus,
    /// Versions applied by this call, in order. Empty when the schema was already current.
    pub applied: Vec<String>,
    /// True when this call found the final state of the unreleased development migrations 0001–0030
    /// and recorded it as the baseline (their catalogs are identical) before applying the rest.
    pub upgraded_development_schema: bool,
}

/// How [`install`] found PGMQ.
#[cfg(feature = "install")]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum PgmqStatus {
    /// PGMQ was already installed (as an extension or as plain SQL).
    #[default]
    AlreadyPresent,
    /// `CREATE EXTENSION pgmq` installed it.
    CreatedExtension,
    /// PGMQ's own SQL was installed through the `pgmq` crate's embedded installer.
    InstalledEmbeddedSql,
}

/// Why an install failed.
#[cfg(feature = "install")]
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InstallError {
    /// The database could not be reached or a bookkeeping query failed.
    #[error("pgflow install: database error: {0}")]
    Database(#[from] sqlx::Error),
    /// A prepared statement went missing or collided (`42P05`, `26000`): the connection goes through a
    /// pooler in transaction mode, and installing needs a direct connection.
    #[error(
        "pgflow install: {0}; this happens behind a connection pooler in transaction mode (PgBouncer \
         `pool_mode = transaction`): installing runs DDL with prepared statements and needs a direct \
         connection to the server, so install with a URL that bypasses the pooler (e.g. port 5432 instead \
         of 6432), then point workers and clients at the pooler with `Pooling::transaction()`"
    )]
    ThroughPooler(sqlx::Error),
    /// PGMQ's embedded SQL failed to install.
    #[error("pgflow install: installing PGMQ from the pgmq crate's embedded SQL failed: {0}")]
    Pgmq(String),
    /// The connection form cannot install PGMQ from embedded SQL (the pgmq crate needs a pool).
    #[error(
        "pgflow install: PGMQ is not installed and the server offers no `pgmq` extension; \
         call `pgflow_sql::install(&pool)` (which installs PGMQ's SQL itself) or install PGMQ first"
    )]
    PgmqMissing,
    /// The database has migrations this build does not know: it was installed by newer code.
    #[error(
        "pgflow install: the database's pgflow schema is newer than this build \
         (unknown applied migration(s) {unknown:?}; this build knows up to {latest}); \
         upgrade pgflow-rs instead of running older code against it"
    )]
    SchemaNewer {
        /// Applied versions this build does not have.
        unknown: Vec<String>,
        /// The newest version this build has.
        latest: String,
    },
    /// An applied migration's checksum differs from this build's file: someone edited it.
    #[error(
        "pgflow install: migration {version} ({name}) was modified after it was applied \
         (database checksum {applied_checksum}, file checksum {file_checksum}); \
         applied migrations are immutable: restore the original file and add a new migration instead"
    )]
    ModifiedMigration {
        /// Version of the modified migration.
        version: String,
        /// Topic name of the modified migration.
        name: String,
        /// Checksum recorded when it was applied.
        applied_checksum: String,
        /// Checksum of the file in this build.
        file_checksum: String,
    },
    /// The database was installed by the unreleased development migrations that the baseline
    /// replaced, but not exactly by their final set: it cannot be upgraded in place.
    #[error(
        "pgflow install: the database's pgflow schema was installed by unreleased development migrations \
         ({found:?}) that are not exactly the 30 whose final state the baseline equals (0001..0030, \
         unmodified), so it cannot be upgraded in place and nothing was changed; either install it first \
         with the pgflow-rs release that wrote those migrations (it finishes them up to 0030) and run this \
         installer again, or, if its runs and flows can be lost, `drop schema pgflow cascade` and install \
         again"
    )]
    DevelopmentSchema {
        /// The recorded migrations, as `NNNN_name`.
        found: Vec<String>,
    },
    /// A migration's SQL failed.
    #[error("pgflow install: migration {file} failed: {source}")]
    Migration {
        /// The migration file name.
        file: String,
        /// The database error, with MESSAGE / DETAIL / HINT when the server sent them.
        #[source]
        source: sqlx::Error,
    },
}

/// Install or upgrade pgflow (and PGMQ when missing) on the database behind `pool`.
///
/// Idempotent, and safe when several processes call it at once.
///
/// # Errors
/// See [`InstallError`]: a database newer than this build, a modified applied migration, a failing
/// migration, or a database error.
#[cfg(feature = "install")]
pub async fn install(pool: &PgPool) -> Result<InstallReport, InstallError> {
    install_with_pool(pool)
        .await
        .map_err(InstallError::behind_pooler)
}

#[cfg(feature = "install")]
impl InstallError {
    /// A prepared-statement collision or loss becomes [`InstallError::ThroughPooler`].
    fn behind_pooler(self) -> Self {
        let pooled = |e: &sqlx::Error| {
            matches!(
                e.as_database_error().and_then(|d| d.code()).as_deref(),
                Some("42P05" | "26000")
            )
        };
        match self {
            InstallError::Database(e) | InstallError::Migration { source: e, .. } if pooled(&e) => {
                InstallError::ThroughPooler(e)
            }
            other => other,
        }
    }
}

#[cfg(feature = "install")]
async fn install_with_pool(pool: &PgPool) -> Result<InstallReport, InstallError> {
    let pgmq = ensure_pgmq(pool).await?;
    let mut conn = pool.acquire().await?;
    let (applied, upgraded_development_schema) = apply_migrations(&mut conn).await?;
    Ok(InstallReport {
        pgmq,
        applied,
        upgraded_development_schema,
    })
}

/// Make sure PGMQ is installed on the database behind `pool`, and nothing else: `CREATE EXTENSION
/// pgmq` when the server offers the extension, otherwise the `pgmq` crate's embedded SQL.
/// [`install`] starts with this.
///
/// # Errors
/// A database error, or [`InstallError::Pgmq`] when the embedded SQL fails.
#[cfg(feature = "install")]
pub async fn ensure_pgmq(pool: &PgPool) -> Result<PgmqStatus, InstallError> {
    let status = {
        let mut conn = pool.acquire().await?;
        ensure_pgmq_extension(&mut conn).await?
    };
    match status {
        Some(status) => Ok(status),
        None => {
            pgmq::install::install_sql_from_embedded(pool)
                .await
                .map_err(|e| InstallError::Pgmq(e.to_string()))?;
            Ok(PgmqStatus::InstalledEmbeddedSql)
        }
    }
}

/// Install or upgrade pgflow over one connection, or inside the caller's transaction
/// (`install_on(&mut *tx)`; the work then commits or rolls back with it).
///
/// PGMQ must already be installed or be available as an extension: the `pgmq` crate's embedded
/// installer only works on a pool, so use [`install`] when PGMQ has to be installed from SQL.
///
/// # Errors
/// As [`install`], plus [`InstallError::PgmqMissing`].
#[cfg(feature = "install")]
pub async fn install_on(conn: &mut PgConnection) -> Result<InstallReport, InstallError> {
    let pgmq = ensure_pgmq_extension(conn)
        .await?
        .ok_or(InstallError::PgmqMissing)?;
    let (applied, upgraded_development_schema) = apply_migrations(conn).await?;
    Ok(InstallReport {
        pgmq,
        applied,
        upgraded_development_schema,
    })
}

/// The versions recorded in `pgflow.schema_migrations`, oldest first; empty when pgflow is absent.
///
/// # Errors
/// A database error.
#[cfg(feature = "install")]
pub async fn applied_versions(conn: &mut PgConnection) -> Result<Vec<String>, InstallError> {
    let exists: bool =
        sqlx::query_scalar("select to_regclass('pgflow.schema_migrations') is not null")
            .persistent(false)
            .fetch_one(&mut *conn)
            .await?;
    if !exists {
        return Ok(Vec::new());
    }
    Ok(
        sqlx::query_scalar("select version from pgflow.schema_migrations order by version")
            .persistent(false)
            .fetch_all(&mut *conn)
            .await?,
    )
}

/// Returns `Some(status)` when PGMQ is present afterwards, `None` when only embedded SQL can help.
#[cfg(feature = "install")]
async fn ensure_pgmq_extension(
    conn: &mut PgConnection,
) -> Result<Option<PgmqStatus>, InstallError> {
    if pgmq_present(conn).await? {
        return Ok(Some(PgmqStatus::AlreadyPresent));
    }
    let available: bool = sqlx::query_scalar(
        "select exists (select 1 from pg_available_extensions where name = 'pgmq')",
    )
    .fetch_one(&mut *conn)
    .await?;
    if !available {
        return Ok(None);
    }
    let mut tx = conn.begin().await?;
    sqlx::query("select pg_advisory_xact_lock($1)")
        .bind(INSTALL_LOCK_KEY)
        .execute(&mut *tx)
        .await?;
    sqlx::query("create extension if not exists pgmq")
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(Some(PgmqStatus::CreatedExtension))
}

#[cfg(feature = "install")]
async fn pgmq_present(conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("select to_regclass('pgmq.meta') is not null")
        .fetch_one(conn)
        .await
}

const CREATE_MIGRATIONS_TABLE: &str = "\
create schema if not exists pgflow;
create table if not exists pgflow.schema_migrations (
  version text primary key,
  name text not null,
  checksum text not null,
  applied_at timestamptz not null default now()
);";

#[cfg(feature = "install")]
async fn apply_migrations(conn: &mut PgConnection) -> Result<(Vec<String>, bool), InstallError> {
    let mut tx = conn.begin().await?;
    sqlx::query("select pg_advisory_xact_lock($1)")
        .bind(INSTALL_LOCK_KEY)
        .execute(&mut *tx)
        .await?;
    sqlx::Executor::execute(&mut *tx, sqlx::raw_sql(CREATE_MIGRATIONS_TABLE)).await?;
    let mut recorded: Vec<(String, String, String)> = sqlx::query_as(
        "select version, name, checksum from pgflow.schema_migrations order by version",
    )
    .fetch_all(&mut *tx)
    .await?;
    let upgraded = legacy::is_development_schema(&recorded)?;
    if upgraded {
        recorded = legacy::record_as_baseline(&mut tx).await?;
    }

    let unknown: Vec<String> = recorded
        .iter()
        .filter(|(version, _, _)| !MIGRATIONS.iter().any(|m| m.version == version))
        .map(|(version, name, _)| format!("{version}_{name}"))
        .collect();
    if !unknown.is_empty() {
        return Err(InstallError::SchemaNewer {
            unknown,
            latest: latest_version().to_owned(),
        });
    }
    for (version, _, applied_checksum) in &recorded {
        let migration = MIGRATIONS
            .iter()
            .find(|m| m.version == version)
            .expect("checked above");
        let file_checksum = migration.checksum();
        if *applied_checksum != file_checksum {
            return Err(InstallError::ModifiedMigration {
                version: version.clone(),
                name: migration.name.to_owned(),
                applied_checksum: applied_checksum.clone(),
                file_checksum,
            });
        }
    }

    let mut applied = Vec::new();
    for migration in MIGRATIONS {
        if recorded
            .iter()
            .any(|(version, _, _)| version == migration.version)
        {
            continue;
        }
        sqlx::Executor::execute(&mut *tx, sqlx::raw_sql(migration.sql))
            .await
            .map_err(|source| InstallError::Migration {
                file: migration.file_name(),
                source,
            })?;
        sqlx::query(
            "insert into pgflow.schema_migrations (version, name, checksum) values ($1, $2, $3)",
        )
        .bind(migration.version)
        .bind(migration.name)
        .bind(migration.checksum())
        .execute(&mut *tx)
        .await?;
        tracing::info!(
            version = migration.version,
            name = migration.name,
            "applied pgflow migration"
        );
        applied.push(migration.version.to_owned());
    }
    tx.commit().await?;
    Ok((applied, upgraded))
}

/// The complete pgflow install script (PGMQ excluded), for teams that apply SQL through their own
/// migration tool. Apply it with `psql -1 -v ON_ERROR_STOP=1 -f pgflow.sql` on a database that has
/// PGMQ. It records every version and checksum in `pgflow.schema_migrations`, exactly as [`install`]
/// does, so a later [`install`] by this or newer code recognises the schema.
#[cfg(feature = "install")]
pub fn install_script() -> String {
    let mut script = String::new();
    script.push_str(&format!(
        "-- pgflow-rs SQL core, complete install script (migrations 0001..{}).\n\
         -- Requires PGMQ in schema pgmq. Apply in one transaction: psql -1 -v ON_ERROR_STOP=1 -f FILE\n\n",
        latest_version()
    ));
    script.push_str(&format!(
        "select pg_advisory_xact_lock({INSTALL_LOCK_KEY});\n"
    ));
    script.push_str(CREATE_MIGRATIONS_TABLE);
    script.push_str("\n\n");
    for migration in MIGRATIONS {
        script.push_str(&format!("-- ==== {} ====\n", migration.file_name()));
        script.push_str(migration.sql);
        if !migration.sql.ends_with('\n') {
            script.push('\n');
        }
        script.push_str(&format!(
            "insert into pgflow.schema_migrations (version, name, checksum) values ('{}', '{}', '{}');\n\n",
            migration.version,
            migration.name,
            migration.checksum()
        ));
    }
    script
}

#[cfg(all(test, feature = "install"))]
mod tests {
    use super::*;

    /// Install futures must be `Send`, so callers can `tokio::spawn` them.
    #[allow(dead_code)]
    fn install_futures_are_send(pool: &'static PgPool, conn: &'static mut PgConnection) {
        fn is_send<T: Send>(_: T) {}
        is_send(install(pool));
        is_send(ensure_pgmq(pool));
        is_send(install_on(conn));
    }

    #[test]
    fn migrations_are_ordered_and_uniquely_versioned() {
        let versions: Vec<_> = MIGRATIONS.iter().map(|m| m.version).collect();
        let mut sorted = versions.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(versions, sorted);
        assert_eq!(MIGRATIONS[0].file_name(), "0001_baseline.sql");
    }

    #[test]
    fn the_install_script_records_every_migration() {
        let script = install_script();
        for migration in MIGRATIONS {
            assert!(script.contains(&migration.checksum()));
            assert!(script.contains(migration.sql));
        }
    }
}
