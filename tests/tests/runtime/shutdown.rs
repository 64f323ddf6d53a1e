//! Shutdown, deprecation, the worker-function fence, and a worker killed mid-task.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use pgflow_runtime::{
    flow, worker::StopReason, worker::WorkerError, Client, StepContext, StepError, Worker,
};
use pgflow_tests::crash_flow::CrashFlow;
use sqlx::Connection;
use tokio::sync::Semaphore;
use uuid::Uuid;

use crate::support::{self, LIMIT};

/// Closed until the test opens it: a blocked handler waits on it (or on its cancellation).
static GATE: Semaphore = Semaphore::const_new(0);

/// How many `nap` handlers have started (each test runs in a process of its own).
static NAPS_STARTED: AtomicUsize = AtomicUsize::new(0);

#[flow(slug = "sleepyFlow", input = u64)]
mod sleepy {
    use super::*;

    /// Sleeps `ms` milliseconds; `u64::MAX` blocks until `GATE` opens (or the handler is cancelled).
    #[step]
    async fn nap(ms: u64, ctx: &StepContext<Sleepy>) -> Result<u64, StepError> {
        NAPS_STARTED.fetch_add(1, Ordering::SeqCst);
        if ms == u64::MAX {
            return tokio::select! {
                _ = ctx.cancellation().cancelled() => Err(StepError::msg("cancelled")),
                _ = GATE.acquire() => Ok(0),
            };
        }
        tokio::time::sleep(Duration::from_millis(ms)).await;
        Ok(ms)
    }
}

async fn started_tasks(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("select count(*) from pgflow.step_tasks where status = 'started'")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A worker's last heartbeat and its deprecation time.
async fn heartbeat(
    pool: &sqlx::PgPool,
    id: Uuid,
) -> (
    chrono::DateTime<chrono::Utc>,
    Option<chrono::DateTime<chrono::Utc>>,
) {
    sqlx::query_as(
        "select last_heartbeat_at, deprecated_at from pgflow.workers where worker_id = $1",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn worker_stopped(pool: &sqlx::PgPool, id: Uuid) -> bool {
    sqlx::query_scalar("select stopped_at is not null from pgflow.workers where worker_id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn graceful_shutdown_finishes_in_flight_tasks_and_leaves_nothing_started() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn::<sleepy::Sleepy>(pool).await;
    let client = Client::new(pool.clone());
    let mut runs = Vec::new();
    for _ in 0..4 {
        runs.push(client.start::<sleepy::Sleepy>(&400).await.unwrap());
    }
    // Claimed in the database is not yet running: a claim whose result the worker has not read when it stops
    // is handed back. Wait for the four handlers themselves.
    pgflow_tests::wait_until(LIMIT, "four tasks in flight", || async {
        started_tasks(pool).await == 4 && NAPS_STARTED.load(Ordering::SeqCst) == 4
    })
    .await;
    let report = worker.stop().await;
    assert_eq!(report.stop_reason, StopReason::Shutdown);
    assert_eq!((report.completed, report.released), (4, 0));
    assert_eq!(started_tasks(pool).await, 0);
    for run in runs {
        assert_eq!(support::run_status(pool, run.run_id()).await, "completed");
    }
    assert!(worker_stopped(pool, report.worker_id).await);
}

#[tokio::test]
async fn tasks_that_outlast_the_grace_are_handed_back_at_once_without_using_an_attempt() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn_with(
        support::fast(Worker::<sleepy::Sleepy>::builder(pool.clone()))
            .shutdown_grace(Duration::from_millis(200)),
    )
    .await;
    let client = Client::new(pool.clone());
    let run = client.start::<sleepy::Sleepy>(&u64::MAX).await.unwrap();
    pgflow_tests::wait_until(LIMIT, "the task to start", || async {
        started_tasks(pool).await == 1
    })
    .await;
    let report = worker.stop().await;
    assert_eq!(report.released, 1);
    assert_eq!(report.failed, 0);
    let (status, attempts, _) = support::task(pool, run.run_id(), "nap", 0).await;
    assert_eq!((status.as_str(), attempts), ("queued", 0));
    let visible: bool = sqlx::query_scalar("select vt <= clock_timestamp() from pgmq.q_sleepyflow")
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(visible, "the handed-back message is visible at once");

    GATE.add_permits(Semaphore::MAX_PERMITS);
    let second = support::spawn::<sleepy::Sleepy>(pool).await;
    // Far below the stall timeout (60 s + 30 s): no recovery was needed.
    assert_eq!(run.wait(Duration::from_secs(10)).await.unwrap().nap, 0);
    second.stop().await;
}

#[tokio::test]
async fn a_deprecated_worker_stops_claiming_drains_and_exits() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn::<sleepy::Sleepy>(pool).await;
    let client = Client::new(pool.clone());
    let run = client.start::<sleepy::Sleepy>(&3000).await.unwrap();
    pgflow_tests::wait_until(LIMIT, "the task to start", || async {
        started_tasks(pool).await == 1
    })
    .await;
    sqlx::query("update pgflow.workers set deprecated_at = now()")
        .execute(pool)
        .await
        .unwrap();
    // Work started after deprecation stays queued while the worker still runs: checked before it exits,
    // across two of its heartbeats (every 100 ms; it polls every 10 to 50 ms), while its first task naps.
    let worker_id = worker.id();
    let deprecated_at = heartbeat(pool, worker_id).await.1.expect("deprecated");
    pgflow_tests::wait_until(LIMIT, "a heartbeat that sees the deprecation", || async {
        heartbeat(pool, worker_id).await.0 > deprecated_at
    })
    .await;
    let later = client.start::<sleepy::Sleepy>(&1).await.unwrap();
    for _ in 0..2 {
        let seen = heartbeat(pool, worker_id).await.0;
        pgflow_tests::wait_until(LIMIT, "the worker's next heartbeat", || async {
            heartbeat(pool, worker_id).await.0 > seen
        })
        .await;
    }
    assert_eq!(
        started_tasks(pool).await,
        1,
        "the first task is still running"
    );
    assert_eq!(
        support::task(pool, later.run_id(), "nap", 0).await.0,
        "queued"
    );
    let report = worker.join().await;
    assert_eq!(report.stop_reason, StopReason::Deprecated);
    assert_eq!(report.completed, 1);
    assert_eq!(support::run_status(pool, run.run_id()).await, "completed");
    assert_eq!(
        support::task(pool, later.run_id(), "nap", 0).await.0,
        "queued"
    );
}

#[tokio::test]
async fn a_disabled_worker_function_refuses_to_start_and_stops_running_workers() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn::<sleepy::Sleepy>(pool).await;
    support::wait_for_workers(pool, 1).await;
    sqlx::query(
        "update pgflow.worker_functions set enabled = false where function_name = 'sleepyflow'",
    )
    .execute(pool)
    .await
    .unwrap();
    let report = worker.join().await;
    assert_eq!(report.stop_reason, StopReason::Disabled);

    let client = Client::new(pool.clone());
    let run = client.start::<sleepy::Sleepy>(&1).await.unwrap();
    let err = support::fast(Worker::<sleepy::Sleepy>::builder(pool.clone()))
        .run(tokio_util::sync::CancellationToken::new())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, WorkerError::FunctionDisabled { function_name, .. } if function_name == "sleepyflow"),
        "{err}"
    );
    assert_eq!(
        support::task(pool, run.run_id(), "nap", 0).await.0,
        "queued"
    );
}

