//! The pgflow-rs benchmark: raw PGMQ floor, the SQL core driven upstream-style, and the pgflow-rs
//! workers, all in one run on one durable database.
//!
//! `cargo run --release -p pgflow-bench --bin bench [-- --seconds 5 --tasks 6000 --k 1,4,16]`
//!
//! With `DATABASE_URL` unset it starts a throwaway PostgreSQL with the production defaults (`fsync`
//! and `synchronous_commit` on); with it set, it creates a database of its own on that server and drops
//! it when it ends, also after a failed scenario. It prints a markdown table; every figure is also given
//! as a ratio to the raw PGMQ floor measured in the same run at the same concurrency. A run that does
//! not complete makes the benchmark invalid: the process then exits non-zero.
//!
//! The history scenario (`--only history`; last in a full run, because it grows the database) drains the
//! same bursts on an empty database and again on a million finished tasks, and times the maintenance
//! statements on that history (`history.rs`).
//!
//! The processes scenario (`--only processes`: 1, 4 and 16 worker OS processes) and the idle latency probe
//! (`--only probe`) are in `processes.rs`; they run only when named.
//! The control scenario (`--only control`) measures tenant B's wait behind tenant A's backlog under a per-key
//! limit, and schedule fire lateness (`control.rs`). The priority scenario (`--only priority`) measures the wait
//! of low-priority runs under a steady high-priority load, and what each flow control costs (`priority.rs`).
//!
//! The exchange scenario (`--only exchange`; only when named) times one `pgflow.exchange` by its size, and
//! gives its fixed cost and its cost per output (`exchange_cost.rs`). The census (`--only census`; only when
//! named) lists every statement of one such exchange with its share of the time, from `pg_stat_statements`,
//! which the bench's own cluster then loads.
//!
//! The budget scenario (`--only budget`) drains the diamond flow with each driver through a counting relay and
//! prints round trips, statements, bytes, commits and WAL flushes per task (`budget.rs`).

mod budget;
mod control;
mod db;
mod exchange_cost;
mod floor;
mod flows;
mod history;
mod priority;
mod processes;
mod sql_driver;
mod sustained;

use std::process::ExitCode;
use std::time::{Duration, Instant};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use tokio_util::sync::CancellationToken;

use db::{BenchDb, BenchFlow};
use floor::FloorKind;

