//! The process-wide server, template databases built once, and fresh per-test databases cloned from them.

use std::time::Duration;

use sha2::{Digest, Sha256};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};
use tokio::sync::OnceCell;

use super::{Durability, TempPostgres, ThrowawayError};

/// The server a process uses: `DATABASE_URL`'s, or one [`TempPostgres`] started on first use.
#[derive(Debug)]
pub struct Server {
    admin: PgConnectOptions,
    temp: Option<TempPostgres>,
}

static SERVER: OnceCell<Server> = OnceCell::const_new();

/// The process-wide server: `DATABASE_URL` when set, otherwise a fast [`TempPostgres`].
///
/// # Errors
/// An invalid `DATABASE_URL`, or a throwaway server that cannot start.
pub async fn server() -> Result<&'static Server, ThrowawayError> {
    SERVER
        .get_or_try_init(|| async {
            match std::env::var("DATABASE_URL") {
                Ok(url) if !url.is_empty() => Ok(Server {
                    admin: url.parse::<PgConnectOptions>()?.disable_statement_logging(),
                    temp: None,
                }),
                _ => {
                    let temp = TempPostgres::start(Durability::Fast).await?;
                    Ok(Server {
                        admin: temp.connect_options("postgres"),
                        temp: Some(temp),
                    })
                }
            }
        })
        .await
}

impl Server {
    /// The throwaway cluster, when this server is one.
    pub fn temp(&self) -> Option<&TempPostgres> {
        self.temp.as_ref()
    }

    /// Connection options for database `name` on this server.
    pub fn options(&self, name: &str) -> PgConnectOptions {
        self.admin.clone().database(name)
    }

    /// A connection URL for database `name` on this server.
    pub fn url(&self, name: &str) -> String {
        let o = &self.admin;
        let user = o.get_username();
        let host = o.get_host();
        let port = o.get_port();
        match std::env::var("DATABASE_URL") {
            Ok(url) if self.temp.is_none() && !url.is_empty() => replace_database(&url, name),
            _ => format!("postgres://{user}@{host}:{port}/{name}"),
        }
    }

    async fn admin_connection(&self) -> Result<PgConnection, ThrowawayError> {
        Ok(PgConnection::connect_with(&self.admin).await?)
    }
}

fn replace_database(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let scheme_end = base.find("://").map_or(0, |i| i + 3);
    let path_start = base[scheme_end..].find('/').map(|i| i + scheme_end);
    let mut out = match path_start {
        Some(i) => format!("{}/{name}", &base[..i]),
        None => format!("{base}/{name}"),
    };
    if let Some(query) = query {
        out.push('?');
        out.push_str(query);
    }
    out
}

/// What a fresh database starts with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Contents {
    /// Nothing: an empty database.
    Empty,
    /// PGMQ only (installed as [`crate::ensure_pgmq`] does: the extension, or the `pgmq` crate's
    /// embedded SQL).
    Pgmq,
    /// PGMQ and every pgflow migration of this build.
    Pgflow,
}

/// A database of its own for one test or example, dropped (`WITH (FORCE)`) when this is dropped.
#[derive(Debug)]
pub struct FreshDatabase {
    name: String,
    url: String,
    pool: PgPool,
    admin: PgConnectOptions,
}

impl FreshDatabase {
    /// A pool (up to 10 connections) on this database.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The database's connection URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Connection options for this database.
    pub fn options(&self) -> PgConnectOptions {
        self.admin.clone().database(&self.name)
    }
}

impl Drop for FreshDatabase {
    fn drop(&mut self) {
        let admin = self.admin.clone();
        let name = self.name.clone();
        // Drop may run inside a blocked runtime (or during a panic), so the pool's connections
        // cannot be closed gracefully here: a thread with its own runtime drops the database with
        // FORCE, which ends those connections on the server side.
        let handle = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                if let Ok(mut conn) = PgConnection::connect_with(&admin).await {
                    let _ =
                        sqlx::query(&format!("drop database if exists \"{name}\" with (force)"))
                            .execute(&mut conn)
                            .await;
                    let _ = conn.close().await;
                }
            });
        });
        let _ = handle.join();
    }
}

