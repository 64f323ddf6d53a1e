//! Schedules fired by several worker processes (`schedule_worker`): each declares the same schedule at
//! startup and fires due schedules every 100 ms; every fire time starts exactly one run, which they run.

use std::process::Stdio;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use tokio::process::{Child, Command};

use crate::support::LIMIT;

fn spawn(url: &str, args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_schedule_worker"))
        .args(args)
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

async fn stop(child: Child) {
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id().unwrap()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let output = tokio::time::timeout(LIMIT, child.wait_with_output())
        .await
        .expect("the worker stops in time after SIGTERM")
        .unwrap();
    assert!(
        output.status.success(),
        "exit {:?}: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
}

async fn fires(pool: &PgPool) -> Vec<(DateTime<Utc>, Option<uuid::Uuid>)> {
    sqlx::query_as("select fire_at, run_id from pgflow.schedule_fires where schedule_name = 'ticks' order by fire_at")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Two processes fire an every-2-seconds schedule for two minutes: one run per fire time, no fire time
/// missed between the first and the last, every run completed by one of them.
#[tokio::test]
async fn two_worker_processes_firing_one_schedule_for_two_minutes_start_one_run_per_fire_time() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let cron = "*/2 * * * * *";
    let a = spawn(db.url(), &["ticks", cron]);
    let b = spawn(db.url(), &["ticks", cron]);

    // Both processes run from their first fire; the test counts from the first fire time onwards.
    pgflow_tests::wait_until(LIMIT, "the first scheduled run", || async {
        !fires(pool).await.is_empty()
    })
    .await;
    let first = fires(pool).await[0].0;
    pgflow_tests::wait_until(Duration::from_secs(180), "two minutes of fires", || async {
        fires(pool)
            .await
            .last()
            .is_some_and(|(t, _)| *t >= first + chrono::Duration::seconds(120))
    })
    .await;
    stop(a).await;
    stop(b).await;

    let fires = fires(pool).await;
    assert!(fires.len() >= 61, "{} fires", fires.len());
    for pair in fires.windows(2) {
        assert_eq!(
            pair[1].0 - pair[0].0,
            chrono::Duration::seconds(2),
            "a fire time missed: {pair:?}"
        );
    }
    let runs: Vec<(uuid::Uuid, String, serde_json::Value)> = sqlx::query_as(
        "select run_id, status, input from pgflow.runs where flow_slug = 'scheduledTicks'",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(runs.len(), fires.len(), "one run per fire time, no more");
    let ids: std::collections::HashSet<_> = fires.iter().map(|f| f.1.expect("started")).collect();
    assert_eq!(ids.len(), fires.len());
    for (run_id, status, input) in &runs {
        assert!(ids.contains(run_id));
        assert_eq!(input, &serde_json::json!(7));
        // The last fires may still be running when the workers stop (handed back, queued again).
        assert!(
            ["completed", "started"].contains(&status.as_str()),
            "{status}"
        );
    }
    let completed = runs.iter().filter(|r| r.1 == "completed").count();
    assert!(
        completed + 2 >= runs.len(),
        "{completed} of {} completed",
        runs.len()
    );
}
