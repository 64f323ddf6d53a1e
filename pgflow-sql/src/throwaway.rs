//! A throwaway PostgreSQL for tests, examples and benchmarks, and cheap fresh databases on it.
//!
//! [`server`] gives the process one server: the one in `DATABASE_URL` when it is set, otherwise a
//! [`TempPostgres`] cluster started on first use. [`fresh_database`] then clones a template
//! database that already has PGMQ and pgflow installed, so a new database costs milliseconds.
//!
//! A [`TempPostgres`] lives in a temp directory, listens on 127.0.0.1 only, runs as an unprivileged
//! OS user when this process is root (PostgreSQL refuses root), and is removed when it is dropped
//! or when this process exits in any way, a panic or a `SIGKILL` included: a small reaper process
//! watches a pipe from this process and stops the server and deletes the directory once the pipe
//! closes.

use std::io::Write as _;
use std::os::unix::fs::chown;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};
use tokio::sync::OnceCell;

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

/// Server settings for a [`TempPostgres`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// The PostgreSQL defaults (`fsync`, `synchronous_commit` on): for examples and benchmarks.
    Durable,
    /// `fsync`, `synchronous_commit` and `full_page_writes` off: for tests, where a crash loses
    /// nothing of value.
    Fast,
}

/// A PostgreSQL cluster in a temp directory, removed when dropped or when the process exits.
#[derive(Debug)]
pub struct TempPostgres {
    root: PathBuf,
    port: u16,
    reaper: Mutex<Option<(Child, ChildStdin)>>,
    server: Mutex<Option<Child>>,
}

impl TempPostgres {
    /// `initdb` a new cluster and start it on a free 127.0.0.1 port.
    ///
    /// # Errors
    /// No server binaries, a failing `initdb`, or a server that does not come up.
    pub async fn start(durability: Durability) -> Result<Self, ThrowawayError> {
        let bin = find_binaries()?;
        let run_as = unprivileged_user()?;
        let root = tempfile::Builder::new()
            .prefix("pgflow-pg-")
            .tempdir()
            .map_err(|e| setup_err("create temp dir", e))?
            .keep();
        let data = root.join("data");
        // The reaper owns cleanup from here on, even if the rest of this function fails.
        let reaper = spawn_reaper(&root, &data)?;
        let mut me = TempPostgres {
            root: root.clone(),
            port: 0,
            reaper: Mutex::new(Some(reaper)),
            server: Mutex::new(None),
        };
        if let Some((uid, gid)) = run_as {
            chown(&root, Some(uid), Some(gid)).map_err(|e| setup_err("chown temp dir", e))?;
        }

        let mut initdb = Command::new(bin.join("initdb"));
        initdb
            .args([
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ])
            .arg("-D")
            .arg(&data)
            .current_dir(&root);
        as_user(&mut initdb, run_as);
        let out = initdb.output().map_err(|e| setup_err("run initdb", e))?;
        if !out.status.success() {
            return Err(setup_err(
                "initdb",
                format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ),
            ));
        }

