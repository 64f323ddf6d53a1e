//! The `pgflow` binary end to end: every command against a real database with pgflow installed, a real flow
//! compiled and run by a real worker. `--json` output is parsed and checked against the database; exit codes
//! (0 success, 1 error, 2 usage) and the "what to do" of error messages are checked too.

use std::process::Output;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pgflow_runtime::{flow, Flow, StepError, Worker};
use pgflow_tests::state::{start, wait_finished};
use pgflow_tests::Contents;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// While set, `each` fails on element 1 (`max_attempts = 1`: the run fails at once).
static BROKEN: AtomicBool = AtomicBool::new(false);

/// A run's input: the tenant (for `--input-eq`) and the number of elements to map over.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Order {
    /// The tenant.
    pub tenant: u32,
    /// Elements.
    pub n: u32,
}

#[flow(slug = "cliFlow", input = Order, max_attempts = 1, timeout = 30)]
mod cli_flow {
    use super::*;

    /// `0..n`.
    #[step]
    async fn split(order: Order) -> Result<Vec<u32>, StepError> {
        Ok((0..order.n).collect())
    }

    /// `x + 1`; fails on 1 while [`BROKEN`] is set.
    #[step(map = split)]
    async fn each(x: u32) -> Result<u32, StepError> {
        if x == 1 && BROKEN.load(Ordering::SeqCst) {
            return Err(StepError::msg("element 1 is broken"));
        }
        Ok(x + 1)
    }

    /// The sum.
    #[step(depends_on = [each])]
    async fn total(each: Vec<u32>) -> Result<u32, StepError> {
        Ok(each.iter().sum())
    }
}

/// A flow no worker serves: its runs stay started with their tasks queued.
#[flow(slug = "parkedFlow", input = Order)]
mod parked_flow {
    use super::*;

    /// Never runs in these tests.
    #[step]
    async fn hold(order: Order) -> Result<u32, StepError> {
        Ok(order.n)
    }
}

/// Runs `pgflow ARGS` against `url` (no `DATABASE_URL` inherited), off the async runtime.
async fn pgflow_at(url: Option<&str>, args: &[&str]) -> Output {
    let mut all: Vec<String> = Vec::new();
    if let Some(url) = url {
        all.push("--database-url".to_owned());
        all.push(url.to_owned());
    }
    all.extend(args.iter().map(|a| (*a).to_owned()));
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_pgflow"))
            .args(&all)
            .env_remove("DATABASE_URL")
            .output()
            .expect("the pgflow binary runs")
    })
    .await
    .unwrap()
}

/// Runs `pgflow ARGS` against `url` and returns its stdout; panics unless it exits 0.
async fn ok(url: &str, args: &[&str]) -> String {
    let out = pgflow_at(Some(url), args).await;
    assert_eq!(
        out.status.code(),
        Some(0),
        "pgflow {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Runs `pgflow --json ARGS` and parses its stdout.
async fn json_of(url: &str, args: &[&str]) -> Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let text = ok(url, &all).await;
    serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("pgflow {args:?}: not JSON ({e}):\n{text}"))
}

/// Runs `pgflow ARGS`, expects exit code `code`, and returns its stderr.
async fn fails(url: Option<&str>, args: &[&str], code: i32) -> String {
    let out = pgflow_at(url, args).await;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(code), "pgflow {args:?}: {stderr}");
    stderr
}

/// Compiles `F` as a worker's startup does (so runs can start without a worker).
async fn compile<F: Flow>(pool: &PgPool) {
    let result: Value =
        sqlx::query_scalar("select pgflow.ensure_flow_compiled(flow_slug => $1, shape => $2)")
            .bind(F::SLUG)
            .bind(F::shape())
            .fetch_one(pool)
            .await
            .unwrap();
    assert_ne!(result["status"], "mismatch", "{result}");
}

