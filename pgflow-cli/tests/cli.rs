//! The `pgflow` binary end to end: every command against a real database with pgflow installed, a real flow
//! compiled and run by a real worker. `--json` output is parsed and checked against the database; exit codes
//! (0 success, 1 error, 2 usage) and the "what to do" of error messages are checked too.

use std::process::Output;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pgflow_runtime::{flow, Flow, StepError, Worker};
use pgflow_tests::state::{start, wait_finished};
use pgflow_tests::{Contents, LIMIT};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// While set, `each` fails on element 1 (`max_attempts = 1`: the run fails at once).
static BROKEN: AtomicBool = AtomicBool::new(false);

/// Held by each test that sets [`BROKEN`], so that under `cargo test` (tests on threads of one process) no
/// other test's runs see it set.
static BROKEN_USERS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

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

    // Before install, read commands say to install.
    let stderr = fails(Some(url), &["status"], 1).await;
    assert!(stderr.contains("run `pgflow install`"), "{stderr}");
    let stderr = fails(Some(url), &["runs"], 1).await;
    assert!(stderr.contains("run `pgflow install`"), "{stderr}");

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
    let as_json = json_of(url, &["sql"]).await;
    assert_eq!(as_json["sql"], json!(pgflow_sql::install_script()));
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
    let _serial = BROKEN_USERS.lock().await;
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
    // Both are in the operator record, the refusal with its error.
    let record: Vec<(Uuid, String, String, bool, Option<String>)> = sqlx::query_as(
        "select run_id, action, source, succeeded, error from pgflow.operator_actions order by action_id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(record.len(), 2, "{record:?}");
    assert_eq!(
        (
            record[0].0,
            record[0].1.as_str(),
            record[0].2.as_str(),
            record[0].3
        ),
        (failed, "retry", "cli", true)
    );
    assert_eq!((record[1].0, record[1].3), (done, false));
    assert!(
        record[1]
            .4
            .as_deref()
            .unwrap_or("")
            .contains("pgflow replay"),
        "{record:?}"
    );

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

    // A map of 205 elements: `run` lists the first 200 tasks and says so.
    let big = start(pool, "cliFlow", json!({"tenant": 9, "n": 205})).await;
    assert_eq!(wait_finished(pool, big).await, "completed");
    let text = ok(url, &["run", &big.to_string()]).await;
    assert!(text.contains("[each: completed 205/205]"), "{text}");
    assert!(
        text.contains("step each: 200 of its 205 tasks shown"),
        "{text}"
    );
    let detail = json_of(url, &["run", &big.to_string()]).await;
    let each_tasks = detail["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["step_slug"] == "each")
        .count();
    assert_eq!(each_tasks, 200);

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
    let events_before: i64 = scalar(pool, "select count(*) from pgflow.events").await;
    let pruned = json_of(url, &["prune", "--older-than", "0s", "--batch", "3"]).await;
    assert_eq!(pruned["runs"], json!(finished), "{pruned}");
    let left: i64 = scalar(
        pool,
        "select count(*) from pgflow.runs where status <> 'started'",
    )
    .await;
    assert_eq!(left, 0);
    let events_after: i64 = scalar(pool, "select count(*) from pgflow.events").await;
    assert!(events_before > 0);
    assert_eq!(
        pruned["events"],
        json!(events_before - events_after),
        "{pruned}"
    );
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
    assert_eq!(listed[0]["last_run_id"], Value::Null);
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

/// The run ids of a `runs --json` answer.
fn ids(answer: &Value) -> Vec<Uuid> {
    answer["runs"]
        .as_array()
        .unwrap_or_else(|| panic!("no runs list: {answer}"))
        .iter()
        .map(|r| serde_json::from_value(r["run_id"].clone()).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_commands_agree_with_the_database() {
    let _serial = BROKEN_USERS.lock().await;
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let url = db.url();
    compile::<parked_flow::ParkedFlow>(pool).await;
    let worker = Worker::<cli_flow::CliFlow>::builder(pool.clone())
        .poll_interval(Duration::from_millis(10))
        .max_poll_wait(Duration::from_millis(50))
        .heartbeat_interval(Duration::from_millis(100))
        .build()
        .unwrap()
        .spawn(CancellationToken::new())
        .await
        .unwrap();
    let done = start(pool, "cliFlow", json!({"tenant": 1, "n": 4})).await;
    assert_eq!(wait_finished(pool, done).await, "completed");
    BROKEN.store(true, Ordering::SeqCst);
    let failed = start(pool, "cliFlow", json!({"tenant": 2, "n": 3})).await;
    assert_eq!(wait_finished(pool, failed).await, "failed");
    BROKEN.store(false, Ordering::SeqCst);
    let parked_a = start(pool, "parkedFlow", json!({"tenant": 3, "n": 1})).await;
    let parked_b = start(pool, "parkedFlow", json!({"tenant": 3, "n": 2})).await;
    ok(url, &["activate", "orders", "cliFlow"]).await;
    ok(url, &["fence", "retired-fn", "--reason", "old build"]).await;

    // runs: filters, against the database.
    let all = json_of(url, &["runs"]).await;
    let in_db: Vec<Uuid> =
        sqlx::query_scalar("select run_id from pgflow.runs order by started_at desc, run_id desc")
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(ids(&all), in_db, "every run, newest first");
    assert_eq!(all["next"], Value::Null);
    let mut of_flow = ids(&json_of(url, &["runs", "--flow", "cliFlow"]).await);
    of_flow.sort();
    let mut expected = vec![done, failed];
    expected.sort();
    assert_eq!(of_flow, expected);
    let mut of_alias = ids(&json_of(url, &["runs", "--flow", "orders"]).await);
    of_alias.sort();
    assert_eq!(of_alias, expected, "an alias lists its version's runs");
    assert_eq!(
        ids(&json_of(url, &["runs", "--status", "failed"]).await),
        [failed]
    );
    assert_eq!(
        ids(&json_of(url, &["runs", "--input-eq", "tenant=2"]).await),
        [failed]
    );
    let mut tenant3 = ids(&json_of(url, &["runs", "--input-eq", "tenant=3"]).await);
    tenant3.sort();
    let mut parked = vec![parked_a, parked_b];
    parked.sort();
    assert_eq!(tenant3, parked);
    assert_eq!(
        ids(&json_of(url, &["runs", "--since", "1h"]).await).len(),
        4
    );
    assert!(ids(&json_of(url, &["runs", "--before", "1h"]).await).is_empty());
    let first = json_of(url, &["runs", "--limit", "1"]).await;
    assert_eq!(ids(&first), [in_db[0]]);
    let cursor = first["next"].as_str().expect("a next page").to_owned();
    let second = json_of(url, &["runs", "--limit", "1", "--after", &cursor]).await;
    assert_eq!(ids(&second), [in_db[1]]);
    let stderr = fails(Some(url), &["runs", "--status", "sleeping"], 2).await;
    assert!(stderr.contains("possible values"), "{stderr}");
    let table = ok(url, &["runs", "--status", "failed"]).await;
    assert!(
        table.contains(&failed.to_string()) && table.contains("RUN"),
        "{table}"
    );

    // run ID: steps, tasks, errors and the DAG.
    let detail = json_of(url, &["run", &failed.to_string()]).await;
    assert_eq!(detail["status"], json!("failed"));
    assert_eq!(detail["flow_slug"], json!("cliFlow"));
    assert_eq!(detail["aliases"], json!(["orders"]));
    assert_eq!(detail["input"], json!({"tenant": 2, "n": 3}));
    let steps: Vec<(String, String)> = sqlx::query_as(
        "select step_slug, status from pgflow.step_states where run_id = $1 order by step_slug",
    )
    .bind(failed)
    .fetch_all(pool)
    .await
    .unwrap();
    let mut reported: Vec<(String, String)> = detail["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["step_slug"].as_str().unwrap().to_owned(),
                s["status"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    reported.sort();
    assert_eq!(reported, steps);
    let each = detail["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["step_slug"] == "each")
        .unwrap();
    assert_eq!(each["deps"], json!(["split"]));
    let failed_tasks: Vec<&Value> = detail["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["status"] == "failed")
        .collect();
    assert_eq!(failed_tasks.len(), 1, "{detail}");
    assert_eq!(failed_tasks[0]["task_index"], json!(1));
    assert_eq!(failed_tasks[0]["attempts"], json!(1));
    assert!(failed_tasks[0]["error_message"]
        .as_str()
        .unwrap()
        .contains("element 1 is broken"));
    let tasks_in_db: i64 =
        sqlx::query_scalar("select count(*) from pgflow.step_tasks where run_id = $1")
            .bind(failed)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(
        detail["tasks"].as_array().unwrap().len() as i64,
        tasks_in_db
    );
    assert_eq!(
        detail["dag"][0],
        json!("[split: completed]"),
        "{}",
        detail["dag"]
    );
    let text = ok(url, &["run", &done.to_string()]).await;
    assert!(
        text.contains("split ──▶ each") && text.contains("each ──▶ total"),
        "{text}"
    );
    assert!(text.contains("[each: completed 4/4]"), "{text}");
    let failed_text = ok(url, &["run", &failed.to_string()]).await;
    assert!(failed_text.contains("[total: created]"), "{failed_text}");
    assert!(failed_text.contains("element 1 is broken"), "{failed_text}");
    assert!(
        failed_text.contains(&format!("pgflow retry {failed}")),
        "{failed_text}"
    );
    let output = pgflow_tests::state::run_output(pool, done).await.unwrap();
    assert!(
        text.contains(&output.to_string()),
        "the output is shown:\n{text}"
    );
    let missing = Uuid::new_v4().to_string();
    let stderr = fails(Some(url), &["run", &missing], 1).await;
    assert!(
        stderr.contains(&missing) && stderr.contains("`pgflow runs`"),
        "{stderr}"
    );

    // status: queues, uncovered routes, fenced functions.
    let status = json_of(url, &["status"]).await;
    let queue = |name: &str| {
        status["queues"]
            .as_array()
            .unwrap()
            .iter()
            .find(|q| q["queue_name"] == name)
            .unwrap_or_else(|| panic!("queue {name} in {status}"))
            .clone()
    };
    let depth: i64 = scalar(pool, "select count(*) from pgmq.q_parkedflow").await;
    assert_eq!(depth, 2);
    assert_eq!(queue("parkedflow")["depth"], json!(depth));
    assert!(queue("parkedflow")["oldest_age_seconds"].as_f64().is_some());
    assert_eq!(queue("parkedflow")["live_workers"], json!(0));
    assert_eq!(queue("cliflow")["live_workers"], json!(1));
    let uncovered = status["uncovered_routes"].as_array().unwrap();
    assert!(
        uncovered.iter().any(|u| u["flow_slug"] == "parkedFlow"
            && u["step_slug"] == "hold"
            && u["queued_tasks"] == 2),
        "{status}"
    );
    assert!(
        !uncovered.iter().any(|u| u["flow_slug"] == "cliFlow"),
        "{status}"
    );
    let disabled = status["disabled_functions"].as_array().unwrap();
    assert_eq!(disabled.len(), 1, "{status}");
    assert_eq!(disabled[0]["function_name"], json!("retired-fn"));
    assert_eq!(disabled[0]["disabled_reason"], json!("old build"));
    let text = ok(url, &["status"]).await;
    assert!(
        text.contains("parkedflow") && text.contains("retired-fn"),
        "{text}"
    );

    // aliases.
    let aliases = json_of(url, &["aliases"]).await;
    assert_eq!(aliases[0]["alias"], json!("orders"), "{aliases}");
    assert_eq!(aliases[0]["flow_slug"], json!("cliFlow"));
    assert_eq!(aliases[0]["versions"][0]["flow_slug"], json!("cliFlow"));
    let text = ok(url, &["aliases"]).await;
    assert!(
        text.contains("orders") && text.contains("cliFlow"),
        "{text}"
    );

    worker.stop().await.unwrap();
}

/// A flow whose one step fails on its first two attempts, naming the attempt, and then succeeds.
#[flow(slug = "flakyCliFlow", input = u32, max_attempts = 3, base_delay = 0)]
mod flaky_cli_flow {
    use super::*;
    use pgflow_runtime::StepContext;

    /// `n`, at the third attempt.
    #[step]
    async fn flaky(n: u32, ctx: &StepContext<FlakyCliFlow>) -> Result<u32, StepError> {
        if ctx.attempt() < 3 {
            return Err(StepError::msg(format!("attempt {} failed", ctx.attempt())));
        }
        Ok(n)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_shows_every_attempt_of_a_task_that_failed_twice_then_succeeded() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let url = db.url();
    let worker = Worker::<flaky_cli_flow::FlakyCliFlow>::builder(pool.clone())
        .poll_interval(Duration::from_millis(10))
        .max_poll_wait(Duration::from_millis(50))
        .build()
        .unwrap()
        .spawn(CancellationToken::new())
        .await
        .unwrap();
    let run = start(pool, "flakyCliFlow", json!(5)).await;
    assert_eq!(wait_finished(pool, run).await, "completed");

    let detail = json_of(url, &["run", &run.to_string()]).await;
    let history = detail["tasks"][0]["attempt_history"]
        .as_array()
        .unwrap_or_else(|| panic!("attempt_history in {detail}"));
    let seen: Vec<(Value, Value, Value, Value, Value)> = history
        .iter()
        .map(|a| {
            (
                a["attempt"].clone(),
                a["outcome"].clone(),
                a["current"].clone(),
                a["worker_id"].clone(),
                a["error_message"].clone(),
            )
        })
        .collect();
    let id = json!(worker.id());
    assert_eq!(
        seen,
        [
            (
                json!(1),
                json!("failed"),
                json!(false),
                id.clone(),
                json!("attempt 1 failed")
            ),
            (
                json!(2),
                json!("failed"),
                json!(false),
                id.clone(),
                json!("attempt 2 failed")
            ),
            (json!(3), json!("completed"), json!(true), id, Value::Null),
        ],
        "{detail}"
    );
    let text = ok(url, &["run", &run.to_string()]).await;
    assert!(
        text.contains("attempts of the tasks that ran more than once")
            && text.contains("attempt 1 failed")
            && text.contains("attempt 2 failed"),
        "{text}"
    );
    worker.stop().await.unwrap();
}

/// `GET path` over HTTP/1.1 on 127.0.0.1:`port`; the whole response (status line, headers, body) as text.
async fn http_get(port: u16, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let request =
        format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.unwrap();
    String::from_utf8_lossy(&response).into_owned()
}

/// A port nothing listens on right now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_serves_the_runs_of_the_database_until_stopped() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let url = db.url();
    compile::<parked_flow::ParkedFlow>(pool).await;
    let run = start(pool, "parkedFlow", json!({"tenant": 5, "n": 1})).await;

    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_pgflow"))
        .args([
            "--database-url",
            url,
            "--json",
            "dashboard",
            "--listen",
            &listen,
            "--hide-payloads",
        ])
        .env_remove("DATABASE_URL")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stdout = tokio::io::BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    tokio::time::timeout(
        LIMIT,
        tokio::io::AsyncBufReadExt::read_line(&mut stdout, &mut first),
    )
    .await
    .expect("the dashboard announces itself")
    .unwrap();
    let mut announced = first.clone();
    // The JSON document is pretty-printed: read up to its closing brace.
    while !announced.trim_end().ends_with('}') || announced.trim() == "{" {
        let mut line = String::new();
        tokio::io::AsyncBufReadExt::read_line(&mut stdout, &mut line)
            .await
            .unwrap();
        assert!(!line.is_empty(), "stdout ended: {announced}");
        announced.push_str(&line);
    }
    let announced: Value = serde_json::from_str(&announced).unwrap();
    assert_eq!(announced["url"], json!(format!("http://{listen}/")));
    assert_eq!(announced["writable"], json!(false));
    assert_eq!(announced["hide_payloads"], json!(true));

    pgflow_tests::wait_until(LIMIT, "the dashboard to listen", || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    })
    .await;
    let page = http_get(port, "/runs").await;
    assert!(page.starts_with("HTTP/1.1 200"), "{page}");
    assert!(
        page.contains(&run.to_string()),
        "the run list shows the run:\n{page}"
    );
    let detail = http_get(port, &format!("/runs/{run}")).await;
    assert!(
        detail.starts_with("HTTP/1.1 200") && detail.contains("hold"),
        "{detail}"
    );
    child.kill().await.unwrap();

    // The address is taken: exit 1, and the message says to pick another port.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_addr = taken.local_addr().unwrap().to_string();
    let stderr = fails(Some(url), &["dashboard", "--listen", &taken_addr], 1).await;
    assert!(stderr.contains("--listen 127.0.0.1:PORT"), "{stderr}");
    drop(taken);

    // A write token variable that is not set: exit 1, saying what to export.
    let stderr = fails(
        Some(url),
        &[
            "dashboard",
            "--listen",
            &listen,
            "--write-token-env",
            "PGFLOW_CLI_TEST_NO_SUCH_TOKEN",
        ],
        1,
    )
    .await;
    assert!(
        stderr.contains("PGFLOW_CLI_TEST_NO_SUCH_TOKEN") && stderr.contains("export"),
        "{stderr}"
    );
}
