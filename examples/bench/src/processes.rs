//! Many worker processes, and the idle latency probe.
//!
//! **Processes** (`--only processes`): 1, 4 and 16 worker OS processes (this binary, re-run with
//! `--worker-process`) share `--processes-handlers` handlers (16) on the diamond flow. Every process's
//! connections go through the counting relay of the budget scenario, so the figures are the processes'
//! own: the connections they open, the statements they send while idle (per second), the statements above
//! that idle rate per new task while runs arrive one at a time (`--processes-wake-runs`, 300 ms apart: the
//! cost of waking up for new work), and the drain rate of `--processes-tasks` tasks started at once (on
//! fresh processes connected to the server directly).
//!
//! **Probe** (`--only probe`): one in-process worker (16 handlers) on an idle database, one run at a time
//! (`--probe-samples`, 100, `--probe-interval-ms`, 200 ms apart); the handlers note when they run, so the
//! figures are what a handler sees: start call → first handler, and parent handler done → dependent handler.
//! The `--probe-warmup` runs (3) before them, the same way, are reported apart: the first run after a worker
//! starts pays for its connections planning their statements.

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::budget::Relay;
use crate::db::{BenchDb, BenchFlow};
use crate::{BenchError, Driver, Row};

/// Handler-side timestamps of the probe.
pub(crate) mod probe {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::{HashMap, Instant, Mutex};

    /// What a handler notes.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub(crate) enum Mark {
        /// The root step's handler started.
        RootStarted,
        /// The root step's handler returned.
        RootDone,
        /// A dependent step's handler started (the first one counts).
        DependentStarted,
    }

    /// Whether the probe runs: other scenarios' handlers pay one relaxed load, no lock.
    static ENABLED: AtomicBool = AtomicBool::new(false);
    /// The notes, while the probe runs.
    static MARKS: Mutex<Option<HashMap<(Mark, i64), Instant>>> = Mutex::new(None);

    /// Notes `mark` for the run with input `n` (the first note of each kind counts).
    pub(crate) fn mark(mark: Mark, n: i64) {
        if !ENABLED.load(Ordering::Relaxed) {
            return;
        }
        if let Some(marks) = MARKS.lock().expect("probe lock").as_mut() {
            marks.entry((mark, n)).or_insert_with(Instant::now);
        }
    }

    pub(super) fn enable(on: bool) {
        *MARKS.lock().expect("probe lock") = on.then(HashMap::new);
        ENABLED.store(on, Ordering::Relaxed);
    }

    pub(super) fn get(mark: Mark, n: i64) -> Option<Instant> {
        MARKS
            .lock()
            .expect("probe lock")
            .as_ref()
            .and_then(|m| m.get(&(mark, n)).copied())
    }
}

/// Settings of both scenarios.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct Settings {
    /// Worker process counts of the processes scenario.
    #[arg(id = "processes_counts", long = "processes", value_delimiter = ',', default_values_t = [1, 4, 16])]
    pub(crate) counts: Vec<usize>,
    /// Handlers in total, shared out among the processes.
    #[arg(
        id = "processes_handlers",
        long = "processes-handlers",
        default_value_t = 16
    )]
    pub(crate) handlers: usize,
    /// Tasks per drain.
    #[arg(
        id = "processes_tasks",
        long = "processes-tasks",
        default_value_t = 20_000
    )]
    pub(crate) tasks: usize,
    /// Seconds of idle statement counting.
    #[arg(id = "processes_idle_seconds", long = "processes-idle-seconds", value_parser = seconds, default_value = "3")]
    pub(crate) idle: Duration,
    /// Runs arriving one at a time, 300 ms apart, for the wake-up count.
    #[arg(
        id = "processes_wake_runs",
        long = "processes-wake-runs",
        default_value_t = 10
    )]
    pub(crate) wake_runs: usize,
    /// Runs of the idle probe (at least 1).
    #[arg(
        id = "probe_samples",
        long = "probe-samples",
        default_value_t = 100,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..)
    )]
    pub(crate) probe_samples: usize,
    /// Milliseconds between the idle probe's runs.
    #[arg(id = "probe_interval_ms", long = "probe-interval-ms", value_parser = millis, default_value = "200")]
    pub(crate) probe_interval: Duration,
    /// Runs of the idle probe before the measured ones, reported apart (the worker's connections plan their
    /// statements on first use).
    #[arg(id = "probe_warmup", long = "probe-warmup", default_value_t = 3)]
    pub(crate) probe_warmup: usize,
}

