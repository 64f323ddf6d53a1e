//! The community-threads pipeline behind the alias `communityThreads`, rolled out from V1 to V2 while runs
//! are in flight, with faults injected and measured. `examples/INTEGRATION.md` is the report of a run.
//!
//! `cargo run -p pgflow-examples --bin community_rollout`
//!
//! Every worker is a process of its own (this program started again with a hidden subcommand), as a
//! supervisor such as systemd would run it: two processes of worker function `community-classify` on
//! queue `classify_threads` and two of `community-deliver` on `deliver_slack_alerts`. The program plays
//! the producer, the operator and the supervisor, in this order:
//!
//! 1. **V1 live**: V1-only processes; a burst of threads started by alias.
//! 2. **Rollout** (`pgflow-sql/OPERATIONS.md`) while V1 runs are in flight: record and disable both
//!    functions, deprecate their workers and wait until they have stopped (meanwhile
//!    `version_retirable` says V1 is *not* retirable), start the V1+V2 builds while disabled (each
//!    compiles V2, stops at the fence and exits without claiming; the alias stays at V1, so runs started
//!    now are still V1), re-enable the recorded set and start them for real: the first of them to start
//!    points the alias at V2.
//! 3. **Drain and faults**: a burst started by alias runs as V2 while the earlier V1 runs finish on V1's
//!    handlers. A run started through V1's typed deployment is a V2 run: its V1-typed handle refuses to
//!    wait (`WaitError::OtherVersion`), the V2 handle from `as_version` waits. Meanwhile one classify
//!    process is SIGKILLed while it holds tasks (its sibling recovers them after the dead-worker timeout)
//!    and one deliver process is SIGSTOPped in the middle of a slow webhook call until its task has been
//!    recovered and completed elsewhere, then resumed (its late result is ignored as stale, its second
//!    Slack post refused by the domain's unique key). Some threads make the model fail once (retry). A
//!    V2-only deliver build is refused while V1 drains.
//! 4. **A message read twice**: the visibility of a running task's message is reset by hand, so a second
//!    read sees it while the first attempt still runs.
//! 5. **Retire V1** once `version_retirable` says so for both queues, with the same fence, and run V2-only
//!    builds.
//! 6. **Mistakes and rollback**: the retired V1-only build, started again while a V2 run waits, is refused
//!    and moves no alias. An operator rolls back to V1 with `pgflow.activate_alias` (runs started by alias
//!    are V1 again, and wait until a build serving V1 runs: the V2-only build is refused), runs a rollback
//!    build that serves V1 last, and rolls forward to V2 the same way; an explicit move lasts until a build
//!    serving another version last starts (a restarted rollback build moves the alias back to V1), so V1+V2
//!    builds replace the rollback builds. Last, the retired build started once nothing of V2 is in flight
//!    passes its checks and does move the alias, which is why a retired build must stay where supervision
//!    cannot start it; the operator moves the alias back.
//! 7. **Verify and report**: everything is checked from the database; any expectation that does not hold
//!    ends the program with a non-zero exit and a one-line error.
//!
//! With `DATABASE_URL` unset it uses a throwaway PostgreSQL, removed at exit.

use std::collections::BTreeMap;
use std::process::{ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use pgflow_examples::rollout::threads_v1::ThreadsV1;
use pgflow_examples::rollout::threads_v2::ThreadsV2;
use pgflow_examples::rollout::{
    self, classify_worker, deliver_worker, CommunityThreadsV1, CommunityThreadsV2, Thread,
    Versions, ALIAS, CLASSIFY_CONCURRENCY, CLASSIFY_FUNCTION, DEAD_WORKER_TIMEOUT,
    DELIVER_CONCURRENCY, DELIVER_FUNCTION, SLOW_MODEL_THREAD, SLOW_WEBHOOK_THREAD,
};
use pgflow_runtime::worker::shutdown_signal;
use pgflow_runtime::{
    client, client::WaitError, worker::WorkerBuilder, worker::WorkerError, Client, Deployment,
};
use pgflow_sql::throwaway::{fresh_database, Contents};
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const V1: &str = "communityThreadsV1";
const V2: &str = "communityThreadsV2";
const CLASSIFY_QUEUE: &str = "classify_threads";
const DELIVER_QUEUE: &str = "deliver_slack_alerts";
/// The hidden subcommand that runs one worker process.
const WORKER_SUBCOMMAND: &str = "__worker";
/// Where a worker process finds the database (not an argument: a URL may hold a password).
const URL_VARIABLE: &str = "COMMUNITY_ROLLOUT_DATABASE_URL";
/// The process's name, its connections' `application_name`.
const NAME_VARIABLE: &str = "COMMUNITY_ROLLOUT_PROCESS";
/// The thread started through V1's typed deployment after the alias moved to V2 (a help thread, so its
/// run output has a delivery).
const TYPED_HANDLE_THREAD: i64 = 302;
/// The longest the program waits for any one thing.
const LIMIT: Duration = Duration::from_secs(40);

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some(WORKER_SUBCOMMAND) {
        return worker_process(&args[1..]).await;
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "error".into()),
        )
        .init();
    if !args.is_empty() {
        eprintln!("usage: community_rollout (no arguments)");
        return ExitCode::FAILURE;
    }
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("community_rollout: {}", one_line(&e.to_string()));
            ExitCode::FAILURE
        }
    }
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Fails with `what` unless `ok`.
fn expect(ok: bool, what: impl FnOnce() -> String) -> Result<(), BoxError> {
    if ok {
        Ok(())
    } else {
        Err(format!("expectation failed: {}", what()).into())
    }
}

// ------------------------------------------------------------------------------------------------------
// The worker process
// ------------------------------------------------------------------------------------------------------

/// `__worker classify|deliver v1|v1v2|v2v1|v2`: one process of a worker function. Prints one line when it is
/// serving (`ready <worker id> <startup banner>`), then one when it stops (`report ...`), or one line
/// `fenced ...` when its function is disabled, or `error ...`.
async fn worker_process(args: &[String]) -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_ansi(false)
        .with_writer(std::io::stderr)
        .init();
    let result = async {
        let (queue, versions) = match args {
            [queue, versions] => (
                queue.as_str(),
                Versions::parse(versions).ok_or("bad versions")?,
            ),
            _ => {
                return Err::<(), BoxError>(
                    "usage: __worker classify|deliver v1|v1v2|v2v1|v2".into(),
                )
            }
        };
        let options: PgConnectOptions = std::env::var(URL_VARIABLE)?.parse()?;
        let options = options.application_name(&std::env::var(NAME_VARIABLE)?);
        let pool = PgPoolOptions::new()
            .max_connections(10)
            .connect_with(options)
            .await?;
        let token = CancellationToken::new();
        let on_signal = token.clone();
        tokio::spawn(async move {
            shutdown_signal().await;
            on_signal.cancel();
        });
        match queue {
            "classify" => serve(classify_worker(pool, versions), token).await,
            "deliver" => serve(deliver_worker(pool, versions), token).await,
            other => Err(format!("unknown queue {other}").into()),
        }
    }
    .await;
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            println!("error {}", one_line(&e.to_string()));
            ExitCode::FAILURE
        }
    }
}

