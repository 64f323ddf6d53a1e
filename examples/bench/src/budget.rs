//! The per-task budget: round trips, statements, bytes, commits and WAL flushes per task, for the pgflow-rs
//! worker and for the upstream-style driver, each draining the diamond flow.
//!
//! Method.
//!
//! - **Wire counts.** The measured driver's connections go through a counting TCP relay on 127.0.0.1 (an
//!   ephemeral port, SSL disabled) that forwards bytes unchanged and parses the client's side of the
//!   PostgreSQL wire protocol: the untyped startup packet (and SSL/GSS requests, which precede another
//!   startup packet), then messages framed as a 1-byte type and a 4-byte big-endian length that counts
//!   itself. A round trip is a `S` (Sync) or a `Q` (simple Query); a statement is an `E` (Execute) or a
//!   `Q`; bytes are counted in both directions. A Sync with no Parse/Bind/Describe/Execute since the
//!   previous one is a ping: sqlx's `PgPool` sends one whenever a connection goes back to the pool, and
//!   one when it is lent out (`test_before_acquire`, on by default). The pgflow-rs worker's pool keeps
//!   sqlx's defaults; the upstream-style driver holds its connections directly, as upstream's client
//!   sends no such ping. A ping is a round trip and is counted as one, and also shown on its own.
//! - **Commits** are the delta of `pg_stat_database.xact_commit` (every committed transaction, read-only ones
//!   included) minus the harness's own statements in the window, which all run on one separate,
//!   non-relayed connection and are counted one by one (each is one autocommit transaction). Backends
//!   report their statistics when they exit, or when they go idle, at most once a second: a backend that
//!   goes idle less than a second after its last report holds the rest for up to 10 s (PostgreSQL 15's
//!   `PGSTAT_IDLE_INTERVAL`). So the window opens after the setup has been quiet for 11 s (only the
//!   driver's idle polls run meanwhile) and after a `pg_stat_force_next_flush()` on the harness
//!   connection, and it closes after the driver's connections have closed (exiting backends report) and
//!   another forced flush of the harness connection.
//! - **WAL flushes** are the delta of `pg_stat_wal.wal_sync` (every process's WAL fsyncs, the WAL writer's
//!   included) minus one per harness statement that starts runs (a writing commit: at most one flush of
//!   its own).
//! - **What is excluded**: the driver's setup. The driver is spawned with an empty queue and its pool
//!   fully opened (`prewarm`; the upstream-style driver always opens its connections up front); for the pgflow-rs worker `spawn` returns after its startup (flow
//!   compilation and verification, registration), for the upstream-style driver after its registration.
//!   The counters are snapshotted once that is idle, and only then does the harness start the runs. So the
//!   window holds the drain itself plus the driver's idle polls right before the runs arrive and after
//!   the last one completes, and its shutdown (pool close: `Terminate` messages, which are not round
//!   trips). Autovacuum transactions, if any fall in the window, are counted as commits (a few per drain
//!   at most).
//!
//! The relay adds a little latency per round trip, so the drain rates here are not the drain table's.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgSslMode};
use sqlx::{Connection as _, PgConnection};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::db::{BenchDb, BenchFlow, START_RUNS};
use crate::{BenchError, Driver};

/// Frontend message counts (client → server).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tally {
    /// Startup packets (one per connection; SSL/GSS requests not included).
    pub(crate) startups: u64,
    /// `S` messages.
    pub(crate) syncs: u64,
    /// `S` messages with no extended-protocol message since the previous Sync (sqlx's ping).
    pub(crate) pings: u64,
    /// `Q` messages.
    pub(crate) queries: u64,
    /// `E` messages.
    pub(crate) executes: u64,
}

