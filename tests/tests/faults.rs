//! Fault tests with real parts: worker processes killed with SIGKILL under load, PostgreSQL restarted in the
//! middle of a load, and a worker's connections killed while it records results. Every run must complete
//! with the right output, and no task may run more often than its max_attempts.

use std::time::{Duration, Instant};

use pgflow_runtime::{worker::WorkerConfig, Worker};
use pgflow_sql::throwaway::{Durability, TempPostgres};
use pgflow_tests::mixed_flow::MixedFlow;
use pgflow_tests::{expected_total, test_db, wait_until};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Each fault test must finish well within a minute.
const BUDGET: Duration = Duration::from_secs(50);

/// Starts `count` runs of `mixedFlow` with inputs 0..count in one statement (so the load is all there at
/// once); returns (run id, input) pairs.
async fn start_runs(pool: &PgPool, count: u32) -> Vec<(Uuid, u32)> {
    let rows: Vec<(Uuid, i32)> = sqlx::query_as(
        "select (pgflow.start_flow('mixedFlow', to_jsonb(n))).run_id, n
         from generate_series(0, $1 - 1) as n",
    )
    .bind(i32::try_from(count).unwrap())
    .fetch_all(pool)
    .await
    .unwrap();
    rows.into_iter()
        .map(|(run, n)| (run, u32::try_from(n).unwrap()))
        .collect()
}