/// A fresh database with `contents`, cloned from a template built once per server and build.
///
/// # Errors
/// The server cannot be reached or started, or building the template failed.
pub async fn fresh_database(contents: Contents) -> Result<FreshDatabase, ThrowawayError> {
    let server = server().await?;
    let name = format!("pgflow_t_{:016x}", rand::random::<u64>());
    let mut admin = server.admin_connection().await?;
    match contents {
        Contents::Empty => {
            sqlx::query(&format!("create database \"{name}\""))
                .execute(&mut admin)
                .await?;
        }
        Contents::Pgmq | Contents::Pgflow => {
            let template = ensure_template(server, &mut admin, contents).await?;
            create_from_template(&mut admin, &name, &template).await?;
        }
    }
    let _ = admin.close().await;
    let pool = PgPoolOptions::new()
        .max_connections(10)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(server.options(&name))
        .await?;
    Ok(FreshDatabase {
        url: server.url(&name),
        name,
        pool,
        admin: server.admin.clone(),
    })
}

async fn create_from_template(
    admin: &mut PgConnection,
    name: &str,
    template: &str,
) -> Result<(), ThrowawayError> {
    // A template being read by a concurrent clone can make CREATE DATABASE fail with
    // "source database is being accessed by other users"; such clashes are brief, so retry.
    let mut delay = Duration::from_millis(20);
    for attempt in 0.. {
        let result = sqlx::query(&format!(
            "create database \"{name}\" template \"{template}\""
        ))
        .execute(&mut *admin)
        .await;
        match result {
            Ok(_) => return Ok(()),
            Err(sqlx::Error::Database(e))
                if e.code().as_deref() == Some("55006") && attempt < 50 =>
            {
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_millis(500));
            }
            Err(e) => return Err(e.into()),
        }
    }
    unreachable!()
}

/// Builds (once per server, migration set and contents) the template and returns its name.
async fn ensure_template(
    server: &Server,
    admin: &mut PgConnection,
    contents: Contents,
) -> Result<String, ThrowawayError> {
    let mut hasher = Sha256::new();
    hasher.update(format!("{contents:?}"));
    if contents == Contents::Pgflow {
        for migration in crate::MIGRATIONS {
            hasher.update(migration.version);
            hasher.update(migration.sql);
        }
    }
    let digest = hex::encode(hasher.finalize());
    let template = format!("pgflow_tpl_{}", &digest[..16]);
    if template_ready(&mut *admin, &template).await? {
        return Ok(template);
    }
    // Serialise builders across processes; the lock is released when this session ends too.
    let lock_key = i64::from_str_radix(&digest[..15], 16).expect("hex");
    sqlx::query("select pg_advisory_lock($1)")
        .bind(lock_key)
        .execute(&mut *admin)
        .await?;
    let result = async {
        if template_ready(&mut *admin, &template).await? {
            return Ok(());
        }
        // A half-built template from a crashed builder is not marked as a template: rebuild it.
        sqlx::query(&format!(
            "drop database if exists \"{template}\" with (force)"
        ))
        .execute(&mut *admin)
        .await?;
        sqlx::query(&format!("create database \"{template}\""))
            .execute(&mut *admin)
            .await?;
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .connect_with(server.options(&template))
            .await?;
        let installed = match contents {
            Contents::Pgflow => crate::install(&pool).await.map(drop),
            _ => crate::ensure_pgmq(&pool).await.map(drop),
        };
        pool.close().await;
        installed?;
        sqlx::query(&format!(
            "alter database \"{template}\" with is_template true"
        ))
        .execute(&mut *admin)
        .await?;
        Ok::<(), ThrowawayError>(())
    }
    .await;
    sqlx::query("select pg_advisory_unlock($1)")
        .bind(lock_key)
        .execute(&mut *admin)
        .await?;
    result.map(|()| template)
}

async fn template_ready(admin: &mut PgConnection, template: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "select exists (select 1 from pg_database where datname = $1 and datistemplate)",
    )
    .bind(template)
    .fetch_one(admin)
    .await
}