/// The client side of the PostgreSQL wire protocol, fed in arbitrary chunks.
#[derive(Debug)]
pub(crate) struct Frontend {
    /// Still before the startup packet (which, like the SSL and GSS requests, has no type byte).
    startup: bool,
    /// Header bytes of the message being read (5 typed, 8 untyped).
    head: Vec<u8>,
    /// Body bytes of the current message still to skip.
    skip: usize,
    /// Whether a Parse/Bind/Describe/Execute/Close/Flush came since the last Sync.
    work_since_sync: bool,
    pub(crate) tally: Tally,
}

impl Default for Frontend {
    fn default() -> Self {
        Frontend {
            startup: true,
            head: Vec::with_capacity(8),
            skip: 0,
            work_since_sync: false,
            tally: Tally::default(),
        }
    }
}

/// Request codes sent in place of a startup packet's protocol version.
const SSL_REQUEST: u32 = 80_877_103;
const GSSENC_REQUEST: u32 = 80_877_104;
const CANCEL_REQUEST: u32 = 80_877_102;

impl Frontend {
    /// Consumes the next chunk of client bytes.
    pub(crate) fn feed(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            if self.skip > 0 {
                let n = self.skip.min(data.len());
                self.skip -= n;
                data = &data[n..];
                continue;
            }
            let need = if self.startup { 8 } else { 5 };
            let n = (need - self.head.len()).min(data.len());
            self.head.extend_from_slice(&data[..n]);
            data = &data[n..];
            if self.head.len() < need {
                return;
            }
            let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize;
            if self.startup {
                let (len, code) = (be(&self.head[0..4]), be(&self.head[4..8]) as u32);
                self.skip = len.saturating_sub(8);
                match code {
                    // The server answers with one byte; the client then sends its startup packet.
                    SSL_REQUEST | GSSENC_REQUEST => {}
                    // A cancel request is the whole of its connection.
                    CANCEL_REQUEST => {}
                    _ => {
                        self.startup = false;
                        self.tally.startups += 1;
                    }
                }
            } else {
                let (kind, len) = (self.head[0], be(&self.head[1..5]));
                self.skip = len.saturating_sub(4);
                self.message(kind);
            }
            self.head.clear();
        }
    }

    fn message(&mut self, kind: u8) {
        match kind {
            b'S' => {
                self.tally.syncs += 1;
                if !self.work_since_sync {
                    self.tally.pings += 1;
                }
                self.work_since_sync = false;
            }
            b'Q' => self.tally.queries += 1,
            b'E' => {
                self.tally.executes += 1;
                self.work_since_sync = true;
            }
            b'P' | b'B' | b'D' | b'C' | b'H' => self.work_since_sync = true,
            _ => {}
        }
    }
}

/// Live totals over every relayed connection.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    startups: AtomicU64,
    syncs: AtomicU64,
    pings: AtomicU64,
    queries: AtomicU64,
    executes: AtomicU64,
    bytes_up: AtomicU64,
    bytes_down: AtomicU64,
}

/// A snapshot of [`Counters`].
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Wire {
    pub(crate) tally: Tally,
    pub(crate) bytes: u64,
}

impl Counters {
    fn add(&self, t: Tally) {
        self.startups.fetch_add(t.startups, Ordering::Relaxed);
        self.syncs.fetch_add(t.syncs, Ordering::Relaxed);
        self.pings.fetch_add(t.pings, Ordering::Relaxed);
        self.queries.fetch_add(t.queries, Ordering::Relaxed);
        self.executes.fetch_add(t.executes, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> Wire {
        Wire {
            tally: Tally {
                startups: self.startups.load(Ordering::Relaxed),
                syncs: self.syncs.load(Ordering::Relaxed),
                pings: self.pings.load(Ordering::Relaxed),
                queries: self.queries.load(Ordering::Relaxed),
                executes: self.executes.load(Ordering::Relaxed),
            },
            bytes: self.bytes_up.load(Ordering::Relaxed) + self.bytes_down.load(Ordering::Relaxed),
        }
    }
}

/// The counting relay: listens on 127.0.0.1 (ephemeral port), forwards every connection to the server.
pub(crate) struct Relay {
    pub(crate) port: u16,
    pub(crate) counters: Arc<Counters>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl Relay {
    pub(crate) async fn start(host: String, port: u16) -> std::io::Result<Relay> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let local = listener.local_addr()?.port();
        let counters = Arc::new(Counters::default());
        let shared = counters.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let counters = shared.clone();
                let host = host.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect((host.as_str(), port)).await {
                        pipe(client, server, counters).await;
                    }
                });
            }
        });
        Ok(Relay {
            port: local,
            counters,
            accept,
        })
    }
}