/// Why the benchmark could not produce valid figures.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BenchError {
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("{0}")]
    Throwaway(#[from] pgflow_sql::throwaway::ThrowawayError),
    #[error("install: {0}")]
    Install(#[from] pgflow_sql::InstallError),
    #[error("invalid benchmark: {0}")]
    Invalid(String),
}

/// Parses a fraction of the driver's drain rate in (0, 1].
fn load_fraction(value: &str) -> Result<f64, String> {
    let load: f64 = value.trim().parse().map_err(|e| format!("{e}"))?;
    if load > 0.0 && load <= 1.0 {
        Ok(load)
    } else {
        Err(format!("a fraction in (0, 1], not {load}"))
    }
}

/// Command-line settings.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "bench",
    about = "The pgflow-rs benchmark (results and method in BENCHMARKS.md). With DATABASE_URL unset it runs on a throwaway PostgreSQL with production settings."
)]
struct Args {
    /// Seconds per raw PGMQ scenario.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Tasks per drain scenario (runs = tasks / tasks per run).
    #[arg(long, default_value_t = 6000)]
    tasks: usize,
    /// Concurrency levels.
    #[arg(long = "k", value_delimiter = ',', default_values_t = [1, 4, 16])]
    ks: Vec<usize>,
    /// Seconds of arrivals in the latency scenarios whose runs are measured.
    #[arg(long, default_value_t = 8.0)]
    latency_seconds: f64,
    /// Seconds of arrivals, at the same rate, before those: the worker's connections plan their statements
    /// and the tables grow to their working size. Their runs are reported apart.
    #[arg(long, default_value_t = 1.0)]
    latency_warmup: f64,
    /// Offered loads of the latency scenario, as fractions of the driver's own drain rate.
    #[arg(long = "latency-load", value_delimiter = ',', value_parser = load_fraction, default_values_t = [0.5])]
    latency_loads: Vec<f64>,
    /// A fixed arrival rate (runs/s) multiplied by each load, instead of the drain rate (for comparisons
    /// between builds, whose drain rates differ from run to run).
    #[arg(long)]
    latency_rate: Option<f64>,
    /// How the latency scenarios start each 10 ms tick's runs: `set` (one `pgflow.start_flows` call) and/or
    /// `each` (one `pgflow.start_flow` call per run, in one statement).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Starts::Set])]
    latency_starts: Vec<Starts>,
    /// Run only the scenarios tagged with every one of these (all when empty): floor, sql, worker, latency,
    /// starvation, history, budget, processes, probe, sustained, control, priority, exchange, diamond, map10.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Time every pgflow and PGMQ function (`track_functions = 'pl'`) and print a profile per drain.
    #[arg(long)]
    profile: bool,
    /// Metrics and tracing on: a Prometheus recorder (rendered, not served) and an OpenTelemetry tracer
    /// provider whose spans go to a `tracing-opentelemetry` layer and are then dropped.
    #[arg(long)]
    observability: bool,
    /// Finished tasks the history scenario grows.
    #[arg(long, default_value_t = 1_000_000)]
    history_tasks: u64,
    /// Concurrency levels of the history scenario's drains.
    #[arg(long = "history-k", value_delimiter = ',', default_values_t = [4, 16])]
    history_ks: Vec<usize>,
    /// Drains per flow and K in each phase of the history scenario (the fastest counts).
    #[arg(long, default_value_t = 2)]
    history_repeat: usize,
    /// Tasks per drain in the history scenario.
    #[arg(long, default_value_t = 2000)]
    history_drain_tasks: usize,
    /// Tasks per drain in the budget scenario.
    #[arg(long, default_value_t = 2000)]
    budget_tasks: usize,
    /// Concurrency levels of the budget scenario.
    #[arg(long = "budget-k", value_delimiter = ',', default_values_t = [1, 4])]
    budget_ks: Vec<usize>,
    /// Seconds of the sustained-load scenario (0 leaves it out of a full run; `--only sustained` alone
    /// runs it for 180 s unless this says otherwise).
    #[arg(long, default_value_t = 0)]
    sustained_seconds: u64,
    /// The retention window of the sustained-load scenario's worker, in seconds.
    #[arg(long, default_value_t = 5)]
    sustained_retention: u64,
    /// The processes scenario and the idle probe.
    #[command(flatten)]
    processes: processes::Settings,
    /// Tenant A's backlog in the flow-control scenario.
    #[arg(long, default_value_t = 2000)]
    control_backlog: usize,
    /// Seconds the schedule of the flow-control scenario fires after the tenants drained.
    #[arg(long, default_value_t = 10)]
    control_seconds: u64,
    /// Seconds of steady high-priority load in the priority scenario.
    #[arg(long, default_value_t = 10)]
    priority_seconds: u64,
    /// Runs per drain in the flow-control overhead part of the priority scenario.
    #[arg(long, default_value_t = 1000)]
    priority_runs: usize,
    /// Rounds of the flow-control overhead part: each drains every control once (the median counts).
    #[arg(long, default_value_t = 5)]
    priority_rounds: usize,
    /// Timed exchanges per size in the exchange scenario.
    #[arg(long, default_value_t = 30)]
    exchange_reps: usize,
    /// The sizes of the exchange scenario: runs whose root outputs one timed exchange records (the fixed
    /// cost is fitted when there are two or more).
    #[arg(long = "exchange-sizes", value_delimiter = ',', default_values_t = [1, 4, 16, 32])]
    exchange_sizes: Vec<usize>,
    /// Runs whose root outputs each exchange of the census records.
    #[arg(long, default_value_t = 1)]
    census_size: usize,
    /// Exchanges the census counts (and as many untracked before them).
    #[arg(long, default_value_t = 200)]
    census_reps: usize,
}

impl Args {
    /// Whether a scenario whose tags are `tags` runs.
    fn wants(&self, tags: &[&str]) -> bool {
        self.only.is_empty() || self.only.iter().all(|o| tags.contains(&o.as_str()))
    }
}

/// Who executes the tasks.
#[derive(Debug, Clone, Copy)]
enum Driver {
    /// One upstream-style worker with `k` concurrent handlers (`sql_driver`: `read_with_poll` of up to 10,
    /// `start_tasks` for the batch, one `complete_task` per task, batch barrier), K + 1 connections.
    SqlUpstreamStyle { k: usize },
    /// One pgflow-rs plain worker with `max_concurrent` handlers (defaults otherwise).
    Worker { max_concurrent: usize },
}

impl Driver {
    fn label(self) -> String {
        match self {
            Driver::SqlUpstreamStyle { .. } => "SQL core, upstream-style driver".into(),
            Driver::Worker { .. } => "pgflow-rs worker".into(),
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Driver::SqlUpstreamStyle { .. } => "sql",
            Driver::Worker { .. } => "worker",
        }
    }

    fn k(self) -> usize {
        match self {
            Driver::SqlUpstreamStyle { k } => k,
            Driver::Worker { max_concurrent } => max_concurrent,
        }
    }