fn seconds(value: &str) -> Result<Duration, String> {
    Duration::try_from_secs_f64(value.trim().parse().map_err(|e| format!("{e}"))?)
        .map_err(|e| e.to_string())
}

fn millis(value: &str) -> Result<Duration, String> {
    Ok(Duration::from_millis(
        value.trim().parse().map_err(|e| format!("{e}"))?,
    ))
}

/// The hidden `--worker-process` mode: one pgflow-rs worker on the diamond flow, connecting with the
/// `PGFLOW_BENCH_CHILD_*` variables, until its standard input closes.
pub(crate) async fn child_main() -> Result<(), BenchError> {
    let var = |name: &str| {
        std::env::var(name).map_err(|_| BenchError::Invalid(format!("{name} is not set")))
    };
    let base: sqlx::postgres::PgConnectOptions = match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => url.parse()?,
        _ => sqlx::postgres::PgConnectOptions::new().username(&var("PGFLOW_BENCH_CHILD_USER")?),
    };
    let options = base
        .host("127.0.0.1")
        .port(
            var("PGFLOW_BENCH_CHILD_PORT")?
                .parse()
                .map_err(|e| BenchError::Invalid(format!("port: {e}")))?,
        )
        .database(&var("PGFLOW_BENCH_CHILD_DB")?);
    let handlers: usize = var("PGFLOW_BENCH_CHILD_HANDLERS")?
        .parse()
        .map_err(|e| BenchError::Invalid(format!("handlers: {e}")))?;
    let config = pgflow_runtime::worker::WorkerConfig::default();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(config.completion_flushers as u32 + 4)
        .connect_with(options)
        .await?;
    let stop = CancellationToken::new();
    let handle = pgflow_runtime::Worker::<crate::flows::diamond::Diamond>::builder(pool.clone())
        .max_concurrent(handlers)
        .build()
        .map_err(|e| BenchError::Invalid(e.to_string()))?
        .spawn(stop.clone())
        .await
        .map_err(|e| BenchError::Invalid(format!("worker startup: {e}")))?;
    // The parent closes our standard input to stop us.
    tokio::task::spawn_blocking(|| {
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
    })
    .await
    .map_err(|e| BenchError::Invalid(e.to_string()))?;
    stop.cancel();
    handle
        .join()
        .await
        .map_err(|e| BenchError::Invalid(format!("worker: {e}")))?;
    pool.close().await;
    Ok(())
}

/// Statements (Execute or simple Query) the relayed connections sent so far.
fn statements(relay: &Relay) -> u64 {
    let t = relay.counters.snapshot().tally;
    t.executes + t.queries
}