/// Waits until no run is `started`, then checks every run completed with the right total and that no task
/// was attempted more often than the flow allows.
async fn assert_all_completed(pool: &PgPool, runs: &[(Uuid, u32)], limit: Duration) {
    wait_until(limit, "every run to finish", || async {
        sqlx::query_scalar::<_, i64>("select count(*) from pgflow.runs where status = 'started'")
            .fetch_one(pool)
            .await
            .map(|n| n == 0)
            .unwrap_or(false)
    })
    .await;
    for (run, n) in runs {
        let (status, total, error): (String, Option<i64>, Option<String>) = sqlx::query_as(
            "select r.status, (r.output ->> 'total')::bigint,
                    (select string_agg(ss.step_slug || ': ' || ss.error_message, '; ')
                     from pgflow.step_states ss where ss.run_id = r.run_id and ss.status = 'failed')
             from pgflow.runs r where r.run_id = $1",
        )
        .bind(run)
        .fetch_one(pool)
        .await
        .unwrap();
        assert_eq!(status, "completed", "run {run} (input {n}): {error:?}");
        assert_eq!(
            total,
            Some(i64::from(expected_total(*n))),
            "run {run} (input {n})"
        );
    }
    let over: i64 = sqlx::query_scalar(
        "select count(*) from pgflow.step_tasks t join pgflow.flows f on f.flow_slug = t.flow_slug
         where t.attempts_count > f.opt_max_attempts",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(over, 0, "no task may exceed its max_attempts");
}

fn fast(config: WorkerConfig) -> WorkerConfig {
    let mut c = config;
    c.max_concurrent = 8;
    c.poll_interval = Duration::from_millis(10);
    c.max_poll_wait = Duration::from_millis(50);
    c.heartbeat_interval = Duration::from_millis(100);
    c.dead_worker_timeout = Some(Duration::from_millis(600));
    c.maintenance_interval = Some(Duration::from_millis(200));
    c.poll_error_backoff_max = Duration::from_millis(300);
    c.shutdown_grace = Duration::from_secs(5);
    c
}

fn spawn_child(url: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_fault_worker"))
        .arg(url)
        .kill_on_drop(true)
        .spawn()
        .expect("spawn fault_worker")
}

fn sigkill(child: &Child) {
    if let Some(pid) = child.id() {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap());
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_processes_killed_again_and_again_under_load_lose_no_run() {
    let db = test_db().await;
    let pool = db.pool();
    let started = Instant::now();
    let mut children: Vec<Child> = (0..3).map(|_| spawn_child(db.url())).collect();
    wait_until(BUDGET, "the workers to register", || async {
        sqlx::query_scalar::<_, i64>("select count(*) from pgflow.workers where stopped_at is null")
            .fetch_one(pool)
            .await
            .unwrap()
            >= 3
    })
    .await;
    let runs = start_runs(pool, 500).await;

    // Kill one of the three workers with SIGKILL every 400 ms (each lives about 1.2 s) and start a
    // replacement, until the load has drained. A kill waits for some task to complete since the last one:
    // on a loaded machine a new worker can need longer than that to start, and a dead worker's attempt
    // counts (a task that kills its workers must not run forever), so kills that outpace every handler
    // would exhaust a task's attempts without saying anything about recovery.
    let completed = || async {
        sqlx::query_scalar::<_, i64>(
            "select count(*) from pgflow.step_tasks where status = 'completed'",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    };
    let mut kills = 0;
    let mut victim = 0;
    let mut every = tokio::time::interval(Duration::from_millis(400));
    every.tick().await;
    let mut done_at_last_kill = completed().await;
    loop {
        let open: i64 =
            sqlx::query_scalar("select count(*) from pgflow.runs where status = 'started'")
                .fetch_one(pool)
                .await
                .unwrap();
        if open == 0 || started.elapsed() > BUDGET {
            break;
        }
        every.tick().await;
        wait_until(BUDGET, "a task to complete since the last kill", || async {
            completed().await > done_at_last_kill
        })
        .await;
        done_at_last_kill = completed().await;
        sigkill(&children[victim]);
        let _ = children[victim].wait().await;
        children[victim] = spawn_child(db.url());
        kills += 1;
        victim = (victim + 1) % children.len();
    }
    assert!(kills >= 3, "the load must see several kills, saw {kills}");
    assert_all_completed(pool, &runs, BUDGET.saturating_sub(started.elapsed())).await;
    let recovered: i64 =
        sqlx::query_scalar("select coalesce(sum(requeued_count), 0) from pgflow.step_tasks")
            .fetch_one(pool)
            .await
            .unwrap();
    eprintln!(
        "{kills} kills, {recovered} task recoveries, {:?}",
        started.elapsed()
    );
    for child in &mut children {
        sigkill(child);
        let _ = child.wait().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_reconnect_by_themselves_after_postgresql_restarts_mid_load() {
    let started = Instant::now();
    let server = TempPostgres::start(Durability::Fast).await.unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(10)
        .connect(&server.url("postgres"))
        .await
        .unwrap();
    pgflow_sql::install(&pool).await.unwrap();
    let mut workers = Vec::new();
    for _ in 0..2 {
        let worker = Worker::<MixedFlow>::builder(pool.clone())
            .config(fast(WorkerConfig::default()))
            .build()
            .unwrap()
            .spawn(CancellationToken::new())
            .await
            .unwrap();
        workers.push(worker);
    }
    let runs = start_runs(&pool, 200).await;
    wait_until(BUDGET, "some runs to complete", || async {
        sqlx::query_scalar::<_, i64>("select count(*) from pgflow.runs where status = 'completed'")
            .fetch_one(&pool)
            .await
            .map(|n| n >= 20)
            .unwrap_or(false)
    })
    .await;

    server.restart().await.unwrap();

    assert_all_completed(&pool, &runs, BUDGET.saturating_sub(started.elapsed())).await;
    for worker in workers {
        let report = worker.stop().await.unwrap();
        assert!(report.completed > 0);
    }
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_workers_connections_while_it_records_loses_nothing() {
    let db = test_db().await;
    let pool = db.pool();
    let started = Instant::now();
    let victim_pool = PgPoolOptions::new()
        .max_connections(6)
        .connect_with(db.options().application_name("pgflow-fault-victim"))
        .await
        .unwrap();
    let worker = Worker::<MixedFlow>::builder(victim_pool.clone())
        .config(fast(WorkerConfig::default()))
        .build()
        .unwrap()
        .spawn(CancellationToken::new())
        .await
        .unwrap();
    let runs = start_runs(pool, 300).await;

    // Terminate every connection of the worker every 150 ms while it claims and records, for as long as
    // the load lasts (at least ten times, at most ten seconds; the worker then finishes undisturbed).
    let mut kills = 0;
    let mut rounds = 0;
    let mut every = tokio::time::interval(Duration::from_millis(150));
    loop {
        every.tick().await;
        let open: i64 =
            sqlx::query_scalar("select count(*) from pgflow.runs where status = 'started'")
                .fetch_one(pool)
                .await
                .unwrap();
        if (open == 0 && rounds >= 10) || started.elapsed() > Duration::from_secs(10) {
            break;
        }
        let killed: i64 = sqlx::query_scalar(
            "select count(*) from (select pg_terminate_backend(pid) from pg_stat_activity
             where datname = current_database() and application_name = 'pgflow-fault-victim') k",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        kills += killed;
        rounds += 1;
    }
    assert!(kills > 0);
    assert_all_completed(pool, &runs, BUDGET.saturating_sub(started.elapsed())).await;
    let report = worker.stop().await.unwrap();
    eprintln!(
        "{kills} connections killed; completed {}, stale {}",
        report.completed, report.stale
    );
    victim_pool.close().await;
}
