//! A throwaway PgBouncer in transaction pooling mode in front of a server, for tests of pooled deployments.

use std::io::Write as _;
use std::os::unix::fs::chown;
use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, Executor, PgConnection};

use super::cluster::{as_user, free_port, unprivileged_user};
use super::{setup_err, ThrowawayError};

/// How long a started PgBouncer may take to accept connections.
const READY_LIMIT: Duration = Duration::from_secs(20);

/// A PgBouncer (`pool_mode = transaction`, `auth_type = trust`) on a free 127.0.0.1 port, forwarding
/// every database to one upstream server; stopped and its directory removed when dropped. It runs as an
/// unprivileged OS user when this process is root (PgBouncer refuses root).
#[derive(Debug)]
pub struct TempPgBouncer {
    dir: tempfile::TempDir,
    port: u16,
    user: String,
    child: Child,
}

impl TempPgBouncer {
    /// Starts PgBouncer in front of `upstream` (its host, port and user; no password), with at most
    /// `server_pool_size` server connections per database, fewer than its clients' connections, so
    /// that consecutive transactions of one client run on different server connections.
    ///
    /// # Errors
    /// No `pgbouncer` binary (install it: `apt-get install -y pgbouncer`), or one that does not come up.
    pub async fn start(
        upstream: &PgConnectOptions,
        server_pool_size: u32,
    ) -> Result<Self, ThrowawayError> {
        let bin = find_binary()?;
        let run_as = unprivileged_user()?;
        let dir = tempfile::Builder::new()
            .prefix("pgflow-bouncer-")
            .tempdir()
            .map_err(|e| setup_err("create temp dir", e))?;
        let user = upstream.get_username().to_owned();
        let port = free_port()?;
        let ini = dir.path().join("pgbouncer.ini");
        let userlist = dir.path().join("userlist.txt");
        write(&userlist, &format!("\"{user}\" \"\"\n"))?;
        write(
            &ini,
            &format!(
                "[databases]\n* = host={host} port={upstream_port}\n\n[pgbouncer]\n\
                 listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
                 auth_type = trust\nauth_file = {userlist}\npool_mode = transaction\n\
                 default_pool_size = {server_pool_size}\nmax_client_conn = 500\n\
                 ignore_startup_parameters = extra_float_digits\n\
                 logfile = {dir}/pgbouncer.log\n",
                host = upstream.get_host(),
                upstream_port = upstream.get_port(),
                userlist = userlist.display(),
                dir = dir.path().display(),
            ),
        )?;
        if let Some((uid, gid)) = run_as {
            for path in [dir.path(), ini.as_path(), userlist.as_path()] {
                chown(path, Some(uid), Some(gid))
                    .map_err(|e| setup_err("chown pgbouncer files", e))?;
            }
        }
        let mut command = Command::new(&bin);
        command
            .arg(&ini)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0);
        as_user(&mut command, run_as);
        let child = command
            .spawn()
            .map_err(|e| setup_err("start pgbouncer", e))?;
        let me = TempPgBouncer {
            dir,
            port,
            user,
            child,
        };
        if me.wait_ready().await {
            Ok(me)
        } else {
            Err(ThrowawayError::NotReady(READY_LIMIT, me.log()))
        }
    }

    /// The TCP port PgBouncer listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of database `database` through PgBouncer.
    pub fn url(&self, database: &str) -> String {
        format!(
            "postgres://{}@127.0.0.1:{}/{database}",
            self.user, self.port
        )
    }

    /// Connection options of database `database` through PgBouncer.
    pub fn options(&self, database: &str) -> PgConnectOptions {
        PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.port)
            .username(&self.user)
            .database(database)
    }

    /// PgBouncer's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("pgbouncer.log")).unwrap_or_default()
    }

    async fn wait_ready(&self) -> bool {
        let started = Instant::now();
        while started.elapsed() < READY_LIMIT {
            if let Ok(mut conn) = PgConnection::connect_with(&self.options("postgres")).await {
                if conn.execute("select 1").await.is_ok() {
                    return true;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }
}

impl Drop for TempPgBouncer {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        let _ = self.child.wait();
    }
}

fn write(path: &std::path::Path, text: &str) -> Result<(), ThrowawayError> {
    let mut file =
        std::fs::File::create(path).map_err(|e| setup_err("write pgbouncer files", e))?;
    file.write_all(text.as_bytes())
        .map_err(|e| setup_err("write pgbouncer files", e))
}

fn find_binary() -> Result<PathBuf, ThrowawayError> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/sbin")])
        .map(|dir| dir.join("pgbouncer"))
        .find(|bin| bin.is_file())
        .ok_or_else(|| {
            setup_err(
                "find pgbouncer",
                "no `pgbouncer` in PATH, /usr/sbin or /usr/local/sbin; install it (Debian/Ubuntu: `apt-get install -y pgbouncer`)",
            )
        })
}