    /// Starts executing tasks of `flow` until `stop` fires; the driver's own connections use `options`
    /// (the budget scenario points them at its counting relay). With `prewarm` every connection of the
    /// driver's pool is opened before this returns.
    async fn spawn(
        self,
        db: &BenchDb,
        options: &sqlx::postgres::PgConnectOptions,
        flow: BenchFlow,
        stop: CancellationToken,
        prewarm: bool,
    ) -> Result<tokio::task::JoinSet<Result<(), BenchError>>, BenchError> {
        let slug = flow.slug();
        let mut set = tokio::task::JoinSet::new();
        match self {
            Driver::SqlUpstreamStyle { k } => {
                // Its connections are always opened up front.
                let connections = sql_driver::connect(options, k).await?;
                let worker_id = db.register_worker(&slug.to_lowercase()).await?;
                set.spawn(async move {
                    sql_driver::worker(connections, slug.to_string(), worker_id, k, stop)
                        .await
                        .map_err(BenchError::from)
                });
            }
            Driver::Worker { max_concurrent } => {
                // A pool of its own, sized as the worker's docs ask (completion flushers + 3), plus one.
                let connections =
                    pgflow_runtime::worker::WorkerConfig::default().completion_flushers as u32 + 4;
                let pool = sqlx::postgres::PgPoolOptions::new()
                    .max_connections(connections)
                    .connect_with(options.clone())
                    .await?;
                if prewarm {
                    let mut held = Vec::with_capacity(connections as usize);
                    for _ in 0..connections {
                        held.push(pool.acquire().await?);
                    }
                }
                let handle = match flow {
                    BenchFlow::Diamond => {
                        pgflow_runtime::Worker::<flows::diamond::Diamond>::builder(pool.clone())
                            .max_concurrent(max_concurrent)
                            .build()
                            .map_err(|e| BenchError::Invalid(e.to_string()))?
                            .spawn(stop.clone())
                            .await
                    }
                    BenchFlow::Map10 => {
                        pgflow_runtime::Worker::<flows::map10::Map10>::builder(pool.clone())
                            .max_concurrent(max_concurrent)
                            .build()
                            .map_err(|e| BenchError::Invalid(e.to_string()))?
                            .spawn(stop.clone())
                            .await
                    }
                }
                .map_err(|e| BenchError::Invalid(format!("worker startup: {e}")))?;
                set.spawn(async move {
                    let report = handle.join().await;
                    pool.close().await;
                    report
                        .map(drop)
                        .map_err(|e| BenchError::Invalid(format!("worker: {e}")))
                });
            }
        }
        Ok(set)
    }
}

/// One line of the results table.
#[derive(Debug, Clone)]
struct Row {
    what: String,
    k: usize,
    value: f64,
    unit: &'static str,
    extra: String,
    /// WAL written per task during a drain.
    wal: Option<Wal>,
}

/// A figure as the table shows it: ratios (unit ×) and values under 10 with two decimals, others whole.
fn shown(value: f64, unit: &str) -> String {
    if unit == "×" || value.abs() < 10.0 {
        format!("{value:.2}")
    } else {
        format!("{value:.0}")
    }
}

