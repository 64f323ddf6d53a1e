//! Concurrent workers: many runs drained by several workers that complete, retry and exhaust tasks at
//! the same time. Every run must end, without deadlocks, and terminal runs keep no active task.

use std::time::{Duration, Instant};

use crate::support::*;
use pgflow_tests::test_db;
use serde_json::json;
use sqlx::PgPool;

/// One worker: read a few messages, claim them, then complete or fail each task (fails are decided by the
/// message id, so a failing task keeps failing until it is exhausted).
async fn work(pool: PgPool, deadline: Instant) -> usize {
    let mut handled = 0;
    while Instant::now() < deadline {
        let ids: Vec<i64> = sqlx::query_scalar("select msg_id from pgmq.read('stress', 30, 4)")
            .fetch_all(&pool)
            .await
            .expect("read");
        if ids.is_empty() {
            let open: i64 =
                sqlx::query_scalar("select count(*) from pgflow.runs where status = 'started'")
                    .fetch_one(&pool)
                    .await
                    .expect("open runs");
            if open == 0 {
                break;
            }
            tokio::task::yield_now().await;
            continue;
        }
        let tasks: Vec<Task> = sqlx::query_as("select * from pgflow.start_tasks('stress', $1, $2)")
            .bind(&ids)
            .bind(WORKER)
            .fetch_all(&pool)
            .await
            .expect("start_tasks");
        for task in tasks {
            let sql = if task.msg_id % 5 == 0 {
                "select status from pgflow.fail_task($1, $2, $3, 'unlucky')"
            } else {
                "select status from pgflow.complete_task($1, $2, $3, $4)"
            };
            let output = if task.step_slug == "a" {
                json!([1, 2, 3])
            } else {
                json!(task.task_index)
            };
            sqlx::query(sql)
                .bind(task.run_id)
                .bind(&task.step_slug)
                .bind(task.task_index)
                .bind(output)
                .execute(&pool)
                .await
                .unwrap_or_else(|e| {
                    panic!("{sql} for {}/{}: {e}", task.step_slug, task.task_index)
                });
            handled += 1;
        }
    }
    handled
}

#[tokio::test]
async fn concurrent_workers_drain_every_run_to_a_terminal_state_without_leaving_active_tasks() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('stress', max_attempts => 3, base_delay => 0);
         select pgflow.add_step('stress', 'a');
         select pgflow.add_step('stress', 'm', array['a'], step_type => 'map', when_exhausted => 'skip');
         select pgflow.add_step('stress', 'c', array['a'], when_exhausted => 'skip-cascade');
         select pgflow.add_step('stress', 'd', array['m', 'c']);
         select pgflow.add_step('stress', 'e', array['a']);",
    )
    .await;
    register_worker(pool).await;
    for _ in 0..60 {
        start(pool, "stress", json!({})).await;
    }

    let deadline = Instant::now() + Duration::from_secs(90);
    let workers: Vec<_> = (0..4)
        .map(|_| tokio::spawn(work(pool.clone(), deadline)))
        .collect();
    let mut handled = 0;
    for worker in workers {
        handled += worker.await.expect("worker panicked");
    }
    assert!(handled > 0);

    let open: i64 = sqlx::query_scalar("select count(*) from pgflow.runs where status = 'started'")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(open, 0, "every run ended");
    let active: i64 = sqlx::query_scalar(
        "select count(*) from pgflow.step_tasks where status in ('queued', 'started')",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(active, 0, "terminal runs keep no queued or started task");
    let unfinished_steps: i64 = sqlx::query_scalar(
        "select count(*) from pgflow.step_states ss join pgflow.runs r using (run_id)
          where r.status = 'completed' and ss.status not in ('completed', 'skipped')",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        unfinished_steps, 0,
        "completed runs have only completed or skipped steps"
    );
    assert_eq!(
        live_messages(pool, "stress").await,
        0,
        "no message is left behind"
    );
}

/// Every task of one map run completed at the same moment from its own connection: the step must still
/// complete exactly once and the run must finish. (A completion that waited for the run lock used to
/// decide "last task or not" from the step's task count as it was before the wait, so the last
/// completion only decremented and the run never finished.)
#[tokio::test]
async fn concurrent_completions_of_one_map_step_complete_the_step_and_the_run() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('fanout'); select pgflow.add_step('fanout', 'each', step_type => 'map');",
    )
    .await;
    for round in 0..5 {
        let elements: Vec<i32> = (0..10).collect();
        let run = start(pool, "fanout", json!(elements)).await;
        let tasks = claim(pool, "fanout", "fanout", 10).await;
        assert_eq!(
            tasks.len(),
            10,
            "round {round}: all ten map tasks are claimed"
        );
        let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(tasks.len()));
        let completions = tasks.into_iter().map(|task| {
            let pool = pool.clone();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                let mut conn = pool.acquire().await.expect("a connection per completion");
                barrier.wait().await;
                sqlx::query("select pgflow.complete_task($1, $2, $3, $4)")
                    .bind(task.run_id)
                    .bind(&task.step_slug)
                    .bind(task.task_index)
                    .bind(json!(task.task_index * 10))
                    .execute(&mut *conn)
                    .await
                    .expect("complete_task");
            })
        });
        for completion in futures::future::join_all(completions).await {
            completion.unwrap();
        }
        assert_eq!(
            step_status(pool, run, "each").await,
            "completed",
            "round {round}"
        );
        assert_eq!(run_status(pool, run).await, "completed", "round {round}");
        assert_eq!(
            run_output(pool, run).await,
            Some(json!({"each": [0, 10, 20, 30, 40, 50, 60, 70, 80, 90]})),
            "round {round}"
        );
    }
}

/// A claim whose transaction began before the task was queued (its `now()` is older than the task's
/// `queued_at`) still claims the task, with `started_at` no earlier than `queued_at`.
#[tokio::test]
async fn a_claim_in_a_transaction_older_than_the_task_still_claims_it() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('late'); select pgflow.add_step('late', 'only');",
    )
    .await;
    register_worker(pool).await;

    let mut claimer = pool.begin().await.unwrap();
    let began: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("select now()")
        .fetch_one(&mut *claimer)
        .await
        .unwrap();
    let run = start(pool, "late", json!({})).await;
    let ids: Vec<i64> = sqlx::query_scalar("select msg_id from pgmq.read('late', 30, 1)")
        .fetch_all(&mut *claimer)
        .await
        .unwrap();
    let claimed: Vec<String> = sqlx::query_scalar(
        "select step_slug from pgflow.start_tasks(flow_slug => 'late', msg_ids => $1, worker_id => $2)",
    )
    .bind(&ids)
    .bind(WORKER)
    .fetch_all(&mut *claimer)
    .await
    .expect("the claim succeeds although its transaction is older than the task");
    claimer.commit().await.unwrap();
    assert_eq!(claimed, ["only"]);

    let (queued_at, started_at): (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) =
        sqlx::query_as("select queued_at, started_at from pgflow.step_tasks where run_id = $1")
            .bind(run)
            .fetch_one(pool)
            .await
            .unwrap();
    assert!(
        queued_at > began,
        "the task was queued after the claim's transaction began"
    );
    assert_eq!(started_at, queued_at);
}