async fn serve<K>(builder: WorkerBuilder<K>, token: CancellationToken) -> Result<(), BoxError> {
    match builder.build()?.spawn(token).await {
        Ok(handle) => {
            let banner: Vec<String> = handle
                .deployments()
                .iter()
                .map(ToString::to_string)
                .collect();
            println!("ready {} {}", handle.id(), banner.join("; "));
            let r = handle.join().await?;
            println!(
                "report completed={} failed={} stale={} released={} stop={:?}",
                r.completed, r.failed, r.stale, r.released, r.stop_reason
            );
            Ok(())
        }
        // A build started while its function is fenced stops at the fence: it has compiled its versions but
        // moves no alias and claims nothing (rollout step 3).
        Err(e @ WorkerError::FunctionDisabled { .. }) => {
            println!("fenced {}", one_line(&e.to_string()));
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

// ------------------------------------------------------------------------------------------------------
// The supervisor
// ------------------------------------------------------------------------------------------------------

/// Which queue a worker process polls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Classify,
    Deliver,
}

impl Role {
    fn arg(self) -> &'static str {
        match self {
            Role::Classify => "classify",
            Role::Deliver => "deliver",
        }
    }
}

/// What a worker process said when it stopped.
#[derive(Debug, Clone, Default)]
struct Stopped {
    completed: u64,
    failed: u64,
    stale: u64,
    released: u64,
    stop: String,
}

/// One worker process.
struct Proc {
    name: String,
    child: Child,
    pid: i32,
    worker_id: Option<Uuid>,
    /// The startup banner: each deployment's compile status and what happened to its alias.
    banner: String,
    lines: mpsc::UnboundedReceiver<String>,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    async fn next_line(&mut self) -> Result<Option<String>, BoxError> {
        match tokio::time::timeout(LIMIT, self.lines.recv()).await {
            Ok(line) => Ok(line),
            Err(_) => Err(format!("{}: no output within {LIMIT:?}", self.name).into()),
        }
    }

    fn signal(&self, signal: Signal) -> Result<(), BoxError> {
        kill(Pid::from_raw(self.pid), signal)
            .map_err(|e| format!("{}: {signal}: {e}", self.name).into())
    }

    /// Waits for the process to end and parses its last line.
    async fn finish(mut self) -> Result<(Stopped, Vec<String>), BoxError> {
        let mut stopped = None;
        while let Some(line) = self.next_line().await? {
            if let Some(rest) = line.strip_prefix("report ") {
                stopped = Some(parse_report(rest));
            } else if let Some(rest) = line.strip_prefix("error ") {
                return Err(format!("{}: {rest}", self.name).into());
            }
        }
        let status = tokio::time::timeout(LIMIT, self.child.wait()).await??;
        let stopped =
            stopped.ok_or_else(|| format!("{}: exited ({status}) without a report", self.name))?;
        let stderr = self.stderr.lock().expect("stderr lock").clone();
        Ok((stopped, stderr))
    }
}

fn parse_report(rest: &str) -> Stopped {
    let mut s = Stopped::default();
    for part in rest.split_whitespace() {
        if let Some((k, v)) = part.split_once('=') {
            let n = v.parse().unwrap_or(0);
            match k {
                "completed" => s.completed = n,
                "failed" => s.failed = n,
                "stale" => s.stale = n,
                "released" => s.released = n,
                "stop" => s.stop = v.to_owned(),
                _ => {}
            }
        }
    }
    s
}

/// Starts worker processes, like systemd units, and remembers what they reported.
struct Supervisor {
    url: String,
    started: usize,
    stopped: Vec<(String, Stopped)>,
    warnings: Vec<String>,
}

/// What a process said at startup.
enum Start {
    Ready(Box<Proc>),
    Fenced(String),
}

impl Supervisor {
    async fn start(&mut self, role: Role, versions: Versions) -> Result<Start, BoxError> {
        self.started += 1;
        let name = format!("{}#{} ({})", role.arg(), self.started, versions.as_str());
        let exe = std::env::current_exe()?;
        let mut child = Command::new(exe)
            .args([WORKER_SUBCOMMAND, role.arg(), versions.as_str()])
            .env(URL_VARIABLE, &self.url)
            .env(NAME_VARIABLE, &name)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let pid = i32::try_from(child.id().ok_or("no pid")?)?;
        let (tx, lines) = mpsc::unbounded_channel();
        let stdout = child.stdout.take().ok_or("no stdout")?;
        tokio::spawn(async move {
            let mut out = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = out.next_line().await {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&stderr);
        let err = child.stderr.take().ok_or("no stderr")?;
        tokio::spawn(async move {
            let mut lines = BufReader::new(err).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                sink.lock().expect("stderr lock").push(line);
            }
        });
        let mut proc = Proc {
            name,
            child,
            pid,
            worker_id: None,
            banner: String::new(),
            lines,
            stderr,
        };
        let line = proc
            .next_line()
            .await?
            .ok_or_else(|| format!("{}: exited before starting", proc.name))?;
        if let Some(rest) = line.strip_prefix("ready ") {
            let (id, banner) = rest.split_once(' ').unwrap_or((rest, ""));
            let id: Uuid = id.parse()?;
            proc.worker_id = Some(id);
            proc.banner = banner.to_owned();
            println!("   started {} pid {pid}: {banner}", proc.name);
            Ok(Start::Ready(Box::new(proc)))
        } else if let Some(rest) = line.strip_prefix("fenced ") {
            let status = tokio::time::timeout(LIMIT, proc.child.wait()).await??;
            expect(status.success(), || {
                format!("{} exited with {status}", proc.name)
            })?;
            println!("   {} exited without claiming: {rest}", proc.name);
            Ok(Start::Fenced(rest.to_owned()))
        } else {
            Err(format!("{}: {line}", proc.name).into())
        }
    }

    async fn ready(&mut self, role: Role, versions: Versions) -> Result<Proc, BoxError> {
        match self.start(role, versions).await? {
            Start::Ready(p) => Ok(*p),
            Start::Fenced(why) => {
                Err(format!("{} worker fenced unexpectedly: {why}", role.arg()).into())
            }
        }
    }

    /// Waits for a process that is stopping (deprecated, fenced or signalled) and records its report.
    async fn collect(&mut self, proc: Proc) -> Result<Stopped, BoxError> {
        let name = proc.name.clone();
        let (stopped, stderr) = proc.finish().await?;
        for line in stderr {
            if line.contains("WARN") || line.contains("ERROR") {
                self.warnings.push(format!("{name}: {line}"));
            }
        }
        self.stopped.push((name, stopped.clone()));
        Ok(stopped)
    }
}

// ------------------------------------------------------------------------------------------------------
// The producer
// ------------------------------------------------------------------------------------------------------

/// A thread and the run that triages it.
#[derive(Debug, Clone)]
struct Started {
    thread: i64,
    run_id: Uuid,
    flow_slug: String,
}

fn thread(id: i64) -> Thread {
    let text = if id == SLOW_WEBHOOK_THREAD || id % 2 == 0 {
        format!("How do I retry a step in my flow? (thread {id})")
    } else {
        format!("Shipped my first flow today (thread {id})")
    };
    Thread { id, text }
}

/// Starts one run per thread id by deployment `D`'s alias, each in one transaction with the thread's
/// domain row (the run exists if and only if the thread does).
async fn start_threads<D: Deployment<Flow = F>, F: pgflow_runtime::Flow<Input = Thread>>(
    pool: &PgPool,
    ids: impl IntoIterator<Item = i64>,
) -> Result<Vec<Started>, BoxError> {
    let mut started = Vec::new();
    for id in ids {
        let t = thread(id);
        let mut tx = pool.begin().await?;
        sqlx::query("insert into community.threads (id, body) values ($1, $2)")
            .bind(t.id)
            .bind(&t.text)
            .execute(&mut *tx)
            .await?;
        let run = client::start_deployed::<D, _>(&mut *tx, &t).await?;
        tx.commit().await?;
        started.push(Started {
            thread: id,
            run_id: run.run_id,
            flow_slug: run.flow_slug,
        });
    }
    Ok(started)
}

// ------------------------------------------------------------------------------------------------------
// Database reads
// ------------------------------------------------------------------------------------------------------

/// Moves the alias from `from` to `to` with `pgflow.activate_alias` (the `what` of the rollout), checks what
/// it reports, and starts one run by alias (thread `n`), which must be of `to`.
async fn move_alias(
    pool: &PgPool,
    from: &str,
    to: &str,
    what: &str,
    n: i64,
) -> Result<Vec<Started>, BoxError> {
    let moved = rollout::activate_alias(pool, ALIAS, to).await?;
    expect(
        moved["activated"] == true
            && moved["flow_slug"] == to
            && moved["previous_flow_slug"] == from,
        || format!("the {what} moved the alias from {from} to {to}: {moved}"),
    )?;
    let started = start_threads::<CommunityThreadsV2, _>(pool, [n]).await?;
    expect(started[0].flow_slug == to, || {
        format!(
            "a run started by alias after the {what} is {to}, got {}",
            started[0].flow_slug
        )
    })?;
    Ok(started)
}

async fn scalar_i64(pool: &PgPool, sql: &str) -> Result<i64, BoxError> {
    Ok(sqlx::query_scalar::<_, i64>(sql).fetch_one(pool).await?)
}

async fn alias_target(pool: &PgPool) -> Result<Option<String>, BoxError> {
    Ok(
        sqlx::query_scalar("select flow_slug from pgflow.flow_aliases where alias = $1")
            .bind(ALIAS)
            .fetch_optional(pool)
            .await?,
    )
}

/// Where the alias points and when it was last activated (seconds since the epoch).
async fn alias_state(pool: &PgPool) -> Result<(String, f64), BoxError> {
    Ok(sqlx::query_as(
        "select flow_slug, extract(epoch from activated_at)::float8 from pgflow.flow_aliases where alias = $1",
    )
    .bind(ALIAS)
    .fetch_one(pool)
    .await?)
}

/// Whether concrete flow `flow_slug` is compiled (`pgflow.flows`).
async fn compiled(pool: &PgPool, flow_slug: &str) -> Result<bool, BoxError> {
    Ok(
        sqlx::query_scalar("select exists (select 1 from pgflow.flows where flow_slug = $1)")
            .bind(flow_slug)
            .fetch_one(pool)
            .await?,
    )
}

/// The database's clock, in seconds since the epoch (every time measured here is the database's).
async fn db_now(pool: &PgPool) -> Result<f64, BoxError> {
    Ok(
        sqlx::query_scalar("select extract(epoch from clock_timestamp())::float8")
            .fetch_one(pool)
            .await?,
    )
}

/// Polls `check` every 25 ms until it returns a value.
async fn wait_for<T, F, Fut>(what: &str, mut check: F) -> Result<T, BoxError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>, BoxError>>,
{
    let started = Instant::now();
    loop {
        if let Some(v) = check().await? {
            return Ok(v);
        }
        if started.elapsed() > LIMIT {
            return Err(format!("timed out after {LIMIT:?} waiting for {what}").into());
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Polls `check` every 25 ms until it holds.
async fn wait_until<F, Fut>(what: &str, mut check: F) -> Result<(), BoxError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool, BoxError>>,
{
    wait_for(what, || {
        let f = check();
        async move { Ok(f.await?.then_some(())) }
    })
    .await
}

/// A compact rendering of `version_retirable`'s blockers.
fn blockers(v: &Value) -> String {
    let list: Vec<String> = v["blockers"]
        .as_array()
        .map(|bs| {
            bs.iter()
                .map(|b| {
                    format!(
                        "{} {}×{}",
                        b["step_slug"].as_str().unwrap_or("?"),
                        b["reason"].as_str().unwrap_or("?"),
                        b["count"]
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    if list.is_empty() {
        "none".to_owned()
    } else {
        list.join(", ")
    }
}

// ------------------------------------------------------------------------------------------------------
// The scenario
// ------------------------------------------------------------------------------------------------------

/// Everything measured, printed at the end.
#[derive(Default)]
struct Measured {
    v1_runs_before_rollout: usize,
    v1_runs_during_fence: usize,
    v1_in_flight_at_fence: i64,
    fenced_deploy: String,
    activation: String,
    drain: Duration,
    claim_pause: Duration,
    not_retirable: Vec<String>,
    coverage_refusal: String,
    v2_runs: usize,
    new_builds: Vec<Uuid>,
    v1_tasks_run_by_new_builds: i64,
    cross_version_handle: String,
    crash: Option<Crash>,
    freeze: Option<Freeze>,
    reads_of_twice_read_message: i32,
    invocations_of_twice_read_task: i64,
    retire_pause: Duration,
    mistaken_start: String,
    rollback: String,
    idle_restart: String,
}

async fn run() -> Result<(), BoxError> {
    let wall = Instant::now();
    let db = fresh_database(Contents::Empty).await?;
    pgflow_sql::install(db.pool()).await?;
    let pool = db.pool().clone();
    sqlx::raw_sql(rollout::DOMAIN_SCHEMA).execute(&pool).await?;
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load: Vec<&str> = load.split_whitespace().take(3).collect();
    println!(
        "database ready ({:.1} s); load average {}",
        wall.elapsed().as_secs_f64(),
        load.join(" ")
    );
    let mut sup = Supervisor {
        url: db.url().to_owned(),
        started: 0,
        stopped: Vec::new(),
        warnings: Vec::new(),
    };
    let mut m = Measured::default();

    let (old, burst_v1) = v1_live(&pool, &mut sup, &mut m).await?;
    let (mut fleet, during) = roll_out(&pool, &mut sup, &mut m, old).await?;
    let burst_v2 = drain_with_faults(&pool, &mut sup, &mut m, &mut fleet).await?;
    let twice = read_twice(&pool, &mut m).await?;
    let final_run = retire(&pool, &mut sup, &mut m, fleet).await?;
    let mistakes = mistakes_and_rollback(&pool, &mut sup, &mut m).await?;

    let all: Vec<&Started> = burst_v1
        .iter()
        .chain(&during)
        .chain(&burst_v2)
        .chain(&twice)
        .chain(&final_run)
        .chain(&mistakes)
        .collect();
    verify(&pool, &all, &mut m).await?;
    report(&pool, &sup, &m, wall.elapsed()).await?;
    Ok(())
}

/// The worker processes serving each queue.
struct Fleet {
    classify: Vec<Proc>,
    deliver: Vec<Proc>,
}

/// Starts `per_queue` processes of each worker function, serving `versions`.
async fn start_fleet(
    sup: &mut Supervisor,
    versions: Versions,
    per_queue: usize,
) -> Result<Fleet, BoxError> {
    let mut fleet = Fleet {
        classify: Vec::new(),
        deliver: Vec::new(),
    };
    for _ in 0..per_queue {
        fleet
            .classify
            .push(sup.ready(Role::Classify, versions).await?);
        fleet
            .deliver
            .push(sup.ready(Role::Deliver, versions).await?);
    }
    Ok(fleet)
}

/// Waits until every process of `fleet` has stopped (deprecated, fenced or signalled).
async fn collect_fleet(sup: &mut Supervisor, fleet: Fleet) -> Result<Vec<Stopped>, BoxError> {
    let mut stopped = Vec::new();
    for p in fleet.classify.into_iter().chain(fleet.deliver) {
        stopped.push(sup.collect(p).await?);
    }
    Ok(stopped)
}

/// Rollout step 3: starts one process of each function with `versions` while the functions are disabled;
/// each compiles or verifies its versions, then stops at the fence: it moves no alias and claims nothing.
async fn deploy_fenced(sup: &mut Supervisor, versions: Versions) -> Result<(), BoxError> {
    for role in [Role::Classify, Role::Deliver] {
        if let Start::Ready(p) = sup.start(role, versions).await? {
            return Err(format!("{} started while its function was disabled", p.name).into());
        }
    }
    Ok(())
}

async fn all_runs_finished(pool: &PgPool, what: &str) -> Result<(), BoxError> {
    wait_until(what, || async {
        Ok(scalar_i64(
            pool,
            "select count(*) from pgflow.runs where status = 'started'",
        )
        .await?
            == 0)
    })
    .await
}

/// Phase 1, V1-only builds and a burst of threads started by alias.
async fn v1_live(
    pool: &PgPool,
    sup: &mut Supervisor,
    m: &mut Measured,
) -> Result<(Fleet, Vec<Started>), BoxError> {
    println!(
        "\n1. V1 live: 2 × {CLASSIFY_FUNCTION} (max_concurrent {CLASSIFY_CONCURRENCY}), \
         2 × {DELIVER_FUNCTION} (max_concurrent {DELIVER_CONCURRENCY})"
    );
    let fleet = start_fleet(sup, Versions::V1, 2).await?;
    expect(alias_target(pool).await?.as_deref() == Some(V1), || {
        "the alias points at V1".into()
    })?;
    let burst = start_threads::<CommunityThreadsV1, _>(pool, 1..=32).await?;
    for s in &burst {
        expect(s.flow_slug == V1, || {
            format!("thread {} started {}", s.thread, s.flow_slug)
        })?;
    }
    m.v1_runs_before_rollout = burst.len();
    println!(
        "   started {} threads by alias `{ALIAS}`: all {V1}",
        burst.len()
    );
    wait_until("a few V1 runs to complete", || async {
        Ok(scalar_i64(
            pool,
            "select count(*) from pgflow.runs where status = 'completed'",
        )
        .await?
            >= 6)
    })
    .await?;
    Ok((fleet, burst))
}

/// Phase 2, the fenced rollout to V2 (OPERATIONS.md), while V1 runs are in flight. Returns the V1+V2
/// fleet and the runs started during the fence.
async fn roll_out(
    pool: &PgPool,
    sup: &mut Supervisor,
    m: &mut Measured,
    old: Fleet,
) -> Result<(Fleet, Vec<Started>), BoxError> {
    m.v1_in_flight_at_fence = scalar_i64(
        pool,
        "select count(*) from pgflow.runs where status = 'started'",
    )
    .await?;
    println!(
        "\n2. Rollout to V2 with {} V1 runs in flight",
        m.v1_in_flight_at_fence
    );
    let fence_started = Instant::now();
    let functions = [CLASSIFY_FUNCTION, DELIVER_FUNCTION];
    let recorded = rollout::fence(pool, &functions, "rollout communityThreadsV2").await?;
    expect(recorded.len() == 2, || {
        format!("both functions recorded, got {recorded:?}")
    })?;
    println!("   step 1: recorded and disabled {recorded:?}");

    m.drain = rollout::deprecate_and_wait(pool, DEAD_WORKER_TIMEOUT, LIMIT).await?;
    for s in collect_fleet(sup, old).await? {
        expect(s.stop == "Deprecated" || s.stop == "Disabled", || {
            format!("an old worker stopped for another reason: {}", s.stop)
        })?;
    }
    println!(
        "   step 2: deprecated; every old worker stopped after {} ms",
        m.drain.as_millis()
    );
    for queue in [CLASSIFY_QUEUE, DELIVER_QUEUE] {
        let r = rollout::version_retirable(pool, V1, queue).await?;
        expect(r["retirable"] == false, || {
            format!("V1 not retirable from {queue} while it runs: {r}")
        })?;
        m.not_retirable.push(format!("{queue}: {}", blockers(&r)));
        println!(
            "   version_retirable({V1}, {queue}) = false: {}",
            blockers(&r)
        );
    }
    expect(!compiled(pool, V2).await?, || {
        "V2 is not compiled before its builds are deployed".into()
    })?;
    let before = alias_state(pool).await?;
    deploy_fenced(sup, Versions::V1AndV2).await?;
    let after = alias_state(pool).await?;
    expect(compiled(pool, V2).await?, || {
        "the fenced V1+V2 builds compiled V2".into()
    })?;
    expect(after.0 == V1 && after == before, || {
        format!("a fenced start moved no alias: before {before:?}, after {after:?}")
    })?;
    let claimed_while_fenced = scalar_i64(
        pool,
        "select count(*) from pgflow.step_tasks \
         where started_at > (select min(disabled_at) from pgflow.worker_functions)",
    )
    .await?;
    expect(claimed_while_fenced == 0, || {
        format!("{claimed_while_fenced} tasks claimed while fenced")
    })?;
    let during =
        start_threads::<CommunityThreadsV1, _>(pool, [101, 102, 103, SLOW_WEBHOOK_THREAD]).await?;
    for s in &during {
        expect(s.flow_slug == V1, || {
            format!(
                "a run started while V2 is compiled but fenced is V1, got {}",
                s.flow_slug
            )
        })?;
    }
    m.v1_runs_during_fence = during.len();
    m.fenced_deploy = format!(
        "V1+V2 builds started while disabled compiled {V2} and exited at the fence; the alias stayed at {V1} \
         (activated_at unchanged), nothing was claimed, and {} runs started by alias meanwhile were {V1}",
        during.len()
    );
    println!(
        "   step 3: V1+V2 builds deployed while disabled: {V2} compiled, the alias still points at {V1}, \
         nothing claimed; {} more threads started by alias: still {V1}, queued with no worker",
        during.len()
    );

    rollout::lift_fence(pool).await?;
    let lifted_at = db_now(pool).await?;
    let fleet = start_fleet(sup, Versions::V1AndV2, 2).await?;
    m.claim_pause = fence_started.elapsed();
    m.new_builds = fleet
        .classify
        .iter()
        .chain(&fleet.deliver)
        .filter_map(|p| p.worker_id)
        .collect();
    // The first build to start once enabled moved the alias; the others found it in place.
    let activated = format!("alias `{ALIAS}` activated (was `{V1}`)");
    let activators: Vec<&str> = fleet
        .classify
        .iter()
        .chain(&fleet.deliver)
        .filter(|p| p.banner.contains(&activated))
        .map(|p| p.name.as_str())
        .collect();
    let (target, activated_at) = alias_state(pool).await?;
    let previous: Option<String> =
        sqlx::query_scalar("select previous_flow_slug from pgflow.flow_aliases where alias = $1")
            .bind(ALIAS)
            .fetch_one(pool)
            .await?;
    expect(
        target == V2
            && previous.as_deref() == Some(V1)
            && activators == [fleet.classify[0].name.as_str()],
        || {
            format!(
                "the first enabled V1+V2 build alone moved the alias from V1 to V2: alias {target} \
                 (previous {previous:?}), moved by {activators:?}"
            )
        },
    )?;
    let after_lift_ms = (activated_at - lifted_at) * 1000.0;
    m.activation = format!(
        "{V1} → {V2} by the startup of {} (the first V1+V2 build started once enabled), {after_lift_ms:.0} ms \
         after the fence was lifted; the other 3 found it already active",
        activators[0]
    );
    println!(
        "   step 4: re-enabled the recorded set; {} moved the alias to {V2} {after_lift_ms:.0} ms later; \
         claims were paused for {} ms",
        activators[0],
        m.claim_pause.as_millis()
    );
    Ok((fleet, during))
}

/// Phase 3, V1 drains while new runs start on V2: a V2-only build is refused, a classify process is killed
/// and a deliver process frozen, and supervision restarts the killed one. Returns the V2 runs started.
async fn drain_with_faults(
    pool: &PgPool,
    sup: &mut Supervisor,
    m: &mut Measured,
    fleet: &mut Fleet,
) -> Result<Vec<Started>, BoxError> {
    println!("\n3. V1 drains, V2 takes new runs; faults injected");
    let probe = deliver_worker(pool.clone(), Versions::V2)
        .build()?
        .run(CancellationToken::new())
        .await;
    let Err(WorkerError::CoverageGap { gaps, .. }) = &probe else {
        return Err(format!(
            "a V2-only deliver build must be refused while V1 drains, got {probe:?}"
        )
        .into());
    };
    m.coverage_refusal = describe_gaps(gaps);
    println!(
        "   a V2-only {DELIVER_FUNCTION} build refuses to start: {}",
        m.coverage_refusal
    );

    let burst = start_threads::<CommunityThreadsV2, _>(pool, 201..=232).await?;
    for s in &burst {
        expect(s.flow_slug == V2, || {
            format!(
                "thread {} started after activation ran {}",
                s.thread, s.flow_slug
            )
        })?;
    }
    // A handle typed by the deployment the producer names, V1's, of a run the alias started on V2: waiting
    // through it is refused (it would decode V2's output as V1's); the handle of the run's version waits.
    sqlx::query("insert into community.threads (id, body) values ($1, $2)")
        .bind(TYPED_HANDLE_THREAD)
        .bind(&thread(TYPED_HANDLE_THREAD).text)
        .execute(pool)
        .await?;
    let handle = Client::new(pool.clone())
        .start_deployed::<CommunityThreadsV1>(&thread(TYPED_HANDLE_THREAD))
        .await?;
    expect(handle.flow_slug() == V2, || {
        format!(
            "a V1-typed start after activation runs V2, got {}",
            handle.flow_slug()
        )
    })?;
    let refusal = match handle.wait(LIMIT).await {
        Err(e @ WaitError::OtherVersion { .. }) => e,
        other => {
            return Err(format!(
                "a RunHandle<ThreadsV1> of a V2 run must refuse to wait, got {:?}",
                other.map(|o| o.deliver_slack.map(|d| d.version))
            )
            .into())
        }
    };
    let WaitError::OtherVersion {
        expected_flow_slug,
        flow_slug,
        ..
    } = &refusal
    else {
        unreachable!("matched above");
    };
    expect(*expected_flow_slug == V1 && flow_slug == V2, || {
        format!("the refusal names both versions: {refusal}")
    })?;
    let v2_handle = handle
        .as_version::<ThreadsV2>()
        .ok_or("as_version::<ThreadsV2>() of a V2 run")?;
    expect(handle.as_version::<ThreadsV1>().is_none(), || {
        "as_version::<ThreadsV1>() of a V2 run is None".into()
    })?;
    println!(
        "   start_deployed::<CommunityThreadsV1>() started a {V2} run; its RunHandle<ThreadsV1>::wait() \
         refused at once: WaitError::OtherVersion"
    );
    m.v2_runs = burst.len() + 1;
    println!("   started {} threads by alias: all {V2}", m.v2_runs);

    let (kill, stop) = tokio::join!(
        crash(pool, &mut fleet.classify[0]),
        freeze(pool, &fleet.deliver)
    );
    m.crash = Some(kill?);
    m.freeze = Some(stop?);
    // Supervision restarts the killed process.
    let killed = fleet.classify.remove(0);
    let _ = tokio::time::timeout(LIMIT, killed.finish()).await;
    fleet
        .classify
        .push(sup.ready(Role::Classify, Versions::V1AndV2).await?);
    all_runs_finished(pool, "every run to finish").await?;
    let output = v2_handle.wait(LIMIT).await?;
    let delivered_by = output.deliver_slack.map(|d| d.version);
    expect(delivered_by.as_deref() == Some("v2"), || {
        format!("the V2 handle's output is V2's delivery, got {delivered_by:?}")
    })?;
    m.cross_version_handle = format!(
        "start_deployed::<CommunityThreadsV1>() after activation started a {V2} run; RunHandle<ThreadsV1>::wait() \
         returned WaitError::OtherVersion {{ expected_flow_slug: {V1}, flow_slug: {V2} }} without waiting; \
         as_version::<ThreadsV1>() is None, as_version::<ThreadsV2>().wait() returned V2's output (deliverSlack by v2)"
    );
    println!("   every run finished; the V2 handle of the V1-typed start returned V2's output");
    Ok(burst)
}

/// Phase 5, retires V1 once `version_retirable` allows it on both queues, with the same fence; then a run
/// on the V2-only builds. Returns that run.
async fn retire(
    pool: &PgPool,
    sup: &mut Supervisor,
    m: &mut Measured,
    fleet: Fleet,
) -> Result<Vec<Started>, BoxError> {
    println!("\n5. Retiring {V1}");
    for queue in [CLASSIFY_QUEUE, DELIVER_QUEUE] {
        let r = rollout::version_retirable(pool, V1, queue).await?;
        expect(r["retirable"] == true, || {
            format!("V1 retirable from {queue} once drained: {r}")
        })?;
        println!("   version_retirable({V1}, {queue}) = true");
    }
    let started = Instant::now();
    let functions = [CLASSIFY_FUNCTION, DELIVER_FUNCTION];
    rollout::fence(pool, &functions, "retire communityThreadsV1").await?;
    rollout::deprecate_and_wait(pool, DEAD_WORKER_TIMEOUT, LIMIT).await?;
    collect_fleet(sup, fleet).await?;
    deploy_fenced(sup, Versions::V2).await?;
    rollout::lift_fence(pool).await?;
    let last = start_fleet(sup, Versions::V2, 1).await?;
    m.retire_pause = started.elapsed();
    let run = start_threads::<CommunityThreadsV2, _>(pool, [400]).await?;
    expect(run[0].flow_slug == V2, || "the final run is V2".into())?;
    Client::new(pool.clone())
        .wait_json(run[0].run_id, LIMIT)
        .await?;
    println!("   V2-only builds serve both queues; a new run completed on {V2}");
    for p in last.classify.iter().chain(&last.deliver) {
        p.signal(Signal::SIGTERM)?;
    }
    collect_fleet(sup, last).await?;
    Ok(run)
}

fn describe_gaps(gaps: &[pgflow_runtime::worker::CoverageGap]) -> String {
    gaps.iter()
        .map(|g| format!("{}/{} {}", g.flow_slug, g.step_slug, g.reason.as_str()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Phase 6, after the retirement, with no worker running:
///
/// * the retired V1-only classify build, started again by mistake while a V2 run waits, is refused by the
///   coverage check and moves no alias;
/// * the operator rolls back with `pgflow.activate_alias(alias, V1)`: runs started by alias are V1 from then
///   on, and can only run where a build serves V1 (the current V2-only build is refused, and moves nothing);
///   a rollback build serving V2 then V1 (V1 last, so its startups keep the alias at V1) runs them;
/// * the operator rolls forward with `pgflow.activate_alias(alias, V2)`; that lasts only until a build
///   serving V1 last starts again (a restarted rollback build moves the alias back to V1), so V1+V2 builds
///   (V2 last) replace the rollback builds and move it to V2 for good;
/// * once nothing of V2 is in flight, the retired build started again passes its checks and moves the alias
///   to V1: only keeping it where supervision cannot start it prevents that. The operator moves it back.
///
/// Returns the runs started.
async fn mistakes_and_rollback(
    pool: &PgPool,
    sup: &mut Supervisor,
    m: &mut Measured,
) -> Result<Vec<Started>, BoxError> {
    println!("\n6. The retired V1-only {CLASSIFY_FUNCTION} build started again by mistake while a V2 run waits");
    let mut runs = start_threads::<CommunityThreadsV2, _>(pool, [500]).await?;
    expect(runs[0].flow_slug == V2, || "the waiting run is V2".into())?;
    let before = alias_state(pool).await?;
    let refused = classify_worker(pool.clone(), Versions::V1)
        .build()?
        .run(CancellationToken::new())
        .await;
    let Err(WorkerError::CoverageGap { gaps, .. }) = &refused else {
        return Err(format!(
            "the retired build must be refused while a V2 run waits, got {refused:?}"
        )
        .into());
    };
    expect(gaps.iter().all(|g| g.flow_slug == V2), || {
        format!("the refusal names V2's pairs: {}", describe_gaps(gaps))
    })?;
    let after = alias_state(pool).await?;
    expect(after.0 == V2 && after == before, || {
        format!("the refused start moved no alias: before {before:?}, after {after:?}")
    })?;
    let next = start_threads::<CommunityThreadsV2, _>(pool, [501]).await?;
    expect(next[0].flow_slug == V2, || {
        format!(
            "a run started by alias after the refusal is V2, got {}",
            next[0].flow_slug
        )
    })?;
    runs.extend(next);
    m.mistaken_start = format!(
        "retired V1-only build refused ({}); the alias stayed at {V2} (activated_at unchanged); the next run by \
         alias was {V2}",
        describe_gaps(gaps)
    );
    println!(
        "   refused ({}); the alias still points at {V2}, activated_at unchanged; the next run by alias is {V2}",
        describe_gaps(gaps)
    );

    println!("   rollback: select pgflow.activate_alias('{ALIAS}', '{V1}')");
    let rolled_back = move_alias(pool, V2, V1, "rollback", 502).await?;
    runs.extend(rolled_back.iter().cloned());
    // The rollback is only as good as the builds that serve V1: the current V2-only build cannot run it.
    let current = deliver_worker(pool.clone(), Versions::V2)
        .build()?
        .run(CancellationToken::new())
        .await;
    let Err(WorkerError::CoverageGap { gaps, .. }) = &current else {
        return Err(format!(
            "the V2-only build must be refused once the alias points at V1, got {current:?}"
        )
        .into());
    };
    let v2_only_refusal = describe_gaps(gaps);
    expect(gaps.iter().all(|g| g.flow_slug == V1), || {
        format!("the refusal names V1's pairs: {v2_only_refusal}")
    })?;
    expect(alias_target(pool).await?.as_deref() == Some(V1), || {
        "the refused V2-only start left the rollback in place".into()
    })?;
    let v1_status: String = sqlx::query_scalar("select status from pgflow.runs where run_id = $1")
        .bind(rolled_back[0].run_id)
        .fetch_one(pool)
        .await?;
    expect(v1_status == "started", || {
        format!("the V1 run waits for a build that serves V1, got {v1_status}")
    })?;
    println!(
        "   the next run by alias is {V1}; the current V2-only {DELIVER_FUNCTION} build refuses ({v2_only_refusal}) \
         and moves nothing; the V1 run waits for a build that serves V1"
    );
    let waiting_since = Instant::now();
    let mut rollback_builds = Vec::new();
    for role in [Role::Classify, Role::Deliver] {
        rollback_builds.push(sup.ready(role, Versions::V2AndV1).await?);
    }
    let moved_by: Vec<&str> = rollback_builds
        .iter()
        .filter(|p| p.banner.contains("activated"))
        .map(|p| p.name.as_str())
        .collect();
    expect(
        moved_by.is_empty() && alias_target(pool).await?.as_deref() == Some(V1),
        || {
            format!(
                "the rollback builds (V1 served last) kept the alias at V1, moved by {moved_by:?}"
            )
        },
    )?;
    all_runs_finished(pool, "the runs waiting through the rollback to finish").await?;
    let served_after = waiting_since.elapsed();
    println!(
        "   rollback builds (V2 then V1) started: the alias stays at {V1}; the 3 waiting runs (2 on {V2}, 1 on {V1}) \
         completed {} ms after they came up",
        served_after.as_millis()
    );

    println!("   roll forward: select pgflow.activate_alias('{ALIAS}', '{V2}')");
    let rolled_forward = move_alias(pool, V1, V2, "roll forward", 503).await?;
    runs.extend(rolled_forward);
    all_runs_finished(pool, "the run after the roll forward to finish").await?;
    println!("   the next run by alias is {V2}, and it completed on the rollback builds");
    // An explicit activation lasts until the next startup of a build that serves another version last: a
    // restart of a rollback build (a crash, a redeploy) points the alias at V1 again.
    let restarted = rollback_builds.remove(0);
    restarted.signal(Signal::SIGTERM)?;
    sup.collect(restarted).await?;
    let restarted = sup.ready(Role::Classify, Versions::V2AndV1).await?;
    let undone = alias_target(pool).await?;
    expect(
        undone.as_deref() == Some(V1)
            && restarted
                .banner
                .contains(&format!("activated (was `{V2}`)")),
        || {
            format!(
                "a restarted rollback build moves the alias back to V1: alias {undone:?}, banner {}",
                restarted.banner
            )
        },
    )?;
    println!(
        "   {} restarted: the alias points at {V1} again; replacing the rollback builds with V1+V2 builds",
        restarted.name
    );
    rollback_builds.push(restarted);
    // A lasting roll forward replaces the rollback builds with builds that serve V2 last.
    for p in rollback_builds {
        p.signal(Signal::SIGTERM)?;
        sup.collect(p).await?;
    }
    let mut forward_builds = Vec::new();
    for role in [Role::Classify, Role::Deliver] {
        forward_builds.push(sup.ready(role, Versions::V1AndV2).await?);
    }
    expect(
        alias_target(pool).await?.as_deref() == Some(V2)
            && forward_builds[0]
                .banner
                .contains(&format!("activated (was `{V1}`)")),
        || "the first V1+V2 build (V2 served last) moved the alias to V2 again".into(),
    )?;
    let last = start_threads::<CommunityThreadsV2, _>(pool, [504]).await?;
    expect(last[0].flow_slug == V2, || {
        "the last run by alias is V2".into()
    })?;
    runs.extend(last);
    all_runs_finished(pool, "the last run by alias to finish").await?;
    for p in forward_builds {
        p.signal(Signal::SIGTERM)?;
        sup.collect(p).await?;
    }
    m.rollback = format!(
        "activate_alias({V1}) moved the alias from {V2}; the next run by alias was {V1}; the V2-only build was \
         refused ({v2_only_refusal}) and moved nothing; the V1 run waited until rollback builds (V2 then V1) came \
         up, which kept the alias at {V1}, and completed {} ms later; activate_alias({V2}) moved it forward and the \
         next run by alias was {V2}, but a restart of a rollback build moved it back to {V1}; V1+V2 builds replacing \
         them moved it to {V2} again",
        served_after.as_millis()
    );
    println!("   the first V1+V2 build moved the alias to {V2} again; the next run by alias is {V2}; every run completed");

    // With nothing of V2 in flight, the coverage check has nothing to refuse: the retired build moves the alias.
    let idle = classify_worker(pool.clone(), Versions::V1)
        .build()?
        .spawn(CancellationToken::new())
        .await?;
    let moved = alias_target(pool).await?;
    let status = idle
        .deployments()
        .first()
        .map(ToString::to_string)
        .unwrap_or_default();
    idle.stop().await?;
    expect(
        moved.as_deref() == Some(V1) && status.contains(&format!("activated (was `{V2}`)")),
        || {
            format!("the retired build started with nothing of V2 in flight moves the alias to V1 (as OPERATIONS.md says), got {moved:?}")
        },
    )?;
    let restored = rollout::activate_alias(pool, ALIAS, V2).await?;
    expect(restored["activated"] == true, || {
        format!("the operator moved the alias back to V2: {restored}")
    })?;
    m.idle_restart = format!(
        "the retired V1-only build started once nothing of V2 was in flight passed its checks and started ({status}); \
         the operator moved the alias back with activate_alias({V2})"
    );
    println!(
        "   the retired build started again with nothing of {V2} in flight starts: {status}; moved back with activate_alias"
    );
    Ok(runs)
}

/// What the SIGKILL measured.
struct Crash {
    started_at_kill: usize,
    held: usize,
    killed_at: f64,
    detected_ms: f64,
    recovered_ms: f64,
}

/// SIGKILLs `victim` while it holds tasks; measures how long until another worker has them.
async fn crash(pool: &PgPool, victim: &mut Proc) -> Result<Crash, BoxError> {
    let id = victim.worker_id.ok_or("victim not ready")?;
    wait_until("the classify victim to hold tasks", || async {
        Ok(sqlx::query_scalar::<_, i64>(
            "select count(*) from pgflow.step_tasks where last_worker_id = $1 and status = 'started'",
        )
        .bind(id)
        .fetch_one(pool)
        .await?
            >= 1)
    })
    .await?;
    victim.signal(Signal::SIGKILL)?;
    let killed_at = db_now(pool).await?;
    let started_at_kill: i64 = sqlx::query_scalar(
        "select count(*) from pgflow.step_tasks where last_worker_id = $1 and status = 'started'",
    )
    .bind(id)
    .fetch_one(pool)
    .await?;
    // A statement the process had sent before it died still runs (and commits) on the server: wait until
    // its sessions are gone before looking at what it left behind.
    wait_until("the killed process's sessions to end", || async {
        Ok(sqlx::query_scalar::<_, i64>(
            "select count(*) from pg_stat_activity where application_name = $1",
        )
        .bind(&victim.name)
        .fetch_one(pool)
        .await?
            == 0)
    })
    .await?;
    let runs: Vec<Uuid> = sqlx::query_scalar(
        "select run_id from pgflow.step_tasks where last_worker_id = $1 and status = 'started'",
    )
    .bind(id)
    .fetch_all(pool)
    .await?;
    expect(!runs.is_empty(), || "the killed worker held tasks".into())?;
    let held = i64::try_from(runs.len())?;
    println!(
        "   SIGKILL {}: {started_at_kill} classify task(s) started under it at the kill, {held} left to recover once its sessions ended",
        victim.name
    );
    wait_until(
        "the killed worker's tasks to complete elsewhere",
        || async {
            Ok(sqlx::query_scalar::<_, i64>(
                "select count(*) from pgflow.step_tasks \
             where run_id = any ($1) and step_slug = 'classify' and status = 'completed'",
            )
            .bind(&runs)
            .fetch_one(pool)
            .await?
                == held)
        },
    )
    .await?;
    let (detected, recovered, requeued, by_victim): (f64, f64, i64, i64) = sqlx::query_as(
        "select extract(epoch from max(last_requeued_at))::float8 - $2, \
                extract(epoch from max(started_at))::float8 - $2, \
                count(*) filter (where requeued_count >= 1), \
                count(*) filter (where last_worker_id = $3) \
         from pgflow.step_tasks where run_id = any ($1) and step_slug = 'classify'",
    )
    .bind(&runs)
    .bind(killed_at)
    .bind(id)
    .fetch_one(pool)
    .await?;
    expect(requeued == held && by_victim == 0, || {
        format!("every task of the killed worker requeued and completed by another ({requeued} of {held} requeued, {by_victim} still its own)")
    })?;
    println!(
        "   recovered: requeued {:.0} ms after the kill (dead_worker_timeout {} ms), running elsewhere {:.0} ms after it",
        detected * 1000.0,
        DEAD_WORKER_TIMEOUT.as_millis(),
        recovered * 1000.0
    );
    Ok(Crash {
        started_at_kill: usize::try_from(started_at_kill)?,
        held: runs.len(),
        killed_at,
        detected_ms: detected * 1000.0,
        recovered_ms: recovered * 1000.0,
    })
}

/// What the SIGSTOP measured.
struct Freeze {
    held_ms: f64,
    recovered_ms: f64,
    side_effect: String,
}

/// SIGSTOPs the deliver process in the middle of the slow webhook call, until the task has been recovered
/// and completed by the other deliver process; then resumes it, so its result arrives late.
async fn freeze(pool: &PgPool, deliver: &[Proc]) -> Result<Freeze, BoxError> {
    let (pid, run_id) = wait_for("the slow webhook call to start", || async {
        let row: Option<(i32, Uuid, Option<String>)> = sqlx::query_as(
            "select pid, run_id, outcome from community.invocations \
             where thread_id = $1 and step_slug = 'deliverSlack' order by id limit 1",
        )
        .bind(SLOW_WEBHOOK_THREAD)
        .fetch_optional(pool)
        .await?;
        match row {
            Some((_, _, Some(outcome))) => Err(format!(
                "the slow webhook call ended ({outcome}) before it could be frozen"
            )
            .into()),
            Some((pid, run, None)) => Ok(Some((pid, run))),
            None => Ok(None),
        }
    })
    .await?;
    let frozen = deliver
        .iter()
        .find(|p| p.pid == pid)
        .ok_or("the slow call runs in no deliver process")?;
    frozen.signal(Signal::SIGSTOP)?;
    let stopped_at = db_now(pool).await?;
    println!(
        "   SIGSTOP {} in the middle of the slow webhook call (thread {SLOW_WEBHOOK_THREAD})",
        frozen.name
    );
    wait_until("the frozen delivery to complete elsewhere", || async {
        Ok(sqlx::query_scalar::<_, String>(
            "select status from pgflow.step_states where run_id = $1 and step_slug = 'deliverSlack'",
        )
        .bind(run_id)
        .fetch_one(pool)
        .await?
            == "completed")
    })
    .await?;
    let (reclaimed, attempt): (f64, i32) = sqlx::query_as(
        "select extract(epoch from started_at)::float8 - $2, attempts_count from pgflow.step_tasks \
         where run_id = $1 and step_slug = 'deliverSlack'",
    )
    .bind(run_id)
    .bind(stopped_at)
    .fetch_one(pool)
    .await?;
    let resumed_at = db_now(pool).await?;
    frozen.signal(Signal::SIGCONT)?;
    println!(
        "   its task ran again elsewhere {:.0} ms after the stop and completed (attempt {attempt}); SIGCONT after {:.0} ms",
        reclaimed * 1000.0,
        (resumed_at - stopped_at) * 1000.0
    );
    wait_until("the resumed attempt to finish", || async {
        Ok(sqlx::query_scalar::<_, i64>(
            "select count(*) from community.invocations where run_id = $1 and step_slug = 'deliverSlack' and finished_at is not null",
        )
        .bind(run_id)
        .fetch_one(pool)
        .await?
            >= 2)
    })
    .await?;
    let calls: Vec<(i32, String)> = sqlx::query_as(
        "select attempt, outcome from community.invocations where run_id = $1 and step_slug = 'deliverSlack' order by attempt",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await?;
    let (recorded, posts, post_attempt): (Value, i64, i32) = sqlx::query_as(
        "select ss.output, (select count(*) from community.slack_posts p where p.thread_id = $2), \
                (select p.attempt from community.slack_posts p where p.thread_id = $2) \
         from pgflow.step_states ss where ss.run_id = $1 and ss.step_slug = 'deliverSlack'",
    )
    .bind(run_id)
    .bind(SLOW_WEBHOOK_THREAD)
    .fetch_one(pool)
    .await?;
    let outcomes: Vec<String> = calls
        .iter()
        .map(|(a, o)| format!("attempt {a}: {o}"))
        .collect();
    expect(posts == 1, || {
        format!("one Slack post for the frozen thread, found {posts}")
    })?;
    expect(
        recorded["attempt"] == attempt && recorded["posted"] == true,
        || format!("the recorded output is the recovering attempt's: {recorded}"),
    )?;
    expect(
        calls.first().map(|c| c.1.as_str()) == Some("duplicate"),
        || format!("the resumed first attempt found the post already made: {outcomes:?}"),
    )?;
    let side_effect = format!(
        "handler calls {}; recorded output from attempt {}; Slack posts 1 (by attempt {post_attempt})",
        outcomes.join(", "),
        recorded["attempt"]
    );
    println!("   {side_effect}");
    Ok(Freeze {
        held_ms: (resumed_at - stopped_at) * 1000.0,
        recovered_ms: reclaimed * 1000.0,
        side_effect,
    })
}

/// Starts a run whose classification is slow, and while it runs makes its message visible again by hand,
/// as if its visibility had expired: a worker reads the message a second time. Records the message's read
/// count and the number of handler calls of its task; returns the run.
async fn read_twice(pool: &PgPool, m: &mut Measured) -> Result<Vec<Started>, BoxError> {
    println!("\n4. A message made visible again while its task runs");
    let run = start_threads::<CommunityThreadsV2, _>(pool, [SLOW_MODEL_THREAD]).await?;
    let run_id = run[0].run_id;
    let msg_id: i64 = wait_for("the slow classification to start", || async {
        let row: Option<(i64, String)> = sqlx::query_as(
            "select message_id, status from pgflow.step_tasks where run_id = $1 and step_slug = 'classify'",
        )
        .bind(run_id)
        .fetch_optional(pool)
        .await?;
        Ok(row.and_then(|(id, status)| (status == "started").then_some(id)))
    })
    .await?;
    // Fault injection: the one direct PGMQ call of this program.
    sqlx::query("select pgmq.set_vt($1, $2, 0)")
        .bind(CLASSIFY_QUEUE)
        .bind(msg_id)
        .execute(pool)
        .await?;
    wait_until("a second read of the message", || async {
        let reads: Option<i32> = sqlx::query_scalar(
            "select read_ct from pgmq.q_classify_threads where msg_id = $1 \
             union all select read_ct from pgmq.a_classify_threads where msg_id = $1",
        )
        .bind(msg_id)
        .fetch_optional(pool)
        .await?;
        Ok(reads.unwrap_or(0) >= 2)
    })
    .await?;
    Client::new(pool.clone()).wait_json(run_id, LIMIT).await?;
    let (reads, attempts): (i32, i32) = sqlx::query_as(
        "select a.read_ct, t.attempts_count from pgmq.a_classify_threads a \
         join pgflow.step_tasks t on t.message_id = a.msg_id and t.queue_name = 'classify_threads' where a.msg_id = $1",
    )
    .bind(msg_id)
    .fetch_one(pool)
    .await?;
    let calls: i64 = sqlx::query_scalar(
        "select count(*) from community.invocations where run_id = $1 and step_slug = 'classify'",
    )
    .bind(run_id)
    .fetch_one(pool)
    .await?;
    expect(reads >= 2 && attempts == 1 && calls == 1, || {
        format!("a message read {reads} times ran {calls} handler call(s) in {attempts} attempt(s)")
    })?;
    println!("   message {msg_id} read {reads} times; its task ran once (attempt 1): the second read was deferred");
    m.reads_of_twice_read_message = reads;
    m.invocations_of_twice_read_task = calls;
    Ok(run)
}

/// Checks every expectation about the finished runs from the database.
async fn verify(pool: &PgPool, all: &[&Started], m: &mut Measured) -> Result<(), BoxError> {
    // Every run completed once, on the version recorded when it started.
    let runs: Vec<(Uuid, String, String)> =
        sqlx::query_as("select run_id, flow_slug, status from pgflow.runs")
            .fetch_all(pool)
            .await?;
    let by_id: BTreeMap<Uuid, (String, String)> =
        runs.into_iter().map(|(r, f, s)| (r, (f, s))).collect();
    for s in all {
        let (flow, status) = by_id.get(&s.run_id).ok_or("a run is missing")?;
        expect(flow == &s.flow_slug && status == "completed", || {
            format!(
                "thread {}: run {} is {flow}/{status}, started as {}",
                s.thread, s.run_id, s.flow_slug
            )
        })?;
    }
    expect(by_id.values().all(|(_, s)| s == "completed"), || {
        "every run completed".into()
    })?;
    // Output shapes: V1's classification has no confidence, V2's always has one.
    let shapes: Vec<(String, i64, i64, i64)> = sqlx::query_as(
        "select r.flow_slug, count(*), count(*) filter (where t.output ? 'confidence'), \
                count(*) filter (where d.output is not null and d.output ->> 'version' <> \
                                 case r.flow_slug when 'communityThreadsV1' then 'v1' else 'v2' end) \
         from pgflow.runs r \
         join pgflow.step_tasks t on t.run_id = r.run_id and t.step_slug = 'classify' \
         left join pgflow.step_tasks d on d.run_id = r.run_id and d.step_slug = 'deliverSlack' \
         group by r.flow_slug order by 1",
    )
    .fetch_all(pool)
    .await?;
    for (flow, n, scored, wrong) in &shapes {
        let ok = if flow == V1 {
            *scored == 0
        } else {
            scored == n
        };
        expect(ok && *wrong == 0, || {
            format!("{flow}: {scored} of {n} classifications scored, {wrong} deliveries by another version")
        })?;
    }
    // Every handler call ran the handler of its run's version.
    let mismatched = scalar_i64(
        pool,
        "select count(*) from community.invocations i join pgflow.runs r using (run_id) where i.flow_slug <> r.flow_slug",
    )
    .await?;
    expect(mismatched == 0, || {
        format!("{mismatched} handler calls of another version")
    })?;
    m.v1_tasks_run_by_new_builds = sqlx::query_scalar(
        "select count(*) from pgflow.step_tasks where flow_slug = $1 and status = 'completed' and last_worker_id = any ($2)",
    )
    .bind(V1)
    .bind(&m.new_builds)
    .fetch_one(pool)
    .await?;
    expect(m.v1_tasks_run_by_new_builds > 0, || {
        "the V1+V2 builds ran V1 tasks".into()
    })?;
    // The domain: one Slack post per help thread, every help thread delivered, every chat thread classified.
    let (help, delivered, posts, chat_classified, chat): (i64, i64, i64, i64, i64) = sqlx::query_as(
        "select count(*) filter (where route = 'help'), count(*) filter (where route = 'help' and status = 'delivered'), \
                (select count(*) from community.slack_posts), \
                count(*) filter (where route = 'chat' and status = 'classified'), count(*) filter (where route = 'chat') \
         from community.threads",
    )
    .fetch_one(pool)
    .await?;
    expect(
        help == delivered && help == posts && chat == chat_classified,
        || {
            format!("{help} help threads, {delivered} delivered, {posts} Slack posts; {chat_classified} of {chat} chat threads classified")
        },
    )?;
    // Retries: every first classify call of an overloaded thread failed (unless SIGKILL cut it short), and
    // each of those tasks completed on a later attempt.
    let (first_calls, failed, retried): (i64, i64, i64) = sqlx::query_as(
        "select count(*) filter (where i.attempt = 1 and i.finished_at is not null and i.thread_id % 10 = 3), \
                count(*) filter (where i.outcome = 'failed'), \
                count(*) filter (where i.outcome = 'failed' and t.status = 'completed' and t.attempts_count >= 2) \
         from community.invocations i join pgflow.step_tasks t on t.run_id = i.run_id and t.step_slug = i.step_slug \
         where i.step_slug = 'classify'",
    )
    .fetch_one(pool)
    .await?;
    expect(
        first_calls > 0 && failed == first_calls && retried == failed,
        || {
            format!("{first_calls} first calls of overloaded threads: {failed} failed, {retried} retried to completion")
        },
    )?;
    Ok(())
}

/// Prints the measured numbers.
async fn report(
    pool: &PgPool,
    sup: &Supervisor,
    m: &Measured,
    wall: Duration,
) -> Result<(), BoxError> {
    let crash = m.crash.as_ref().ok_or("no crash measured")?;
    let freeze = m.freeze.as_ref().ok_or("no freeze measured")?;
    let versions: Vec<(String, i64)> = sqlx::query_as(
        "select flow_slug, count(*) from pgflow.runs where status = 'completed' group by 1 order by 1",
    )
    .fetch_all(pool)
    .await?;
    let (calls, failed, killed, dup, overloaded, overloaded_killed): (i64, i64, i64, i64, i64, i64) =
        sqlx::query_as(
            "select count(*), count(*) filter (where outcome = 'failed'), \
                    count(*) filter (where finished_at is null), count(*) filter (where outcome = 'duplicate'), \
                    count(distinct thread_id) filter (where step_slug = 'classify' and thread_id % 10 = 3), \
                    count(*) filter (where step_slug = 'classify' and thread_id % 10 = 3 and attempt = 1 \
                                       and finished_at is null) \
             from community.invocations",
        )
    .fetch_one(pool)
    .await?;
    let tasks = scalar_i64(
        pool,
        "select count(*) from pgflow.step_tasks where status = 'completed'",
    )
    .await?;
    // A call cut short by SIGKILL ends at the kill.
    let calls_cte = "with c as (select id, run_id, step_slug, pid, started_at as s, \
                     coalesce(finished_at, to_timestamp($1)) as e, outcome from community.invocations)";
    let (overlaps, posted_twice, finished_twice): (i64, i64, i64) = sqlx::query_as(&format!(
        "{calls_cte} select \
           (select count(*) from c a join c b on a.run_id = b.run_id and a.step_slug = b.step_slug \
              and a.id < b.id and b.s < a.e and a.s < b.e), \
           (select count(*) from (select run_id from c where step_slug = 'deliverSlack' and outcome = 'ok' \
              group by 1 having count(*) > 1) x), \
           (select count(*) from (select run_id, step_slug from c where outcome in ('ok', 'duplicate') \
              group by 1, 2 having count(*) > 1) x)"
    ))
    .bind(crash.killed_at)
    .fetch_one(pool)
    .await?;
    // Most handler calls running at once, per process and per queue.
    let peaks: Vec<(String, i32, i64)> = sqlx::query_as(&format!(
        "{calls_cte} select a.step_slug, a.pid, max((select count(*) from c b where b.step_slug = a.step_slug \
           and b.pid = a.pid and b.s <= a.s and b.e > a.s)) from c a group by 1, 2 order by 1, 2"
    ))
    .bind(crash.killed_at)
    .fetch_all(pool)
    .await?;
    let queue_peaks: Vec<(String, i64)> = sqlx::query_as(&format!(
        "{calls_cte} select a.step_slug, max((select count(*) from c b where b.step_slug = a.step_slug \
           and b.s <= a.s and b.e > a.s)) from c a group by 1 order by 1"
    ))
    .bind(crash.killed_at)
    .fetch_all(pool)
    .await?;
    let stale: u64 = sup.stopped.iter().map(|(_, s)| s.stale).sum();
    let released: u64 = sup.stopped.iter().map(|(_, s)| s.released).sum();
    let recorded_failures: u64 = sup.stopped.iter().map(|(_, s)| s.failed).sum();
    let cap = |step: &str| {
        if step == "classify" {
            CLASSIFY_CONCURRENCY
        } else {
            DELIVER_CONCURRENCY
        }
    };
    for (step, pid, peak) in &peaks {
        expect(usize::try_from(*peak)? <= cap(step), || {
            format!(
                "process {pid} ran {peak} {step} calls at once (max_concurrent {})",
                cap(step)
            )
        })?;
    }
    expect(stale >= 1, || {
        "the resumed worker reported its late result as stale".into()
    })?;
    expect(posted_twice == 0, || {
        format!("{posted_twice} threads posted to Slack twice")
    })?;
    expect(overlaps >= 1, || {
        "the frozen call overlapped its recovery".into()
    })?;

    let per_process: Vec<String> = ["classify", "deliverSlack"]
        .iter()
        .map(|step| {
            let peak = peaks
                .iter()
                .filter(|p| p.0 == *step)
                .map(|p| p.2)
                .max()
                .unwrap_or(0);
            format!("{step} {peak} (max_concurrent {})", cap(step))
        })
        .collect();
    let per_queue: Vec<String> = queue_peaks
        .iter()
        .map(|(step, peak)| format!("{step} {peak}"))
        .collect();
    let versions: Vec<String> = versions.iter().map(|(f, n)| format!("{f} {n}")).collect();
    let rows = [
        ("runs completed", versions.join(", ")),
        (
            "V1 runs",
            format!(
                "{} before the rollout ({} in flight when it began) + {} started during the fence \
                 + 1 started by alias after the operator's rollback (phase 6)",
                m.v1_runs_before_rollout, m.v1_in_flight_at_fence, m.v1_runs_during_fence
            ),
        ),
        (
            "V2 runs",
            format!(
                "{} started by alias after activation + 6 later (read twice, after retirement; in phase 6 2 around \
                 the mistaken start, 1 after the roll forward, 1 on the V1+V2 builds)",
                m.v2_runs
            ),
        ),
        ("V1 tasks run by V1+V2 builds", m.v1_tasks_run_by_new_builds.to_string()),
        ("fenced deploy", m.fenced_deploy.clone()),
        ("activation", m.activation.clone()),
        (
            "rollout",
            format!(
                "old workers drained in {} ms; claims paused {} ms (disable → new builds serving)",
                m.drain.as_millis(),
                m.claim_pause.as_millis()
            ),
        ),
        ("V1 not retirable while live", m.not_retirable.join("; ")),
        ("coverage refusal", format!("V2-only {DELIVER_FUNCTION}: {}", m.coverage_refusal)),
        (
            "retirement",
            format!("claims paused {} ms (disable → V2-only builds serving)", m.retire_pause.as_millis()),
        ),
        (
            "handler calls",
            format!(
                "{calls} for {tasks} completed tasks: {failed} failed once and retried ({overloaded} overloaded \
                 threads, {overloaded_killed} of whose first call SIGKILL cut short), {killed} cut by SIGKILL, \
                 {dup} refused second Slack post; failures in the reports of the workers that stopped cleanly \
                 {recorded_failures}, tasks handed back {released}"
            ),
        ),
        (
            "crash (SIGKILL)",
            format!(
                "{} classify task(s) started under it, {} left once its sessions ended; requeued after {:.0} ms, \
                 running elsewhere after {:.0} ms (heartbeat 250 ms, dead_worker_timeout {} ms)",
                crash.started_at_kill,
                crash.held,
                crash.detected_ms,
                crash.recovered_ms,
                DEAD_WORKER_TIMEOUT.as_millis()
            ),
        ),
        (
            "ambiguity (SIGSTOP)",
            format!(
                "frozen {:.0} ms; its task running elsewhere after {:.0} ms; stale results ignored {stale}; {}",
                freeze.held_ms, freeze.recovered_ms, freeze.side_effect
            ),
        ),
        (
            "read twice",
            format!(
                "message read {} times, {} handler call",
                m.reads_of_twice_read_message, m.invocations_of_twice_read_task
            ),
        ),
        (
            "concurrency",
            format!(
                "2 processes per queue; most calls at once per process: {}; per queue: {}",
                per_process.join(", "),
                per_queue.join(", ")
            ),
        ),
        (
            "duplicates",
            format!(
                "overlapping calls of one task {overlaps}; tasks whose handler finished twice {finished_twice}, \
                 each with one recorded result; Slack posts made twice {posted_twice}"
            ),
        ),
        ("typed handle", m.cross_version_handle.clone()),
        ("mistaken restart", m.mistaken_start.clone()),
        ("rollback and roll forward", m.rollback.clone()),
        ("retired build, idle queue", m.idle_restart.clone()),
        ("worker warnings", sup.warnings.len().to_string()),
    ];
    println!("\n== Report ==");
    for (label, value) in rows {
        println!("{label:<29}{value}");
    }
    let all_warnings = std::env::var_os("COMMUNITY_ROLLOUT_VERBOSE").is_some();
    for w in &sup.warnings {
        if all_warnings
            || w.contains("stale")
            || w.contains("declared dead")
            || w.contains("recovered")
        {
            println!("  {}", truncate(w, 200));
        }
    }
    println!("{:<29}{:.1} s", "wall time", wall.as_secs_f64());
    Ok(())
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_owned()
    } else {
        format!("{}…", s.chars().take(n).collect::<String>())
    }
}