/// The figures of a scenario as table rows (at `k` handlers or clients), or its refusal among the invalid
/// results.
fn take_figures(
    scenario: &str,
    k: usize,
    figures: Result<Vec<control::Figure>, BenchError>,
    rows: &mut Vec<Row>,
    invalid: &mut Vec<String>,
) -> Result<(), BenchError> {
    match figures {
        Ok(figures) => {
            for f in figures {
                eprintln!(
                    "{}: {} {}; {}",
                    f.what,
                    shown(f.value, f.unit),
                    f.unit,
                    f.extra
                );
                rows.push(Row {
                    what: f.what,
                    k,
                    value: f.value,
                    unit: f.unit,
                    extra: f.extra,
                    wal: None,
                });
            }
            Ok(())
        }
        Err(BenchError::Invalid(message)) => {
            eprintln!("{scenario}: INVALID: {message}");
            invalid.push(format!("{scenario}: {message}"));
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// WAL a drain wrote, per task: bytes and full-page images (from the driver's start to the last completion).
#[derive(Debug, Clone, Copy)]
struct Wal {
    bytes_per_task: f64,
    fpi_per_task: f64,
}

#[tokio::main]
async fn main() -> ExitCode {
    if std::env::args().nth(1).as_deref() == Some("--worker-process") {
        return match processes::child_main().await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("bench worker process: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let args = <Args as clap::Parser>::parse();
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let provider = args.observability.then(observability_on);
    let otel = provider.as_ref().map(|p| {
        use opentelemetry::trace::TracerProvider as _;
        tracing_opentelemetry::layer().with_tracer(p.tracer("bench"))
    });
    tracing_subscriber::registry()
        .with(otel)
        .with(filter)
        .with(fmt)
        .init();
    if provider.is_some() {
        eprintln!("observability: metrics (Prometheus recorder) and tracing (OpenTelemetry) on");
    }
    match run(&args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Installs a Prometheus recorder (not served: the bench measures recording, not scraping) and an
/// OpenTelemetry tracer provider (global) that samples every span and drops it at the end.
fn observability_on() -> opentelemetry_sdk::trace::SdkTracerProvider {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .expect("the metrics recorder installs");
    pgflow_runtime::observability::describe();
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_id_generator(pgflow_runtime::observability::otel::AttemptIds::default())
        .build();
    opentelemetry::global::set_tracer_provider(provider.clone());
    provider
}

/// How far the batched floor measured again after the latency runs may move from the first measurement
/// for the run to count as quiet.
const QUIET_WITHIN: f64 = 0.15;

async fn run(args: &Args) -> Result<(), BenchError> {
    let started = Instant::now();
    // With --observability every run is started in one trace (a root span made here), so every task attempt
    // is a span, as with a client that starts runs inside traced requests.
    let trace_context = args
        .observability
        .then(|| pgflow_runtime::observability::otel::start_context("bench"))
        .flatten()
        .map(|v| v.to_string());
    let census = args.only.iter().any(|o| o == "census");
    let db = BenchDb::open(args.profile, trace_context.as_deref(), census).await?;
    let measured = measure(args, &db, census, started).await;
    // On a server given by DATABASE_URL, the bench's database goes too, also after a failed scenario.
    let removed = db.remove().await;
    measured?;
    removed
}

/// Every scenario `args` asks for, on `db` (`census`: the census is among them); prints the results.
async fn measure(
    args: &Args,
    db: &BenchDb,
    census: bool,
    started: Instant,
) -> Result<(), BenchError> {
    eprintln!("server: {}", db.server_version);
    eprintln!("settings: {}", db.settings);
    let mut rows: Vec<Row> = Vec::new();
    let mut invalid: Vec<String> = Vec::new();
    let seconds = Duration::from_secs_f64(args.seconds);

    // The floor (not for a history-, budget- or sustained-only selection: those compare drivers by their own
    // counts).
    let floor_kinds = if args.only.iter().any(|o| {
        matches!(
            o.as_str(),
            "history" | "budget" | "processes" | "probe" | "sustained" | "census"
        )
    }) {
        Vec::new()
    } else {
        vec![
            FloorKind::Pipeline,
            FloorKind::Relay,
            FloorKind::RelayBatched,
        ]
    };
    for kind in floor_kinds {
        for &k in &args.ks {
            db.settle().await?;
            let rate = floor::run(db, kind, k, seconds).await?;
            eprintln!("{} K={k}: {rate:.0} msg/s", kind.label());
            rows.push(Row {
                what: kind.label().into(),
                k,
                value: rate,
                unit: "msg/s",
                extra: String::new(),
                wal: None,
            });
        }
    }
    let floor_at = |rows: &[Row], k: usize, label: &str| {
        rows.iter()
            .find(|r| r.k == k && r.what == label)
            .map(|r| r.value)
    };

    // Drain throughput.
    for flow in [BenchFlow::Diamond, BenchFlow::Map10] {
        for driver in args.ks.iter().flat_map(|&k| {
            [
                Driver::SqlUpstreamStyle { k },
                Driver::Worker { max_concurrent: k },
            ]
        }) {
            let k = driver.k();
            if !args.wants(&[driver.tag(), flow.name()]) {
                continue;
            }
            let row = drain(db, flow, driver, args.tasks, AfterDrain::DeleteFlow).await;
            record(
                db,
                &mut rows,
                &mut invalid,
                row,
                drain_label(flow, driver),
                k,
                flow,
            )
            .await?;
        }
    }

    // Latency at fractions of the drain throughput (half by default), with the highest concurrency.
    let k_max = args.ks.iter().copied().max().unwrap_or(1);
    let mut latency_ran = false;
    for driver in [
        Driver::SqlUpstreamStyle { k: k_max },
        Driver::Worker {
            max_concurrent: k_max,
        },
    ] {
        let flow = BenchFlow::Diamond;
        if !args.wants(&["latency", driver.tag(), flow.name()]) {
            continue;
        }
        let drained = rows
            .iter()
            .find(|r| r.k == k_max && r.what == drain_label(flow, driver))
            .map_or(100.0, |r| r.value);
        let full = args
            .latency_rate
            .unwrap_or(drained / flow.tasks_per_run() as f64);
        for starts in &args.latency_starts {
            for load in &args.latency_loads {
                let row = latency(
                    db,
                    flow,
                    driver,
                    *starts,
                    full * load,
                    Duration::from_secs_f64(args.latency_warmup),
                    Duration::from_secs_f64(args.latency_seconds),
                )
                .await;
                let label = format!(
                    "{}: {} latency at {:.0} % of its drain rate{}",
                    driver.label(),
                    flow.name(),
                    load * 100.0,
                    starts.label()
                );
                record(db, &mut rows, &mut invalid, row, label, driver.k(), flow).await?;
                latency_ran = true;
            }
        }
    }

    // Host check: the batched floor again, at the highest K, now that the drains and latency runs are
    // done. On shared cores the host's speed can change within minutes; a run is quiet only if this stays
    // close to the first measurement.
    let first_floor = floor_at(&rows, k_max, FloorKind::RelayBatched.label());
    if let (Some(first), true) = (first_floor, latency_ran) {
        db.settle().await?;
        let again = floor::run(db, FloorKind::RelayBatched, k_max, seconds).await?;
        let change = again / first - 1.0;
        let verdict = if change.abs() <= QUIET_WITHIN {
            "quiet"
        } else {
            "NOT QUIET: the host's speed changed during the run"
        };
        let row = Row {
            what: format!("host check: {}, again after the latency runs", FloorKind::RelayBatched.label()),
            k: k_max,
            value: again,
            unit: "msg/s",
            extra: format!(
                "{:+.0} % against the first measurement ({first:.0} msg/s); {verdict} (a quiet run stays within ±{:.0} %)",
                change * 100.0,
                QUIET_WITHIN * 100.0
            ),
            wal: None,
        };
        eprintln!("{} K={k_max}: {again:.0} msg/s; {}", row.what, row.extra);
        rows.push(row);
    }

    // Many worker processes, and the idle latency probe: only when named (`--only processes`, `--only probe`).
    if args.only.iter().any(|o| o == "processes") {
        rows.extend(processes::processes(db, &args.processes).await?);
    }
    if args.only.iter().any(|o| o == "probe") {
        rows.extend(processes::probe_latency(db, &args.processes).await?);
    }
    // What one exchange costs by its size: only when named (`--only exchange`).
    if args.only.iter().any(|o| o == "exchange") {
        db.settle().await?;
        let figures = exchange_cost::run(db, &args.exchange_sizes, args.exchange_reps).await;
        take_figures("exchange", 1, figures, &mut rows, &mut invalid)?;
    }
    // Every statement of one exchange: only when named (`--only census`).
    if census {
        db.settle().await?;
        let figures = exchange_cost::census(db, args.census_size, args.census_reps).await;
        take_figures("census", 1, figures, &mut rows, &mut invalid)?;
    }

    // Starvation: the community-threads burst in plain and step-queued modes.
    if args.wants(&["starvation"]) {
        use pgflow_examples::community::{run_mode, Mode};
        for mode in [Mode::Plain, Mode::StepQueued] {
            db.settle().await?;
            let r = run_mode(&db.options, mode, 200, Duration::from_secs(120))
                .await
                .map_err(|e| BenchError::Invalid(format!("community_threads {mode:?}: {e}")))?;
            if r.completed != r.runs {
                invalid.push(format!(
                    "community_threads {mode:?}: {} of {} runs completed",
                    r.completed, r.runs
                ));
            }
            let row = Row {
                what: format!("starvation, deliverSlack ready → done p99; {}", mode.label()),
                k: 4,
                value: r.deliver_p99_ms,
                unit: "ms p99",
                extra: format!(
                    "{}/{} runs completed in {:.2} s; {} deliveries during the classify backlog, p50 {:.0} ms",
                    r.completed,
                    r.runs,
                    r.makespan.as_secs_f64(),
                    r.delivered_during_backlog,
                    r.deliver_p50_ms
                ),
                wal: None,
            };
            eprintln!("{}: {:.0} ms; {}", row.what, row.value, row.extra);
            rows.push(row);
        }
    }

    // Sustained load with retention at a short window: history stays bounded, the rate steady.
    let sustained_only = args.only.iter().any(|o| o == "sustained");
    if args.sustained_seconds > 0 || sustained_only {
        let settings = sustained::Settings {
            duration: Duration::from_secs(if args.sustained_seconds > 0 {
                args.sustained_seconds
            } else {
                180
            }),
            retention: Duration::from_secs(args.sustained_retention),
            k: args.ks.iter().copied().max().unwrap_or(16),
        };
        match sustained::run(db, settings).await {
            Ok(sustained_rows) => rows.extend(sustained_rows),
            Err(BenchError::Invalid(message)) => {
                eprintln!("sustained: INVALID: {message}");
                invalid.push(format!("sustained: {message}"));
            }
            Err(e) => return Err(e),
        }
    }

    // Flow control and schedules: tenant B's wait behind tenant A's backlog, schedule fire lateness.
    if args.wants(&["control"]) {
        db.settle().await?;
        let figures = control::run(db, args.control_backlog, args.control_seconds).await;
        take_figures("control", 16, figures, &mut rows, &mut invalid)?;
    }

    // Priorities under load, and what each flow control costs.
    if args.wants(&["priority"]) {
        db.settle().await?;
        let figures = priority::run(
            db,
            args.priority_seconds,
            args.priority_runs,
            args.priority_rounds,
        )
        .await;
        take_figures("priority", 16, figures, &mut rows, &mut invalid)?;
    }

    // History: the same drains on an empty database and on a large finished history. Last, because it
    // grows the database.
    // A selection runs it only when it names `history` (`--only worker,diamond` is the worker's drains, not
    // a million-task history); `--history-tasks 0` leaves it out of a full run.
    let flows: Vec<BenchFlow> = [BenchFlow::Diamond, BenchFlow::Map10]
        .into_iter()
        .filter(|f| {
            args.history_tasks > 0
                && (args.only.is_empty() || args.only.iter().any(|o| o == "history"))
                && args.wants(&["history", "worker", f.name()])
        })
        .collect();
    // Budget: round trips, statements, bytes, commits and WAL flushes per task, through a counting relay.
    let mut budget = None;
    if args.wants(&["budget"]) {
        match budget::run(db, &args.budget_ks, args.budget_tasks).await {
            Ok(report) => budget = Some(report),
            Err(BenchError::Invalid(message)) => {
                eprintln!("budget: INVALID: {message}");
                invalid.push(format!("budget: {message}"));
            }
            Err(e) => return Err(e),
        }
    }

    let mut history = None;
    if !flows.is_empty() {
        let settings = history::Settings {
            tasks: args.history_tasks,
            ks: args.history_ks.clone(),
            drain_tasks: args.history_drain_tasks,
            repeat: args.history_repeat,
            flows,
        };
        match history::run(db, &settings).await {
            Ok(report) => history = Some(report),
            Err(BenchError::Invalid(message)) => {
                eprintln!("history: INVALID: {message}");
                invalid.push(message);
            }
            Err(e) => return Err(e),
        }
    }

    print_table(db, args, &rows, floor_at, started.elapsed());
    if let Some(report) = budget {
        report.print();
    }
    if let Some(report) = history {
        report.print();
    }
    if invalid.is_empty() {
        Ok(())
    } else {
        Err(BenchError::Invalid(format!(
            "{} scenario(s) lost runs:\n- {}",
            invalid.len(),
            invalid.join("\n- ")
        )))
    }
}

/// Adds a scenario's row; an invalid scenario (lost runs) is recorded, its data removed, and the
/// benchmark goes on so one run shows every figure (it still exits non-zero at the end).
async fn record(
    db: &BenchDb,
    rows: &mut Vec<Row>,
    invalid: &mut Vec<String>,
    row: Result<Row, BenchError>,
    label: String,
    k: usize,
    flow: BenchFlow,
) -> Result<(), BenchError> {
    match row {
        Ok(row) => {
            eprintln!(
                "{} K={}: {:.0} {}; {}",
                row.what, row.k, row.value, row.unit, row.extra
            );
            rows.push(row);
        }
        Err(BenchError::Invalid(message)) => {
            eprintln!("{label} K={k}: INVALID: {message}");
            invalid.push(format!("{label} K={k}: {message}"));
            rows.push(Row {
                what: label,
                k,
                value: f64::NAN,
                unit: "INVALID",
                extra: message,
                wal: None,
            });
            cleanup(db, flow.slug()).await?;
        }
        Err(e) => return Err(e),
    }
    Ok(())
}

fn drain_label(flow: BenchFlow, driver: Driver) -> String {
    format!("{}: {} drain", driver.label(), flow.name())
}

/// What a drain leaves in the database when it is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AfterDrain {
    /// Delete the flow with all its data (the next scenario starts from an empty database).
    DeleteFlow,
    /// Keep the flow, the drained runs and everything else (the history scenario's large history).
    Keep,
}

/// Starts `tasks / tasks_per_run` runs at once, then lets `driver` drain them; tasks per second from the
/// first claim to the last run's completion (database clock). While it waits the harness polls only the
/// open work (`BenchDb::progress`), so its own cost does not depend on the finished history; the results are
/// read from the runs this drain started.
async fn drain(
    db: &BenchDb,
    flow: BenchFlow,
    driver: Driver,
    tasks: usize,
    after: AfterDrain,
) -> Result<Row, BenchError> {
    let slug = flow.slug();
    db.compile(slug, &flow.shape()).await?;
    let runs = tasks.div_ceil(flow.tasks_per_run());
    let run_ids = db.start_runs(slug, &flow.input(), runs).await?;
    db.settle().await?;
    sqlx::query("select pg_stat_reset()")
        .execute(&db.pool)
        .await?;
    let (t0, wal0): (chrono_like::Ts, (i64, i64)) = (
        sqlx::query_scalar("select extract(epoch from clock_timestamp())::float8")
            .fetch_one(&db.pool)
            .await?,
        db.wal().await?,
    );
    let stop = CancellationToken::new();
    let mut set = driver
        .spawn(db, &db.options, flow, stop.clone(), false)
        .await?;
    let limit = Instant::now() + Duration::from_secs(300);
    let (mut last_work, mut last_change) = ((-1_i64, -1_i64), Instant::now());
    let outcome = loop {
        if let Some(Ok(Err(e))) = set.try_join_next() {
            break Err(e);
        }
        // Progress is tasks completing (the work in flight changes): a run may need every earlier task
        // drained first.
        let (open, work) = db.progress().await?;
        if open == 0 {
            break Ok(());
        }
        if work != last_work {
            (last_work, last_change) = (work, Instant::now());
        } else if last_change.elapsed() > Duration::from_secs(20) {
            let state = db.dump_state(slug).await?;
            break Err(BenchError::Invalid(format!(
                "{open} runs open and no task completed for 20 s; {state}"
            )));
        }
        if Instant::now() > limit {
            let state = db.dump_state(slug).await?;
            break Err(BenchError::Invalid(format!(
                "{}: {open} runs still open after 300 s; {state}",
                drain_label(flow, driver)
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    stop.cancel();
    while let Some(joined) = set.join_next().await {
        joined.map_err(|e| BenchError::Invalid(format!("driver panicked: {e}")))??;
    }
    outcome?;
    // The worker's connections are closed; give their backends a moment to report their WAL statistics.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let wal1 = db.wal().await?;
    db.verify_completed(&run_ids).await?;
    // The clock starts at the first claim: a task's `started_at` is the start of the transaction that
    // claimed it (no task is retried here, so none has a later attempt's). The driver's start-up before it
    // (connecting, registering, checking the flow) is reported beside the rate, not counted in it.
    let (startup, elapsed): (f64, f64) = sqlx::query_as(
        "with first as (select min(started_at) as at from pgflow.step_tasks where run_id = any ($1)),
              last as (select max(completed_at) as at from pgflow.runs where run_id = any ($1))
         select extract(epoch from first.at)::float8 - $2, extract(epoch from last.at - first.at)::float8
         from first, last",
    )
    .bind(&run_ids)
    .bind(t0)
    .fetch_one(&db.pool)
    .await?;
    let lat = db.run_latency(&run_ids).await?;
    let (p50, p99) = (lat.p50, lat.p99);
    if after == AfterDrain::DeleteFlow {
        cleanup(db, slug).await?;
    }
    let total_tasks = runs * flow.tasks_per_run();
    if db.profile {
        let profile = db.function_profile(total_tasks).await?;
        println!(
            "\n#### profile: {} K={}\n\n{profile}",
            drain_label(flow, driver),
            driver.k()
        );
    }
    Ok(Row {
        what: drain_label(flow, driver),
        k: driver.k(),
        value: total_tasks as f64 / elapsed,
        unit: "tasks/s",
        extra: format!(
            "{runs} runs, {total_tasks} tasks in {elapsed:.2} s from the first claim ({:.0} ms after the driver's start); {:.0} runs/s (run latency in a bulk drain: p50 {p50:.0} ms, p99 {p99:.0} ms)",
            startup * 1000.0,
            runs as f64 / elapsed
        ),
        wal: Some(Wal {
            bytes_per_task: (wal1.0 - wal0.0) as f64 / total_tasks as f64,
            fpi_per_task: (wal1.1 - wal0.1) as f64 / total_tasks as f64,
        }),
    })
}

/// How the latency harness starts a tick's runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Starts {
    /// One `pgflow.start_flows` call for the tick's runs.
    Set,
    /// One `pgflow.start_flow` call per run (all in one statement), as before `start_flows` existed.
    Each,
}

impl Starts {
    /// The name `--latency-starts` takes.
    fn name(self) -> &'static str {
        match self {
            Starts::Set => "set",
            Starts::Each => "each",
        }
    }

    /// The suffix of a latency row's label.
    fn label(self) -> &'static str {
        match self {
            Starts::Set => "",
            Starts::Each => ", one start_flow per run",
        }
    }
}

/// Starts runs at `rate` per second for `warmup` and then for `duration` while `driver` executes them;
/// reports runs/s and the p50/p99 start-to-finish latency of the runs started after the warm-up, from the
/// database's timestamps, and the p99 and max of the warm-up's runs beside them.
///
/// The warm-up is the driver's first contact with the load: each of its connections plans its statements on
/// first use (a connection's first exchange takes about ten times as long as the next), and the tables grow
/// from empty to their working size. Arrivals do not pause between the two periods.
async fn latency(
    db: &BenchDb,
    flow: BenchFlow,
    driver: Driver,
    starts: Starts,
    rate: f64,
    warmup: Duration,
    duration: Duration,
) -> Result<Row, BenchError> {
    let slug = flow.slug();
    db.compile(slug, &flow.shape()).await?;
    db.settle().await?;
    let stop = CancellationToken::new();
    let mut set = driver
        .spawn(db, &db.options, flow, stop.clone(), false)
        .await?;
    let input = flow.input();
    let started = Instant::now();
    let (mut warm_ids, mut run_ids) = (Vec::new(), Vec::new());
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    while started.elapsed() < warmup + duration {
        tick.tick().await;
        let elapsed = started.elapsed();
        let owed = (elapsed.as_secs_f64() * rate) as usize;
        let due = owed.saturating_sub(warm_ids.len() + run_ids.len());
        if due > 0 {
            let ids = match starts {
                Starts::Set => db.start_runs(slug, &input, due).await?,
                Starts::Each => db.start_runs_each(slug, &input, due).await?,
            };
            if elapsed < warmup {
                warm_ids.extend(ids);
            } else {
                run_ids.extend(ids);
            }
        }
    }
    let limit = Instant::now() + Duration::from_secs(120);
    let outcome = loop {
        if db.progress().await?.0 == 0 {
            break Ok(());
        }
        if let Some(Ok(Err(e))) = set.try_join_next() {
            break Err(e);
        }
        if Instant::now() > limit {
            break Err(BenchError::Invalid(format!(
                "{slug}: runs still open 120 s after the last arrival"
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    stop.cancel();
    while let Some(joined) = set.join_next().await {
        joined.map_err(|e| BenchError::Invalid(format!("driver panicked: {e}")))??;
    }
    outcome?;
    db.verify_completed(&warm_ids).await?;
    db.verify_completed(&run_ids).await?;
    let completed = run_ids.len();
    let lat = db.run_latency(&run_ids).await?;
    let warmed = if warm_ids.is_empty() {
        String::new()
    } else {
        let warm = db.run_latency(&warm_ids).await?;
        format!(
            "; the {} runs of the {:.1} s warm-up before them: p99 {:.0} ms, max {:.0} ms",
            warm_ids.len(),
            warmup.as_secs_f64(),
            warm.p99,
            warm.max
        )
    };
    cleanup(db, slug).await?;
    Ok(Row {
        what: format!(
            "{}: {} latency at {rate:.0} runs/s{}",
            driver.label(),
            flow.name(),
            starts.label()
        ),
        k: driver.k(),
        value: lat.p50,
        unit: "ms p50",
        extra: format!(
            "{completed} runs at {:.0} runs/s offered; start to finish p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms; \
             per task (median, p99): {:.1} ms, {:.1} ms queued before its claim; {:.1} ms, {:.1} ms from claim to \
             recorded output{warmed}",
            completed as f64 / duration.as_secs_f64(),
            lat.p50,
            lat.p99,
            lat.max,
            lat.task_wait_p50,
            lat.task_wait_p99,
            lat.task_claimed_p50,
            lat.task_claimed_p99,
        ),
        wal: None,
    })
}

async fn cleanup(db: &BenchDb, slug: &str) -> Result<(), sqlx::Error> {
    sqlx::query("select pgflow.delete_flow_and_data($1)")
        .bind(slug)
        .execute(&db.pool)
        .await?;
    Ok(())
}

fn print_table(
    db: &BenchDb,
    args: &Args,
    rows: &[Row],
    floor_at: impl Fn(&[Row], usize, &str) -> Option<f64>,
    elapsed: Duration,
) {
    println!("## pgflow-rs benchmark\n");
    println!("- server: {}", db.server_version);
    println!("- settings: {}", db.settings);
    println!(
        "- machine: {} CPUs; settings: --seconds {} --tasks {} --k {:?} --latency-seconds {} --latency-load {:?} --latency-starts {} --history-tasks {} --history-k {:?} --history-repeat {} --history-drain-tasks {} --budget-tasks {} --budget-k {:?}; whole run {:.0} s\n",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        args.seconds,
        args.tasks,
        args.ks,
        args.latency_seconds,
        args.latency_loads,
        args.latency_starts
            .iter()
            .map(|s| s.name())
            .collect::<Vec<_>>()
            .join(","),
        args.history_tasks,
        args.history_ks,
        args.history_repeat,
        args.history_drain_tasks,
        args.budget_tasks,
        args.budget_ks,
        elapsed.as_secs_f64()
    );
    if rows.is_empty() {
        return;
    }
    println!(
        "| scenario | K | result | ÷ pipeline floor (same K) | ÷ batched relay (same K) | notes |"
    );
    println!("|---|---:|---:|---:|---:|---|");
    for row in rows {
        let ratio = |label: &str| {
            if !row.unit.ends_with("/s") {
                return String::new();
            }
            floor_at(rows, row.k, label).map_or(String::new(), |f| format!("{:.2}", row.value / f))
        };
        let value = shown(row.value, row.unit);
        println!(
            "| {} | {} | {value} {} | {} | {} | {} |",
            row.what,
            row.k,
            row.unit,
            ratio(FloorKind::Pipeline.label()),
            ratio(FloorKind::RelayBatched.label()),
            row.extra
        );
    }
}

/// The database clock as seconds since the epoch.
mod chrono_like {
    pub(crate) type Ts = f64;
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// Clap's own checks of the options, which a release build skips: two options with one id made the bench
    /// refuse every command line ("required argument tasks").
    #[test]
    fn the_command_line_is_well_formed() {
        super::Args::command().debug_assert();
    }
}
