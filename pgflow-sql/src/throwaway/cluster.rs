//! One PostgreSQL server process in a temp directory: start, restart, and cleanup on any exit.

use std::io::Write as _;
use std::os::unix::fs::chown;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgConnection};

use super::{setup_err, ThrowawayError};

/// How long a started server may take to accept connections.
const READY_LIMIT: Duration = Duration::from_secs(30);
/// How long a fast shutdown may take before the server is killed (`pg_ctl`'s default wait).
const STOP_LIMIT: Duration = Duration::from_secs(60);

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
    launch: Launch,
    reaper: Mutex<Option<(Child, ChildStdin)>>,
    server: Mutex<Option<Child>>,
    /// Held for the whole of a restart, so two restarts never start two servers on one directory.
    restarting: tokio::sync::Mutex<()>,
}

/// What starting the server process needs, kept for restarts.
#[derive(Debug)]
struct Launch {
    bin: PathBuf,
    data: PathBuf,
    run_as: Option<(u32, u32)>,
    durability: Durability,
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
            root,
            port: 0,
            launch: Launch {
                bin,
                data,
                run_as,
                durability,
            },
            reaper: Mutex::new(Some(reaper)),
            server: Mutex::new(None),
            restarting: tokio::sync::Mutex::new(()),
        };
        if let Some((uid, gid)) = run_as {
            chown(&me.root, Some(uid), Some(gid)).map_err(|e| setup_err("chown temp dir", e))?;
        }
        me.initdb()?;

        // A free port can be taken by someone else before the server binds it: try a few.
        let mut last_log = String::new();
        for _attempt in 0..3 {
            me.port = free_port()?;
            match me.spawn_and_wait().await {
                Ok(()) => return Ok(me),
                Err(ThrowawayError::NotReady(_, log)) => last_log = log,
                Err(e) => return Err(e),
            }
        }
        Err(ThrowawayError::NotReady(READY_LIMIT, last_log))
    }

    /// Stops the server the way `pg_ctl stop -m fast` does (`SIGINT` to the postmaster: sessions
    /// end, a shutdown checkpoint is written), waits for it to exit, and starts it again on the
    /// same data directory and port. Committed data survives; open connections are closed, and
    /// pools reconnect on their next use.
    ///
    /// # Errors
    /// The server did not stop within 60 s (it is then killed), or it did not come up again.
    pub async fn restart(&self) -> Result<(), ThrowawayError> {
        let _only_one = self.restarting.lock().await;
        let running = self.server.lock().unwrap().take();
        if let Some(child) = running {
            stop_fast(child).await?;
        }
        self.spawn_and_wait().await
    }

    /// The TCP port the server listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The connection URL of database `database` on this server (user `postgres`, no password).
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// Connection options for database `database` on this server.
    pub(super) fn connect_options(&self, database: &str) -> PgConnectOptions {
        PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.port)
            .username("postgres")
            .database(database)
            .disable_statement_logging()
    }

    fn initdb(&self) -> Result<(), ThrowawayError> {
        let mut initdb = Command::new(self.launch.bin.join("initdb"));
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
            .arg(&self.launch.data)
            .current_dir(&self.root);
        as_user(&mut initdb, self.launch.run_as);
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
        Ok(())
    }

    /// Starts `postgres` on `self.port` and waits until it accepts connections. A server that does
    /// not come up is killed, and its log returned in [`ThrowawayError::NotReady`].
    async fn spawn_and_wait(&self) -> Result<(), ThrowawayError> {
        let Launch {
            bin,
            data,
            run_as,
            durability,
        } = &self.launch;
        let log_path = self.root.join("server.log");
        // Appended to, so a restart keeps the log of the server before it.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| setup_err("open the server log", e))?;
        if let Some((uid, gid)) = *run_as {
            chown(&log_path, Some(uid), Some(gid))
                .map_err(|e| setup_err("chown the server log", e))?;
        }
        let mut postgres = Command::new(bin.join("postgres"));
        postgres
            .arg("-D")
            .arg(data)
            .args(["-p", &self.port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!("unix_socket_directories={}", self.root.display()))
            .args(["-c", "max_connections=400", "-c", "shared_buffers=128MB"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| setup_err("dup log", e))?)
            .stderr(log)
            .current_dir(&self.root)
            // Keep ctrl-c in a terminal away from the server: the reaper stops it.
            .process_group(0);
        if *durability == Durability::Fast {
            postgres.args([
                "-c",
                "fsync=off",
                "-c",
                "synchronous_commit=off",
                "-c",
                "full_page_writes=off",
            ]);
        }
        as_user(&mut postgres, *run_as);
        let child = postgres
            .spawn()
            .map_err(|e| setup_err("start postgres", e))?;
        *self.server.lock().unwrap() = Some(child);
        if let Err(log) = self.wait_ready(READY_LIMIT).await {
            if let Some(mut child) = self.server.lock().unwrap().take() {
                let _ = child.kill();
                let _ = child.wait();
            }
            return Err(ThrowawayError::NotReady(READY_LIMIT, log));
        }
        Ok(())
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
}

impl Drop for TempPostgres {
    fn drop(&mut self) {
        // Closing the pipe tells the reaper to stop the server and delete the directory.
        let reaper = self.reaper.lock().unwrap().take();
        let reaper = reaper.map(|(reaper, stdin)| {
            drop(stdin);
            reaper
        });
        // Reap the server first: until then it is a zombie that the reaper's `kill -0` still
        // sees, and the reaper would wait its full grace period before deleting the directory.
        if let Some(mut server) = self.server.lock().unwrap().take() {
            let _ = server.wait();
        }
        if let Some(mut reaper) = reaper {
            let _ = reaper.wait();
        }
    }
}

/// `SIGINT` to the postmaster (PostgreSQL's fast shutdown), then waits for it to exit; kills it
/// when it has not exited within [`STOP_LIMIT`].
async fn stop_fast(mut child: Child) -> Result<(), ThrowawayError> {
    let pid = Pid::from_raw(i32::try_from(child.id()).map_err(|e| setup_err("stop postgres", e))?);
    // An error here means the server already exited; `try_wait` below sees that.
    let _ = kill(pid, Signal::SIGINT);
    let deadline = Instant::now() + STOP_LIMIT;
    loop {
        match child.try_wait() {
            Ok(Some(_status)) => return Ok(()),
            Ok(None) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(setup_err(
                    "stop postgres",
                    format!("the server did not exit within {STOP_LIMIT:?} of SIGINT; killed it"),
                ));
            }
            Err(e) => return Err(setup_err("wait for postgres to stop", e)),
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
pub(super) fn unprivileged_user() -> Result<Option<(u32, u32)>, ThrowawayError> {
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

pub(super) fn as_user(command: &mut Command, run_as: Option<(u32, u32)>) {
    if let Some((uid, gid)) = run_as {
        command.uid(uid).gid(gid).env("HOME", "/tmp");
    }
}

pub(super) fn free_port() -> Result<u16, ThrowawayError> {
    let listener =
        std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| setup_err("find a free port", e))?;
    Ok(listener
        .local_addr()
        .map_err(|e| setup_err("find a free port", e))?
        .port())
}

/// A shell that waits until our end of its stdin closes (we exited or dropped the cluster), then
/// stops the server immediately and deletes the directory. It ignores the signals a terminal sends
/// to the whole process group, so ctrl-c still ends with a cleanup. It reads the server's pid from
/// `postmaster.pid` only then, so it stops a restarted server too.
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