/// Forwards one connection both ways until either side closes, counting as it goes.
async fn pipe(client: TcpStream, server: TcpStream, counters: Arc<Counters>) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_rx, mut client_tx) = client.into_split();
    let (mut server_rx, mut server_tx) = server.into_split();
    let up = async {
        let mut parser = Frontend::default();
        let mut buf = vec![0_u8; 64 * 1024];
        loop {
            let n = match client_rx.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            parser.feed(&buf[..n]);
            counters.add(std::mem::take(&mut parser.tally));
            counters.bytes_up.fetch_add(n as u64, Ordering::Relaxed);
            if server_tx.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = server_tx.shutdown().await;
    };
    let down = async {
        let mut buf = vec![0_u8; 64 * 1024];
        loop {
            let n = match server_rx.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            counters.bytes_down.fetch_add(n as u64, Ordering::Relaxed);
            if client_tx.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = client_tx.shutdown().await;
    };
    tokio::join!(up, down);
}

/// One row of the budget table.
#[derive(Debug, Clone)]
struct BudgetRow {
    driver: String,
    k: usize,
    tasks: usize,
    seconds: f64,
    wire: Tally,
    bytes: u64,
    commits: i64,
    wal_syncs: i64,
    harness_statements: i64,
}

impl BudgetRow {
    /// Per task: round trips, of which pings, statements, commits, WAL flushes, bytes.
    fn per_task(&self) -> [f64; 6] {
        let t = self.tasks as f64;
        [
            (self.wire.syncs + self.wire.queries) as f64 / t,
            self.wire.pings as f64 / t,
            (self.wire.executes + self.wire.queries) as f64 / t,
            self.commits as f64 / t,
            self.wal_syncs as f64 / t,
            self.bytes as f64 / t,
        ]
    }
}

/// The budget scenario's results.
#[derive(Debug)]
pub(crate) struct BudgetReport {
    rows: Vec<BudgetRow>,
}

/// Measures both drivers on the diamond flow at every K in `ks`, `tasks` tasks each.
pub(crate) async fn run(
    db: &BenchDb,
    ks: &[usize],
    tasks: usize,
) -> Result<BudgetReport, BenchError> {
    let mut rows = Vec::new();
    for &k in ks {
        for driver in [
            Driver::Worker { max_concurrent: k },
            Driver::SqlUpstreamStyle { k },
        ] {
            let row = measure(db, driver, BenchFlow::Diamond, tasks).await?;
            let p = row.per_task();
            eprintln!(
                "budget {} K={k}: {:.2} RT/task ({:.2} pings), {:.2} statements/task, {:.2} commits/task, {:.2} WAL flushes/task, {:.0} B/task; {} tasks in {:.2} s",
                row.driver, p[0], p[1], p[2], p[3], p[4], p[5], row.tasks, row.seconds
            );
            rows.push(row);
        }
    }
    Ok(BudgetReport { rows })
}

/// `xact_commit` of this database and the server's `wal_sync`, in one statement.
async fn server_counts(h: &mut PgConnection) -> Result<(i64, i64), sqlx::Error> {
    sqlx::query_as(
        "select (select xact_commit from pg_stat_database where datname = current_database()), \
                (select wal_sync from pg_stat_wal)",
    )
    .fetch_one(h)
    .await
}

async fn measure(
    db: &BenchDb,
    driver: Driver,
    flow: BenchFlow,
    tasks: usize,
) -> Result<BudgetRow, BenchError> {
    let slug = flow.slug();
    if db.options.get_socket().is_some() {
        return Err(BenchError::Invalid(
            "the budget relay needs a TCP server, not a Unix socket".into(),
        ));
    }
    let relay = Relay::start(db.options.get_host().to_owned(), db.options.get_port())
        .await
        .map_err(|e| BenchError::Invalid(format!("relay: {e}")))?;
    let relayed: PgConnectOptions = db
        .options
        .clone()
        .host("127.0.0.1")
        .port(relay.port)
        .ssl_mode(PgSslMode::Disable);
    db.compile(slug, &flow.shape()).await?;
    db.settle().await?;

    // Setup, outside the window: the driver starts on an empty queue with its pool opened.
    let stop = CancellationToken::new();
    let mut set = driver.spawn(db, &relayed, flow, stop.clone(), true).await?;
    let mut h = db.connect().await?;
    // Quiet for longer than PGSTAT_IDLE_INTERVAL (10 s): every setup statement has been reported.
    tokio::time::sleep(Duration::from_secs(11)).await;
    sqlx::query("select pg_stat_force_next_flush()")
        .execute(&mut h)
        .await?;

    // The window. Every statement on `h` from here to the closing snapshot is one commit of the harness.
    let wire0 = relay.counters.snapshot();
    let (commits0, wal0) = server_counts(&mut h).await?;
    let mut harness: i64 = 1;
    let started = Instant::now();
    let runs = tasks.div_ceil(flow.tasks_per_run());
    let mut run_ids: Vec<Uuid> = Vec::with_capacity(runs);
    let mut start_statements: i64 = 0;
    while run_ids.len() < runs {
        let n = (runs - run_ids.len()).min(200);
        let ids: Vec<Uuid> = sqlx::query_scalar(START_RUNS)
            .bind(slug)
            .bind(flow.input())
            .bind(n as i32)
            .fetch_all(&mut h)
            .await?;
        run_ids.extend(ids);
        start_statements += 1;
    }
    harness += start_statements;
    let limit = Instant::now() + Duration::from_secs(300);
    let outcome = loop {
        if let Some(Ok(Err(e))) = set.try_join_next() {
            break Err(e);
        }
        let open: i64 = sqlx::query_scalar(
            "select count(*) from pgflow.runs where status = 'started' and run_id = any ($1)",
        )
        .bind(&run_ids)
        .fetch_one(&mut h)
        .await?;
        harness += 1;
        if open == 0 {
            break Ok(());
        }
        if Instant::now() > limit {
            break Err(BenchError::Invalid(format!(
                "budget {} K={}: {open} runs still open after 300 s",
                driver.label(),
                driver.k()
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let seconds = started.elapsed().as_secs_f64();
    stop.cancel();
    while let Some(joined) = set.join_next().await {
        joined.map_err(|e| BenchError::Invalid(format!("driver panicked: {e}")))??;
    }
    outcome?;
    // The driver's connections are closed (their backends report their statistics as they exit).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let wire1 = relay.counters.snapshot();
    sqlx::query("select pg_stat_force_next_flush()")
        .execute(&mut h)
        .await?;
    harness += 1;
    let (commits1, wal1) = server_counts(&mut h).await?;
    h.close().await?;
    db.verify_completed(&run_ids).await?;
    crate::cleanup(db, slug).await?;

    let d = |a: u64, b: u64| b.saturating_sub(a);
    Ok(BudgetRow {
        driver: driver.label(),
        k: driver.k(),
        tasks: runs * flow.tasks_per_run(),
        seconds,
        wire: Tally {
            startups: d(wire0.tally.startups, wire1.tally.startups),
            syncs: d(wire0.tally.syncs, wire1.tally.syncs),
            pings: d(wire0.tally.pings, wire1.tally.pings),
            queries: d(wire0.tally.queries, wire1.tally.queries),
            executes: d(wire0.tally.executes, wire1.tally.executes),
        },
        bytes: d(wire0.bytes, wire1.bytes),
        commits: commits1 - commits0 - harness,
        wal_syncs: wal1 - wal0 - start_statements,
        harness_statements: harness,
    })
}

impl BudgetReport {
    pub(crate) fn print(&self) {
        println!("\n## Per-task budget (diamond drain through a counting relay)\n");
        println!(
            "| driver | K | RT/task | of which pings | statements/task | commits/task | WAL flushes/task | bytes/task | notes |"
        );
        println!("|---|---:|---:|---:|---:|---:|---:|---:|---|");
        for r in &self.rows {
            let p = r.per_task();
            println!(
                "| {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.0} | {} tasks in {:.2} s; {} connection startups in the window; {} harness commits subtracted |",
                r.driver,
                r.k,
                p[0],
                p[1],
                p[2],
                p[3],
                p[4],
                p[5],
                r.tasks,
                r.seconds,
                r.wire.startups,
                r.harness_statements
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn typed(kind: u8, body: &[u8]) -> Vec<u8> {
        let mut m = vec![kind];
        m.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
        m.extend_from_slice(body);
        m
    }

    fn untyped(code: u32, body: &[u8]) -> Vec<u8> {
        let mut m = (body.len() as u32 + 8).to_be_bytes().to_vec();
        m.extend_from_slice(&code.to_be_bytes());
        m.extend_from_slice(body);
        m
    }

    /// SSL request, startup, a simple query, an extended-protocol statement, and a bare Sync (ping).
    fn session() -> Vec<u8> {
        let mut s = untyped(SSL_REQUEST, b"");
        s.extend(untyped(196_608, b"user\0postgres\0database\0x\0\0"));
        s.extend(typed(b'Q', b"begin\0"));
        s.extend(typed(b'P', b"\0select $1\0\0\0"));
        s.extend(typed(b'B', b"\0\0\0\0\0\0\0\0\0\0"));
        s.extend(typed(b'D', b"P\0"));
        s.extend(typed(b'E', b"\0\0\0\0\0"));
        s.extend(typed(b'S', b""));
        s.extend(typed(b'S', b""));
        s.extend(typed(b'Q', b"commit\0"));
        s.extend(typed(b'X', b""));
        s
    }

    const EXPECTED: Tally = Tally {
        startups: 1,
        syncs: 2,
        pings: 1,
        queries: 2,
        executes: 1,
    };

    #[test]
    fn counts_a_session_fed_at_once() {
        let mut p = Frontend::default();
        p.feed(&session());
        assert_eq!(p.tally, EXPECTED);
    }

    #[test]
    fn counts_a_session_fed_byte_by_byte_and_in_odd_chunks() {
        let s = session();
        let mut p = Frontend::default();
        for b in &s {
            p.feed(std::slice::from_ref(b));
        }
        assert_eq!(p.tally, EXPECTED);
        for chunk in [3, 7, 13] {
            let mut p = Frontend::default();
            for c in s.chunks(chunk) {
                p.feed(c);
            }
            assert_eq!(p.tally, EXPECTED, "chunks of {chunk}");
        }
    }

    #[test]
    fn a_large_body_is_skipped_not_parsed() {
        let mut p = Frontend::default();
        p.feed(&untyped(196_608, b"user\0u\0\0"));
        // A Bind whose body is full of bytes that look like message types.
        let body = vec![b'S'; 100_000];
        let mut s = typed(b'B', &body);
        s.extend(typed(b'E', b"\0\0\0\0\0"));
        s.extend(typed(b'S', b""));
        for c in s.chunks(4096) {
            p.feed(c);
        }
        assert_eq!(
            p.tally,
            Tally {
                startups: 1,
                syncs: 1,
                pings: 0,
                queries: 0,
                executes: 1
            }
        );
    }
}
