//! A three-step flow driven entirely through pgflow's public SQL interface.
//!
//! `cargo run -p pgflow-examples --bin sql_quickstart`
//!
//! It gets a database of its own (on a throwaway PostgreSQL unless `DATABASE_URL` is set), installs
//! PGMQ and pgflow, defines `greet_user` (`fetch_user` → `greeting` → `shout`), starts a run, and
//! plays the worker: read messages from the flow's queue, claim them with `pgflow.start_tasks`,
//! compute each step's output, and report it with `pgflow.complete_task`. Any language that can
//! run SQL can drive flows this way; the Rust workers in `pgflow-runtime` do the same, faster.

use std::process::ExitCode;
use std::time::Duration;

use pgflow_sql::throwaway::{fresh_database, Contents};
use serde_json::{json, Value};
use sqlx::PgPool;
use uuid::Uuid;

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sql_quickstart: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let db = fresh_database(Contents::Empty).await?;
    let pool = db.pool();
    let report = pgflow_sql::install(pool).await?;
    println!(
        "installed pgflow (PGMQ: {:?}, migrations: {})",
        report.pgmq,
        report.applied.len()
    );

    // The flow definition, in the same shape JSON that workers send at startup.
    let shape = json!({
        "steps": [
            step("fetch_user", &[]),
            step("greeting", &["fetch_user"]),
            step("shout", &["greeting"]),
        ]
    });
    let compiled: Value =
        sqlx::query_scalar("select pgflow.ensure_flow_compiled('greet_user', $1)")
            .bind(&shape)
            .fetch_one(pool)
            .await?;
    println!("ensure_flow_compiled: {}", compiled["status"]);

    let run_id: Uuid = sqlx::query_scalar("select run_id from pgflow.start_flow('greet_user', $1)")
        .bind(json!({ "user_id": 42 }))
        .fetch_one(pool)
        .await?;
    println!("started run {run_id}");

    let worker_id = Uuid::new_v4();
    sqlx::query("insert into pgflow.workers (worker_id, queue_name, function_name) values ($1, 'greet_user', 'sql_quickstart')")
        .bind(worker_id)
        .execute(pool)
        .await?;

    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while run_status(pool, run_id).await? == "started" {
        if std::time::Instant::now() > deadline {
            return Err("the run did not finish within 30 s".into());
        }
        let ids: Vec<i64> =
            sqlx::query_scalar("select msg_id from pgmq.read('greet_user', 30, 10)")
                .fetch_all(pool)
                .await?;
        if ids.is_empty() {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        let tasks: Vec<(String, Value, i32, Option<Value>)> = sqlx::query_as(
            "select step_slug, input, task_index, flow_input \
             from pgflow.start_tasks(flow_slug => 'greet_user', msg_ids => $1, worker_id => $2)",
        )
        .bind(&ids)
        .bind(worker_id)
        .fetch_all(pool)
        .await?;
        for (step_slug, input, task_index, flow_input) in tasks {
            let output = handle(&step_slug, &input, flow_input.as_ref());
            println!("  {step_slug}: {input} -> {output}");
            sqlx::query("select pgflow.complete_task(run_id => $1, step_slug => $2, task_index => $3, output => $4)")
                .bind(run_id)
                .bind(&step_slug)
                .bind(task_index)
                .bind(&output)
                .execute(pool)
                .await?;
        }
    }

    let (status, output): (String, Option<Value>) =
        sqlx::query_as("select status, output from pgflow.runs where run_id = $1")
            .bind(run_id)
            .fetch_one(pool)
            .await?;
    println!(
        "run {run_id} {status}; output: {}",
        output.unwrap_or(Value::Null)
    );
    if status != "completed" {
        return Err(format!("run ended {status}").into());
    }
    Ok(())
}

fn step(slug: &str, dependencies: &[&str]) -> Value {
    json!({
        "slug": slug,
        "stepType": "single",
        "dependencies": dependencies,
        "whenUnmet": "skip",
        "whenExhausted": "fail",
        "requiredInputPattern": { "defined": false },
        "forbiddenInputPattern": { "defined": false },
    })
}

/// The "handlers": a root step gets the run input as `flow_input`; a dependent step gets an object
/// holding its dependencies' outputs.
fn handle(step_slug: &str, input: &Value, flow_input: Option<&Value>) -> Value {
    match step_slug {
        "fetch_user" => {
            let id = flow_input
                .and_then(|i| i["user_id"].as_i64())
                .unwrap_or_default();
            json!({ "id": id, "name": format!("user{id}") })
        }
        "greeting" => json!(format!(
            "Hello, {}!",
            input["fetch_user"]["name"].as_str().unwrap_or("?")
        )),
        "shout" => json!(input["greeting"]
            .as_str()
            .unwrap_or_default()
            .to_uppercase()),
        other => panic!("unknown step {other}"),
    }
}

async fn run_status(pool: &PgPool, run_id: Uuid) -> Result<String, sqlx::Error> {
    sqlx::query_scalar("select status from pgflow.runs where run_id = $1")
        .bind(run_id)
        .fetch_one(pool)
        .await
}
