//! A worker's maintenance prunes finished history older than its retention, and `retention(None)` keeps it.

use std::time::Duration;

use pgflow_runtime::{flow, Client, StepError, Worker};
use sqlx::PgPool;
use uuid::Uuid;

use crate::support::{self, LIMIT};

#[flow(slug = "keptFlow", input = i64)]
mod kept {
    use super::*;

    #[step]
    async fn echo(n: i64) -> Result<i64, StepError> {
        Ok(n)
    }
}

/// Completes one run, then moves its finish an hour back, past any retention the tests set.
async fn an_hour_old_finished_run(pool: &PgPool) -> Uuid {
    let run = Client::new(pool.clone())
        .start::<kept::Kept>(&7)
        .await
        .unwrap();
    assert_eq!(run.wait(LIMIT).await.unwrap().echo, 7);
    sqlx::query(
        "update pgflow.runs set started_at = now() - interval '2 hours', completed_at = now() - interval '1 hour' where run_id = $1",
    )
    .bind(run.run_id())
    .execute(pool)
    .await
    .unwrap();
    run.run_id()
}

async fn run_exists(pool: &PgPool, run_id: Uuid) -> bool {
    sqlx::query_scalar("select exists (select 1 from pgflow.runs where run_id = $1)")
        .bind(run_id)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A worker row whose heartbeat stopped 20 s ago (past the dead-worker threshold, within the 60 s retention,
/// so retention does not delete it): the next maintenance sweep marks it stopped, which
/// shows that a sweep ran.
async fn plant_silent_worker(pool: &PgPool) -> Uuid {
    let id = Uuid::new_v4();
    sqlx::query(
        "insert into pgflow.workers (worker_id, queue_name, function_name, last_heartbeat_at) \
         values ($1, 'keptflow', 'keptflow', now() - interval '20 seconds')",
    )
    .bind(id)
    .execute(pool)
    .await
    .unwrap();
    id
}

#[tokio::test]
async fn a_worker_prunes_finished_history_older_than_its_retention() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn_with(
        support::fast(Worker::<kept::Kept>::builder(pool.clone()))
            .retention(Some(Duration::from_secs(60))),
    )
    .await;
    let old = an_hour_old_finished_run(pool).await;
    pgflow_tests::wait_until(
        LIMIT,
        "the worker's maintenance to prune the old run",
        || async { !run_exists(pool, old).await },
    )
    .await;
    let tasks: i64 = sqlx::query_scalar("select count(*) from pgflow.step_tasks where run_id = $1")
        .bind(old)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(tasks, 0, "the run's tasks go with it");

    // A run that finished within the retention stays.
    let recent = Client::new(pool.clone())
        .start::<kept::Kept>(&8)
        .await
        .unwrap();
    recent.wait(LIMIT).await.unwrap();
    let silent = plant_silent_worker(pool).await;
    pgflow_tests::wait_until(LIMIT, "a maintenance sweep", || async {
        worker_stopped(pool, silent).await
    })
    .await;
    assert!(run_exists(pool, recent.run_id()).await);
    worker.stop().await;
}

#[tokio::test]
async fn a_worker_without_retention_keeps_finished_history() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn_with(
        support::fast(Worker::<kept::Kept>::builder(pool.clone())).retention(None),
    )
    .await;
    let old = an_hour_old_finished_run(pool).await;
    // Two sweeps after the run was backdated: each marks a planted silent worker stopped.
    for _ in 0..2 {
        let silent = plant_silent_worker(pool).await;
        pgflow_tests::wait_until(LIMIT, "a maintenance sweep", || async {
            worker_stopped(pool, silent).await
        })
        .await;
    }
    assert!(run_exists(pool, old).await, "retention(None) keeps history");
    worker.stop().await;
}

/// A sweep whose retention batch comes back full runs the next batch at once, not an interval later: seven
/// old runs, batches of two and an hour between sweeps, and the startup sweep alone prunes them all.
#[tokio::test]
async fn a_sweep_repeats_full_retention_batches_until_the_old_history_is_gone() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let first = support::spawn_with(
        support::fast(Worker::<kept::Kept>::builder(pool.clone())).retention(None),
    )
    .await;
    let mut old = Vec::new();
    for _ in 0..7 {
        old.push(an_hour_old_finished_run(pool).await);
    }
    first.stop().await;

    let worker = support::spawn_with(
        support::fast(Worker::<kept::Kept>::builder(pool.clone()))
            .retention(Some(Duration::from_secs(60)))
            .retention_batch(2)
            .maintenance_interval(Some(Duration::from_secs(3600))),
    )
    .await;
    pgflow_tests::wait_until(
        LIMIT,
        "the startup sweep to prune all seven old runs, two at a time",
        || async {
            let left: i64 =
                sqlx::query_scalar("select count(*) from pgflow.runs where run_id = any ($1)")
                    .bind(&old)
                    .fetch_one(pool)
                    .await
                    .unwrap();
            left == 0
        },
    )
    .await;
    worker.stop().await;
}

async fn worker_stopped(pool: &PgPool, id: Uuid) -> bool {
    sqlx::query_scalar("select stopped_at is not null from pgflow.workers where worker_id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}