        let mut last_log = String::new();
        for _attempt in 0..3 {
            let port = free_port()?;
            let log = std::fs::File::create(root.join("server.log"))
                .map_err(|e| setup_err("create server log", e))?;
            if let Some((uid, gid)) = run_as {
                chown(root.join("server.log"), Some(uid), Some(gid))
                    .map_err(|e| setup_err("chown server log", e))?;
            }
            let mut postgres = Command::new(bin.join("postgres"));
            postgres
                .arg("-D")
                .arg(&data)
                .args(["-p", &port.to_string()])
                .args(["-c", "listen_addresses=127.0.0.1"])
                .arg("-c")
                .arg(format!("unix_socket_directories={}", root.display()))
                .args(["-c", "max_connections=400", "-c", "shared_buffers=128MB"])
                .stdin(Stdio::null())
                .stdout(log.try_clone().map_err(|e| setup_err("dup log", e))?)
                .stderr(log)
                .current_dir(&root)
                // Keep ctrl-c in a terminal away from the server: the reaper stops it.
                .process_group(0);
            if durability == Durability::Fast {
                postgres.args([
                    "-c",
                    "fsync=off",
                    "-c",
                    "synchronous_commit=off",
                    "-c",
                    "full_page_writes=off",
                ]);
            }
            as_user(&mut postgres, run_as);
            let child = postgres
                .spawn()
                .map_err(|e| setup_err("start postgres", e))?;
            *me.server.lock().unwrap() = Some(child);
            me.port = port;
            match me.wait_ready(Duration::from_secs(30)).await {
                Ok(()) => return Ok(me),
                Err(log) => {
                    last_log = log;
                    if let Some(mut child) = me.server.lock().unwrap().take() {
                        let _ = child.kill();
                        let _ = child.wait();
                    }
                }
            }
        }
        Err(ThrowawayError::NotReady(Duration::from_secs(30), last_log))
    }

    async fn wait_ready(&self, limit: Duration) -> Result<(), String> {
        let deadline = Instant::now() + limit;
        loop {
            if let Ok(conn) = PgConnection::connect_with(&self.connect_options("postgres")).await {
                let _ = conn.close().await;
                return Ok(());
            }
            let exited = self
                .server
                .lock()
                .unwrap()
                .as_mut()
                .is_none_or(|c| c.try_wait().ok().flatten().is_some());
            if exited || Instant::now() > deadline {
                return Err(
                    std::fs::read_to_string(self.root.join("server.log")).unwrap_or_default()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The TCP port the server listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The connection URL of database `database` on this server (user `postgres`, no password).
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    fn connect_options(&self, database: &str) -> PgConnectOptions {
        PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.port)
            .username("postgres")
            .database(database)
            .disable_statement_logging()
    }
}

impl Drop for TempPostgres {
    fn drop(&mut self) {
        // Closing the pipe tells the reaper to stop the server and delete the directory.
        if let Some((mut reaper, stdin)) = self.reaper.lock().unwrap().take() {
            drop(stdin);
            let _ = reaper.wait();
        }
        if let Some(mut server) = self.server.lock().unwrap().take() {
            let _ = server.wait();
        }
    }
}

/// Directory with `initdb` and `postgres`: `PATH` first, then `/usr/lib/postgresql/*/bin`, newest first.
fn find_binaries() -> Result<PathBuf, ThrowawayError> {
    let has_both = |dir: &Path| dir.join("initdb").is_file() && dir.join("postgres").is_file();
    if let Some(path) = std::env::var_os("PATH") {
        if let Some(dir) = std::env::split_paths(&path).find(|dir| has_both(dir)) {
            return Ok(dir);
        }
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = entry.path().join("bin");
            has_both(&bin).then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, bin)| bin)
        .ok_or(ThrowawayError::NoBinaries)
}

/// When running as root: the uid and gid to run PostgreSQL as (`postgres`, else `nobody`).
fn unprivileged_user() -> Result<Option<(u32, u32)>, ThrowawayError> {
    if !nix::unistd::geteuid().is_root() {
        return Ok(None);
    }
    for name in ["postgres", "nobody"] {
        if let Ok(Some(user)) = nix::unistd::User::from_name(name) {
            return Ok(Some((user.uid.as_raw(), user.gid.as_raw())));
        }
    }
    Err(setup_err(
        "find an unprivileged user",
        "running as root, and neither a `postgres` nor a `nobody` user exists; PostgreSQL refuses to run as root",
    ))
}

fn as_user(command: &mut Command, run_as: Option<(u32, u32)>) {
    if let Some((uid, gid)) = run_as {
        command.uid(uid).gid(gid).env("HOME", "/tmp");
    }
}

fn free_port() -> Result<u16, ThrowawayError> {
    let listener =
        std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| setup_err("find a free port", e))?;
    Ok(listener
        .local_addr()
        .map_err(|e| setup_err("find a free port", e))?
        .port())
}

/// A shell that waits until our end of its stdin closes (we exited or dropped the cluster), then
/// stops the server immediately and deletes the directory. It ignores the signals a terminal sends
/// to the whole process group, so ctrl-c still ends with a cleanup.
fn spawn_reaper(root: &Path, data: &Path) -> Result<(Child, ChildStdin), ThrowawayError> {
    const SCRIPT: &str = r#"
trap '' INT TERM HUP
cat >/dev/null
pid=$(head -n 1 "$PGFLOW_DATA/postmaster.pid" 2>/dev/null)
if [ -n "$pid" ]; then
  kill -QUIT "$pid" 2>/dev/null
  i=0
  while kill -0 "$pid" 2>/dev/null && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done
  kill -KILL "$pid" 2>/dev/null
fi
rm -rf "$PGFLOW_ROOT"
"#;
    let mut child = Command::new("sh")
        .args(["-c", SCRIPT])
        .env("PGFLOW_ROOT", root)
        .env("PGFLOW_DATA", data)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(|e| setup_err("start the cleanup process", e))?;
    let mut stdin = child.stdin.take().expect("piped stdin");
    // Prove the pipe works before relying on it.
    stdin
        .write_all(b"\n")
        .map_err(|e| setup_err("start the cleanup process", e))?;
    Ok((child, stdin))
}

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
    /// PGMQ only (installed from the `pgmq` crate's embedded SQL, or the extension).
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
            _ => install_pgmq_only(&pool).await,
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

async fn install_pgmq_only(pool: &PgPool) -> Result<(), crate::InstallError> {
    let available: bool = sqlx::query_scalar(
        "select exists (select 1 from pg_available_extensions where name = 'pgmq')",
    )
    .fetch_one(pool)
    .await?;
    if available {
        sqlx::query("create extension if not exists pgmq")
            .execute(pool)
            .await?;
    } else {
        pgmq::install::install_sql_from_embedded(pool)
            .await
            .map_err(|e| crate::InstallError::Pgmq(e.to_string()))?;
    }
    Ok(())
}

async fn template_ready(admin: &mut PgConnection, template: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "select exists (select 1 from pg_database where datname = $1 and datistemplate)",
    )
    .bind(template)
    .fetch_one(admin)
    .await
}
