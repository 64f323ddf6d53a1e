//! Zero configuration: a step worker and a queue worker that need nothing but `DATABASE_URL`, run in a child
//! process (`zero_config_worker`) so the variable is the child's alone, stopped with SIGTERM.

use std::process::Stdio;

use pgflow_runtime::Client;
use pgflow_tests::deployed::{CommunityV2, Thread, ALIAS};
use serde_json::json;
use sqlx::PgPool;
use tokio::process::{Child, Command};

use crate::support::{self, LIMIT};

fn worker(kind: &str) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_zero_config_worker"));
    command
        .arg(kind)
        .env_remove("DATABASE_URL")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    command
}

async fn wait_registered(pool: &PgPool, queue: &str) {
    pgflow_tests::wait_until(LIMIT, "the zero-configuration worker to register", || async {
        sqlx::query_scalar::<_, bool>(
            "select exists (select 1 from pgflow.workers where queue_name = $1 and stopped_at is null)",
        )
        .bind(queue)
        .fetch_one(pool)
        .await
        .unwrap()
    })
    .await;
}

/// Sends SIGTERM and returns the child's stdout after a clean exit.
async fn terminate(child: Child) -> String {
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id().unwrap()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let output = tokio::time::timeout(LIMIT, child.wait_with_output())
        .await
        .expect("the worker stops in time after SIGTERM")
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "exit {:?}: {stdout} {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[tokio::test]
async fn a_step_worker_and_a_queue_worker_run_with_only_database_url_until_sigterm() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();

    let step = worker("step")
        .env("DATABASE_URL", db.url())
        .spawn()
        .unwrap();
    wait_registered(pool, "zeroconfigsteps__double").await;
    let run = pgflow_tests::state::start(pool, "zeroConfigSteps", json!(21)).await;
    assert_eq!(support::wait_finished(pool, run).await, "completed");
    assert_eq!(
        support::run_output(pool, run).await,
        Some(json!({"double": 42}))
    );
    let stdout = terminate(step).await;
    assert!(
        stdout.contains("stopped: Shutdown, completed 1"),
        "{stdout}"
    );

    let queue = worker("queue")
        .env("DATABASE_URL", db.url())
        .spawn()
        .unwrap();
    wait_registered(pool, "classify_threads").await;
    assert_eq!(
        support::alias_target(pool, ALIAS).await.as_deref(),
        Some("communityThreadsV2")
    );
    let run = Client::new(pool.clone())
        .start_deployed::<CommunityV2>(&Thread {
            text: "help?".into(),
        })
        .await
        .unwrap();
    pgflow_tests::wait_until(LIMIT, "classify to complete", || async {
        support::step_status(pool, run.run_id(), "classify").await == "completed"
    })
    .await;
    let stdout = terminate(queue).await;
    assert!(
        stdout.contains("stopped: Shutdown, completed 1"),
        "{stdout}"
    );
    let stopped: i64 =
        sqlx::query_scalar("select count(*) from pgflow.workers where stopped_at is null")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(stopped, 0, "both workers marked themselves stopped");
}

#[tokio::test]
async fn a_zero_configuration_worker_without_a_usable_database_url_fails_naming_the_variable() {
    for (kind, url, expected) in [
        ("step", None, "`DATABASE_URL` is not set"),
        (
            "queue",
            Some("mysql://app:hunter2@db.internal/app"),
            "`DATABASE_URL` is not a valid PostgreSQL URL",
        ),
    ] {
        let mut command = worker(kind);
        if let Some(url) = url {
            command.env("DATABASE_URL", url);
        }
        let output = tokio::time::timeout(LIMIT, command.output())
            .await
            .expect("the worker exits in time")
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains(expected), "{stderr}");
        assert!(
            !stderr.contains("hunter2"),
            "the URL is not repeated: {stderr}"
        );
    }
}