/// Waits until every run among `run_ids` finished, for at most `limit`.
async fn wait_done(
    db: &BenchDb,
    run_ids: &[uuid::Uuid],
    limit: Duration,
) -> Result<(), BenchError> {
    let started = Instant::now();
    loop {
        // Nothing else runs during the scenario: its open runs are these (a count through an index).
        let (open, _) = db.progress().await?;
        if open == 0 {
            return db.verify_completed(run_ids).await;
        }
        if started.elapsed() > limit {
            return Err(BenchError::Invalid(format!(
                "{open} runs still open after {limit:?}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Stops the children (closing their standard input) and waits for them, killing them after 60 s.
fn stop_children(children: Vec<Child>) {
    let deadline = Instant::now() + Duration::from_secs(60);
    for mut child in children {
        drop(child.stdin.take());
        loop {
            match child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() > deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

/// Spawns `n` worker processes of `handlers` handlers each, connecting to `port`.
fn spawn_children(
    db: &BenchDb,
    n: usize,
    handlers: usize,
    port: u16,
) -> Result<Vec<Child>, BenchError> {
    let exe = std::env::current_exe().map_err(|e| BenchError::Invalid(e.to_string()))?;
    (0..n)
        .map(|_| {
            Command::new(&exe)
                .arg("--worker-process")
                .env("PGFLOW_BENCH_CHILD_USER", db.options.get_username())
                .env("PGFLOW_BENCH_CHILD_PORT", port.to_string())
                .env(
                    "PGFLOW_BENCH_CHILD_DB",
                    db.options.get_database().unwrap_or("postgres"),
                )
                .env("PGFLOW_BENCH_CHILD_HANDLERS", handlers.to_string())
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .spawn()
                .map_err(|e| BenchError::Invalid(format!("spawn a worker process: {e}")))
        })
        .collect()
}

/// Runs `measure` with `n` fresh worker processes on `port`, then stops them.
async fn with_children<T>(
    db: &BenchDb,
    n: usize,
    handlers: usize,
    port: u16,
    measure: impl std::future::Future<Output = Result<T, BenchError>>,
) -> Result<T, BenchError> {
    db.settle().await?;
    // The database's clock when these processes were spawned: their `pgflow.workers` rows are newer.
    let since: String = sqlx::query_scalar("select now()::text")
        .fetch_one(&db.pool)
        .await?;
    let children = spawn_children(db, n, handlers, port)?;
    let result = match wait_registered(db, n, &since).await {
        Ok(()) => measure.await,
        Err(e) => Err(e),
    };
    tokio::task::spawn_blocking(move || stop_children(children))
        .await
        .map_err(|e| BenchError::Invalid(e.to_string()))?;
    result
}

/// The processes scenario: one row per process count.
///
/// The idle and wake-up counts go through the counting relay; the drain runs on fresh processes connected
/// to the server directly, so that its figure is not the relay's (a proxy in this process, on the same cores,
/// whose cost grows with the statements it relays).
pub(crate) async fn processes(db: &BenchDb, s: &Settings) -> Result<Vec<Row>, BenchError> {
    let flow = BenchFlow::Diamond;
    db.compile(flow.slug(), &flow.shape()).await?;
    // Warm-up: the first drain on a new cluster runs at half speed (its tables and indexes grow from
    // nothing), which would count against whichever process count came first.
    with_children(db, 1, s.handlers, db.options.get_port(), drain(db, s, flow)).await?;
    let mut rows = Vec::new();
    let mut single: Option<f64> = None;
    for &n in &s.counts {
        let handlers = (s.handlers / n).max(1);
        let relay = Relay::start(db.options.get_host().to_owned(), db.options.get_port())
            .await
            .map_err(|e| BenchError::Invalid(format!("relay: {e}")))?;
        let (connections, idle_rate, per_task) =
            with_children(db, n, handlers, relay.port, count(db, s, &relay, flow)).await?;
        let rate =
            with_children(db, n, handlers, db.options.get_port(), drain(db, s, flow)).await?;
        let ratio = single.map_or(1.0, |one| rate / one);
        if n == 1 {
            single = Some(rate);
        }
        let row = Row {
            what: format!("{n} worker process(es), {handlers} handler(s) each: diamond drain"),
            k: n * handlers,
            value: rate,
            unit: "tasks/s",
            extra: format!(
                "{ratio:.2}× one process; {connections} connections; idle {idle_rate:.1} statements/s; \
                 {per_task:.2} statements per new task above idle"
            ),
            wal: None,
        };
        eprintln!("{}: {:.0} tasks/s; {}", row.what, row.value, row.extra);
        rows.push(row);
    }
    Ok(rows)
}

/// Waits until `n` worker processes spawned after `since` registered.
async fn wait_registered(db: &BenchDb, n: usize, since: &str) -> Result<(), BenchError> {
    let started = Instant::now();
    loop {
        let live: i64 = sqlx::query_scalar(
            "select count(*) from pgflow.workers where started_at >= $1::timestamptz and stopped_at is null",
        )
        .bind(since)
        .fetch_one(&db.pool)
        .await?;
        if live as usize >= n {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(120) {
            return Err(BenchError::Invalid(format!(
                "{live} of {n} worker processes registered in 120 s"
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Connections, idle statements/s and statements per new task of the running processes (through `relay`).
async fn count(
    db: &BenchDb,
    s: &Settings,
    relay: &Relay,
    flow: BenchFlow,
) -> Result<(u64, f64, f64), BenchError> {
    // Idle: let startup settle (one maintenance and heartbeat period), then count.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = statements(relay);
    tokio::time::sleep(s.idle).await;
    let idle_rate = (statements(relay) - before) as f64 / s.idle.as_secs_f64();

    // Wake-ups: runs arriving one at a time.
    let window = Instant::now();
    let before = statements(relay);
    let mut ids = Vec::new();
    for _ in 0..s.wake_runs {
        ids.extend(db.start_runs(flow.slug(), &flow.input(), 1).await?);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    wait_done(db, &ids, Duration::from_secs(60)).await?;
    let above = (statements(relay) - before) as f64 - idle_rate * window.elapsed().as_secs_f64();
    let per_task = above / (ids.len() * flow.tasks_per_run()).max(1) as f64;
    let connections = relay.counters.snapshot().tally.startups;
    Ok((connections, idle_rate, per_task))
}

/// The drain rate of `s.tasks` tasks started at once.
async fn drain(db: &BenchDb, s: &Settings, flow: BenchFlow) -> Result<f64, BenchError> {
    let runs = (s.tasks / flow.tasks_per_run()).max(1);
    let t0 = Instant::now();
    let ids = db.start_runs(flow.slug(), &flow.input(), runs).await?;
    wait_done(db, &ids, Duration::from_secs(600)).await?;
    Ok((runs * flow.tasks_per_run()) as f64 / t0.elapsed().as_secs_f64())
}

/// The idle latency probe: two rows (start → first handler, parent done → dependent handler).
pub(crate) async fn probe_latency(db: &BenchDb, s: &Settings) -> Result<Vec<Row>, BenchError> {
    let flow = BenchFlow::Diamond;
    db.settle().await?;
    let stop = CancellationToken::new();
    let mut set = Driver::Worker { max_concurrent: 16 }
        .spawn(db, &db.options, flow, stop.clone(), true)
        .await?;
    probe::enable(true);
    let mut start_to_first = Vec::new();
    let mut parent_to_dependent = Vec::new();
    let mut warmup = (Vec::new(), Vec::new());
    let mut ids = Vec::new();
    // Inputs far from the other scenarios' (all 1), one per sample.
    for i in 0..s.probe_warmup + s.probe_samples {
        let n = 1_000_000 + i as i64;
        let t0 = Instant::now();
        ids.extend(db.start_runs(flow.slug(), &serde_json::json!(n), 1).await?);
        tokio::time::sleep(s.probe_interval).await;
        let (Some(root), Some(done), Some(dep)) = (
            probe::get(probe::Mark::RootStarted, n),
            probe::get(probe::Mark::RootDone, n),
            probe::get(probe::Mark::DependentStarted, n),
        ) else {
            continue;
        };
        let (first, dependent) = if i < s.probe_warmup {
            (&mut warmup.0, &mut warmup.1)
        } else {
            (&mut start_to_first, &mut parent_to_dependent)
        };
        first.push(root.duration_since(t0).as_secs_f64() * 1000.0);
        dependent.push(dep.duration_since(done).as_secs_f64() * 1000.0);
    }
    let waited = wait_done(db, &ids, Duration::from_secs(60)).await;
    probe::enable(false);
    stop.cancel();
    while let Some(r) = set.join_next().await {
        r.map_err(|e| BenchError::Invalid(e.to_string()))??;
    }
    waited?;
    if start_to_first.len() < s.probe_samples {
        return Err(BenchError::Invalid(format!(
            "probe: {} of {} samples had run their first two handlers within {:?}",
            start_to_first.len(),
            s.probe_samples,
            s.probe_interval
        )));
    }
    let row = |what: &str, mut v: Vec<f64>, cold: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
        let cold = if cold.is_empty() {
            String::new()
        } else {
            let shown: Vec<String> = cold.iter().map(|ms| format!("{ms:.1}")).collect();
            format!(
                "; the {} warm-up runs before them, in order: {} ms",
                cold.len(),
                shown.join(", ")
            )
        };
        Row {
            what: format!("idle probe, 1 worker: {what}"),
            k: 16,
            value: at(0.5),
            unit: "ms p50",
            extra: format!(
                "p99 {:.1} ms, max {:.1} ms, {} samples {:?} apart{cold}",
                at(0.99),
                at(1.0),
                v.len(),
                s.probe_interval
            ),
            wal: None,
        }
    };
    let rows = vec![
        row("start → first handler", start_to_first, warmup.0),
        row(
            "parent done → dependent handler",
            parent_to_dependent,
            warmup.1,
        ),
    ];
    for r in &rows {
        eprintln!("{}: {:.1} ms; {}", r.what, r.value, r.extra);
    }
    Ok(rows)
}