async fn scalar<T>(pool: &PgPool, sql: &str) -> T
where
    T: for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send + Unpin,
{
    sqlx::query_scalar(sql)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn install_applies_every_migration_once_and_sql_prints_the_script() {
    let db = pgflow_tests::db_with(Contents::Empty).await;
    let url = db.url();

    let first = json_of(url, &["install"]).await;
    let applied: Vec<String> =
        sqlx::query_scalar("select version from pgflow.schema_migrations order by 1")
            .fetch_all(db.pool())
            .await
            .unwrap();
    assert!(!applied.is_empty());
    let mut reported: Vec<String> = first["applied"]
        .as_array()
        .expect("applied is a list")
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    reported.sort();
    assert_eq!(
        reported, applied,
        "install reports what the database recorded"
    );
    assert_eq!(first["latest"], json!(pgflow_sql::latest_version()));

    let again = json_of(url, &["install"]).await;
    assert_eq!(
        again["applied"],
        json!([]),
        "a second install applies nothing"
    );
    assert_eq!(again["pgmq"], json!("already present"));

    let sql = ok(url, &["sql"]).await;
    assert_eq!(sql.trim_end(), pgflow_sql::install_script().trim_end());
    // `sql` needs no database at all.
    let offline = pgflow_at(None, &["sql"]).await;
    assert_eq!(offline.status.code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_exit_1_and_say_what_to_do_and_usage_errors_exit_2() {
    let db = pgflow_tests::test_db().await;
    let url = db.url();

    let missing = Uuid::new_v4().to_string();
    let stderr = fails(None, &["retry", &missing], 1).await;
    assert!(stderr.contains("DATABASE_URL is not set"), "{stderr}");
    assert!(stderr.contains("--database-url"), "{stderr}");

    let stderr = fails(Some(url), &["retry", &missing], 1).await;
    assert!(
        stderr.contains(&missing) && stderr.contains("`pgflow runs`"),
        "{stderr}"
    );

    let stderr = fails(Some(url), &["retry", "not-a-uuid"], 2).await;
    assert!(stderr.contains("invalid value"), "{stderr}");
    fails(Some(url), &["no-such-command"], 2).await;
    fails(Some(url), &["prune"], 2).await;

    let stderr = fails(Some(url), &["cancel"], 1).await;
    assert!(stderr.contains("--all"), "{stderr}");

    let stderr = fails(
        Some("postgres://nobody@127.0.0.1:1/nothing"),
        &["retry", &missing],
        1,
    )
    .await;
    assert!(
        stderr.contains("cannot connect") && stderr.contains("check the URL"),
        "{stderr}"
    );

    let stderr = fails(Some(url), &["activate", "orders", "noSuchFlow"], 1).await;
    assert!(stderr.contains("noSuchFlow"), "{stderr}");

    let stderr = fails(Some(url), &["unfence", "nobody"], 1).await;
    assert!(stderr.contains("pgflow status"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_control_and_rollout_commands_change_the_database_as_they_report() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let url = db.url();
    compile::<parked_flow::ParkedFlow>(pool).await;
    let worker = Worker::<cli_flow::CliFlow>::builder(pool.clone())
        .poll_interval(Duration::from_millis(10))
        .max_poll_wait(Duration::from_millis(50))
        .heartbeat_interval(Duration::from_millis(100))
        .worker_name("cli-worker")
        .build()
        .unwrap()
        .spawn(CancellationToken::new())
        .await
        .unwrap();

    // A completed run and a failed one.
    let done = start(pool, "cliFlow", json!({"tenant": 1, "n": 3})).await;
    assert_eq!(wait_finished(pool, done).await, "completed");
    BROKEN.store(true, Ordering::SeqCst);
    let failed = start(pool, "cliFlow", json!({"tenant": 2, "n": 3})).await;
    assert_eq!(wait_finished(pool, failed).await, "failed");
    BROKEN.store(false, Ordering::SeqCst);

    // retry: the failed run completes in place.
    let retried = json_of(url, &["retry", &failed.to_string()]).await;
    assert_eq!(retried["run_id"], json!(failed));
    assert_eq!(retried["status"], json!("started"));
    assert_eq!(wait_finished(pool, failed).await, "completed");
    let retries: i32 = sqlx::query_scalar("select retry_count from pgflow.runs where run_id = $1")
        .bind(failed)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(retries, 1);
    // A completed run cannot be retried: the message points at replay.
    let stderr = fails(Some(url), &["retry", &done.to_string()], 1).await;
    assert!(stderr.contains("pgflow replay"), "{stderr}");

    // replay: a new run, which completes with the same output.
    let replayed = json_of(url, &["replay", &done.to_string(), "--from", "each"]).await;
    let new_run: Uuid = serde_json::from_value(replayed["run_id"].clone()).unwrap();
    assert_ne!(new_run, done);
    assert_eq!(wait_finished(pool, new_run).await, "completed");
    let (replay_of, output): (Option<Uuid>, Option<Value>) =
        sqlx::query_as("select replay_of, output from pgflow.runs where run_id = $1")
            .bind(new_run)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(replay_of, Some(done));
    assert_eq!(output, pgflow_tests::state::run_output(pool, done).await);
    assert!(output.is_some());
    let stderr = fails(
        Some(url),
        &["replay", &done.to_string(), "--from", "nope"],
        1,
    )
    .await;
    assert!(stderr.contains(&format!("pgflow run {done}")), "{stderr}");

    // Parked runs: one cancelled by id, the tenant-7 ones in bulk by input, the rest stay started.
    let mut parked = Vec::new();
    for tenant in [7, 7, 7, 8, 9] {
        parked.push(start(pool, "parkedFlow", json!({"tenant": tenant, "n": 1})).await);
    }
    let not_retirable = json_of(url, &["retirable", "parkedFlow"]).await;
    assert_eq!(not_retirable["retirable"], json!(false), "{not_retirable}");

    let one = json_of(url, &["cancel", &parked[4].to_string(), "--reason", "test"]).await;
    assert_eq!(one["changed"], json!(true));
    assert_eq!(
        pgflow_tests::state::run_status(pool, parked[4]).await,
        "cancelled"
    );
    let again = json_of(url, &["cancel", &parked[4].to_string()]).await;
    assert_eq!(
        again["changed"],
        json!(false),
        "cancelling twice changes nothing"
    );

    // Without --yes and without a terminal, a bulk cancel refuses and says to pass --yes.
    let stderr = fails(Some(url), &["cancel", "--flow", "parkedFlow"], 1).await;
    assert!(stderr.contains("--yes"), "{stderr}");
    let bulk = json_of(
        url,
        &[
            "cancel",
            "--flow",
            "parkedFlow",
            "--input-eq",
            "tenant=7",
            "--yes",
        ],
    )
    .await;
    assert_eq!(bulk["cancelled"], json!(3));
    let cancelled: i64 = scalar(
        pool,
        "select count(*) from pgflow.runs where flow_slug = 'parkedFlow' and status = 'cancelled' \
         and input->>'tenant' = '7'",
    )
    .await;
    assert_eq!(cancelled, 3);
    assert_eq!(
        pgflow_tests::state::run_status(pool, parked[3]).await,
        "started"
    );

    // activate: an alias, then a no-op.
    let activated = json_of(url, &["activate", "orders", "cliFlow"]).await;
    assert_eq!(activated["activated"], json!(true), "{activated}");
    let target: String = scalar(
        pool,
        "select flow_slug from pgflow.flow_aliases where alias = 'orders'",
    )
    .await;
    assert_eq!(target, "cliFlow");
    let text = ok(url, &["activate", "orders", "cliFlow"]).await;
    assert!(text.contains("nothing changed"), "{text}");

    // fence and unfence the worker's function.
    let function: String = scalar(
        pool,
        "select function_name from pgflow.worker_functions limit 1",
    )
    .await;
    let fenced = json_of(url, &["fence", &function, "--reason", "bad deploy"]).await;
    assert_eq!(fenced["enabled"], json!(false), "{fenced}");
    let (enabled, reason): (bool, Option<String>) = sqlx::query_as(
        "select enabled, disabled_reason from pgflow.worker_functions where function_name = $1",
    )
    .bind(&function)
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(!enabled);
    assert_eq!(reason.as_deref(), Some("bad deploy"));
    let unfenced = json_of(url, &["unfence", &function]).await;
    assert_eq!(unfenced["enabled"], json!(true), "{unfenced}");
    let enabled: bool =
        sqlx::query_scalar("select enabled from pgflow.worker_functions where function_name = $1")
            .bind(&function)
            .fetch_one(pool)
            .await
            .unwrap();
    assert!(enabled);

    // Cancelling the rest makes the parked version retirable.
    let rest = json_of(url, &["cancel", "--flow", "parkedFlow", "--yes"]).await;
    assert_eq!(rest["cancelled"], json!(1));
    let retirable = json_of(url, &["retirable", "parkedFlow"]).await;
    assert_eq!(retirable["retirable"], json!(true), "{retirable}");

    // prune: every finished run goes (older than 0 seconds), and the database agrees.
    worker.stop().await.unwrap();
    let finished: i64 = scalar(
        pool,
        "select count(*) from pgflow.runs where status <> 'started'",
    )
    .await;
    assert!(finished >= 8);
    let pruned = json_of(url, &["prune", "--older-than", "0s", "--batch", "3"]).await;
    assert_eq!(pruned["runs"], json!(finished), "{pruned}");
    let left: i64 = scalar(
        pool,
        "select count(*) from pgflow.runs where status <> 'started'",
    )
    .await;
    assert_eq!(left, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schedules_are_listed_paused_and_resumed() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let url = db.url();
    compile::<cli_flow::CliFlow>(pool).await;
    let empty = json_of(url, &["schedules"]).await;
    assert_eq!(empty, json!([]));
    pgflow_runtime::schedules::Schedule::new("nightly", "cliFlow", "0 3 * * *")
        .input(json!({"tenant": 4, "n": 2}))
        .set(pool)
        .await
        .unwrap();

    let listed = json_of(url, &["schedules", "list"]).await;
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(listed[0]["schedule_name"], json!("nightly"));
    assert_eq!(listed[0]["flow_slug"], json!("cliFlow"));
    assert_eq!(listed[0]["cron"], json!("0 3 * * *"));
    assert_eq!(listed[0]["input"], json!({"tenant": 4, "n": 2}));
    assert_eq!(listed[0]["paused"], json!(false));

    let paused = json_of(url, &["schedules", "pause", "nightly"]).await;
    assert_eq!(paused["paused"], json!(true));
    let in_db: bool = scalar(
        pool,
        "select paused from pgflow.schedules where schedule_name = 'nightly'",
    )
    .await;
    assert!(in_db);
    let table = ok(url, &["schedules"]).await;
    assert!(
        table.contains("nightly") && table.contains("paused"),
        "{table}"
    );

    json_of(url, &["schedules", "resume", "nightly"]).await;
    let in_db: bool = scalar(
        pool,
        "select paused from pgflow.schedules where schedule_name = 'nightly'",
    )
    .await;
    assert!(!in_db);

    let stderr = fails(Some(url), &["schedules", "pause", "weekly"], 1).await;
    assert!(
        stderr.contains("weekly") && stderr.contains("`pgflow schedules`"),
        "{stderr}"
    );
}