#[tokio::test]
async fn a_worker_killed_mid_task_has_its_task_recovered_and_the_run_completes() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_crashy_worker"))
        .arg(db.url())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn crashy_worker");
    support::wait_for_workers(pool, 1).await;
    let client = Client::new(pool.clone());
    let run = client.start::<CrashFlow>(&21).await.unwrap();
    pgflow_tests::wait_until(LIMIT, "the child to claim the task", || async {
        support::task(pool, run.run_id(), "work", 0).await.0 == "started"
    })
    .await;
    let dead_worker: Uuid = sqlx::query_scalar(
        "select last_worker_id from pgflow.step_tasks where run_id = $1 and step_slug = 'work'",
    )
    .bind(run.run_id())
    .fetch_one(pool)
    .await
    .unwrap();
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id().unwrap()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).unwrap();
    let status = child.wait().await.unwrap();
    assert!(!status.success());
    assert_eq!(
        support::task(pool, run.run_id(), "work", 0).await.0,
        "started"
    );

    // The child's heartbeat stops; this worker's maintenance finds it dead after `dead_worker_timeout` (1 s in
    // the test settings) and requeues its task at once. Stalled-task recovery cannot do it within the wait: the
    // step timeout is 10 minutes. Only the dead-worker sweep marks the silent worker stopped.
    let rescuer = support::spawn::<CrashFlow>(pool).await;
    let out = run
        .wait(LIMIT)
        .await
        .expect("the dead worker's task is recovered by the dead-worker sweep, not the 10-minute step timeout");
    assert_eq!(out.work, 42);
    assert!(
        worker_stopped(pool, dead_worker).await,
        "the dead-worker sweep marks the killed worker stopped"
    );
    let requeued: i32 =
        sqlx::query_scalar("select requeued_count from pgflow.step_tasks where run_id = $1")
            .bind(run.run_id())
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(requeued, 1);
    rescuer.stop().await;
}

#[tokio::test]
async fn a_worker_recovers_without_help_after_all_its_database_connections_are_killed() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn::<sleepy::Sleepy>(pool).await;
    let client = Client::new(pool.clone());
    let before = client.start::<sleepy::Sleepy>(&1).await.unwrap();
    before.wait(LIMIT).await.unwrap();

    // As a database restart would: every other session of this database is terminated.
    let mut admin = sqlx::PgConnection::connect_with(&db.options())
        .await
        .unwrap();
    let killed: i64 = sqlx::query_scalar(
        "select count(*) from (select pg_terminate_backend(pid) from pg_stat_activity \
         where datname = current_database() and pid <> pg_backend_pid()) k",
    )
    .fetch_one(&mut admin)
    .await
    .unwrap();
    assert!(killed > 0);

    let after = client.start::<sleepy::Sleepy>(&2).await.unwrap();
    assert_eq!(after.wait(LIMIT).await.unwrap().nap, 2);
    let report = worker.stop().await;
    assert_eq!(report.completed, 2);
}
