//! The hardening fixes a-f: truthful terminal task states, effective timeouts, claim visibility and
//! exclusivity, and conditions after empty maps.

use std::time::Duration;

use crate::support::*;
use pgflow_tests::{test_db, wait_until};
use serde_json::json;

// a. Skip paths terminalize their task rows.
#[tokio::test]
async fn skipped_step_moves_its_queued_and_started_tasks_to_skipped_and_the_run_keeps_none_active()
{
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('skipmap', max_attempts => 1);
         select pgflow.add_step('skipmap', 'each', step_type => 'map', when_exhausted => 'skip');",
    )
    .await;
    let run = start(pool, "skipmap", json!([1, 2, 3])).await;
    claim(pool, "skipmap", "skipmap", 2).await;
    fail(pool, run, "each", 0, "boom").await;

    assert_eq!(
        task_statuses(pool, run, "each").await,
        ["failed", "skipped", "skipped"]
    );
    assert_eq!(run_status(pool, run).await, "completed");
    assert_eq!(active_tasks(pool, run).await, 0);
    assert_eq!(
        live_messages(pool, "skipmap").await,
        0,
        "sibling messages are archived"
    );
}

// b. Failed runs cancel their unfinished tasks.
#[tokio::test]
async fn failed_run_cancels_queued_and_started_sibling_tasks_and_archives_their_messages() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('siblings', max_attempts => 1);
         select pgflow.add_step('siblings', 'a');
         select pgflow.add_step('siblings', 'b');
         select pgflow.add_step('siblings', 'c');",
    )
    .await;
    let run = start(pool, "siblings", json!({})).await;
    claim(pool, "siblings", "siblings", 2).await; // a and b started, c queued
    fail(pool, run, "a", 0, "boom").await;

    assert_eq!(run_status(pool, run).await, "failed");
    assert_eq!(task_statuses(pool, run, "a").await, ["failed"]);
    assert_eq!(task_statuses(pool, run, "b").await, ["cancelled"]);
    assert_eq!(task_statuses(pool, run, "c").await, ["cancelled"]);
    assert_eq!(active_tasks(pool, run).await, 0);
    assert_eq!(live_messages(pool, "siblings").await, 0);
}

#[tokio::test]
async fn late_complete_and_fail_for_cancelled_tasks_mutate_nothing() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('late', max_attempts => 1);
         select pgflow.add_step('late', 'a');
         select pgflow.add_step('late', 'b');
         select pgflow.add_step('late', 'c');",
    )
    .await;
    let run = start(pool, "late", json!({})).await;
    claim(pool, "late", "late", 3).await;
    fail(pool, run, "a", 0, "boom").await;

    let snapshot = "select string_agg(format('%s/%s/%s/%s/%s', step_slug, status, output, error_message, attempts_count), ',' order by step_slug)
                    from pgflow.step_tasks where run_id = $1";
    let before: String = sqlx::query_scalar(snapshot)
        .bind(run)
        .fetch_one(pool)
        .await
        .unwrap();
    let steps_before: String = sqlx::query_scalar(
        "select string_agg(step_slug || status, ',' order by step_slug) from pgflow.step_states where run_id = $1",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();

    assert_eq!(
        complete(pool, run, "b", 0, json!("late")).await,
        "cancelled"
    );
    assert_eq!(fail(pool, run, "c", 0, "late failure").await, "cancelled");

    let after: String = sqlx::query_scalar(snapshot)
        .bind(run)
        .fetch_one(pool)
        .await
        .unwrap();
    let steps_after: String = sqlx::query_scalar(
        "select string_agg(step_slug || status, ',' order by step_slug) from pgflow.step_states where run_id = $1",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(before, after);
    assert_eq!(steps_before, steps_after);
    assert_eq!(run_status(pool, run).await, "failed");
}

#[tokio::test]
async fn stalled_recovery_never_revives_tasks_of_failed_runs() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('nodead', max_attempts => 1, timeout => 1);
         select pgflow.add_step('nodead', 'a');
         select pgflow.add_step('nodead', 'b');",
    )
    .await;
    let run = start(pool, "nodead", json!({})).await;
    claim(pool, "nodead", "nodead", 2).await;
    // Simulate legacy data: a started task left behind on a failed run.
    exec(
        pool,
        &format!(
            "update pgflow.runs set status = 'failed', failed_at = now() where run_id = '{run}';
             update pgflow.step_tasks set started_at = now() - interval '1 hour', queued_at = now() - interval '2 hours'
              where run_id = '{run}';"
        ),
    )
    .await;
    let requeued: i32 = sqlx::query_scalar("select pgflow.requeue_stalled_tasks()")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(requeued, 0);
    assert_eq!(task_statuses(pool, run, "a").await, ["started"]);
}

// c. Stalled recovery uses the effective step timeout.
#[tokio::test]
async fn stalled_requeue_uses_the_step_timeout_rather_than_the_flow_timeout() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('timeouts', timeout => 5);
         select pgflow.add_step('timeouts', 'long', timeout => 600);
         select pgflow.add_step('timeouts', 'short');
         select pgflow.create_flow('slowflow', timeout => 600);
         select pgflow.add_step('slowflow', 'fast', timeout => 1);",
    )
    .await;
    let run = start(pool, "timeouts", json!({})).await;
    let fast_run = start(pool, "slowflow", json!({})).await;
    claim(pool, "timeouts", "timeouts", 2).await;
    claim(pool, "slowflow", "slowflow", 1).await;
    // Started 60 s ago: `long` is within 600 + 30, `short` is beyond 5 + 30, `fast` beyond 1 + 30.
    exec(
        pool,
        "update pgflow.step_tasks set queued_at = now() - interval '2 minutes', started_at = now() - interval '60 seconds'",
    )
    .await;
    let requeued: i32 = sqlx::query_scalar("select pgflow.requeue_stalled_tasks()")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(requeued, 2);
    assert_eq!(task_statuses(pool, run, "long").await, ["started"]);
    assert_eq!(task_statuses(pool, run, "short").await, ["queued"]);
    assert_eq!(task_statuses(pool, fast_run, "fast").await, ["queued"]);

    // A task started 20 s ago with a 1 s timeout is not stalled yet: the 30 s buffer applies.
    exec(pool, "update pgflow.step_tasks set status = 'started', started_at = now() - interval '20 seconds' where step_slug = 'fast'").await;
    let requeued: i32 = sqlx::query_scalar("select pgflow.requeue_stalled_tasks()")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(requeued, 0);
}

// d. Visibility is applied at claim time.
#[tokio::test]
async fn claim_extends_visibility_to_the_effective_step_timeout_plus_buffer() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('vis', timeout => 50);
         select pgflow.add_step('vis', 'inherit');
         select pgflow.add_step('vis', 'own', timeout => 300);",
    )
    .await;
    start(pool, "vis", json!({})).await;
    register_worker(pool).await;
    let ids: Vec<i64> =
        sqlx::query_scalar("select msg_id from pgmq.read('vis', 1, 10) order by msg_id")
            .fetch_all(pool)
            .await
            .unwrap();
    let tasks = start_tasks(pool, "vis", &ids).await;
    assert_eq!(tasks.len(), 2);
    // The claim sets the visibility only: the read count stays what pgmq.read made it.
    let read_counts: Vec<i32> = sqlx::query_scalar(
        "select read_ct from pgmq.q_vis where msg_id = any ($1) order by msg_id",
    )
    .bind(&ids)
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(read_counts, [1, 1]);
    for task in tasks {
        let secs = seconds_until_visible(pool, "vis", task.msg_id).await;
        let expected = if task.step_slug == "own" { 302.0 } else { 52.0 };
        assert!(
            (expected - 2.0..=expected).contains(&secs),
            "{}: {secs}",
            task.step_slug
        );
    }
}

#[tokio::test]
async fn claim_fails_as_a_whole_when_a_claimed_message_cannot_be_made_invisible() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('lost');
         select pgflow.add_step('lost', 'a');
         select pgflow.add_step('lost', 'b');",
    )
    .await;
    let run = start(pool, "lost", json!({})).await;
    register_worker(pool).await;
    let ids = read(pool, "lost", 10).await;
    exec(
        pool,
        &format!("select pgmq.delete('lost', {}::bigint)", ids[0]),
    )
    .await;

    let err = sqlx::query("select * from pgflow.start_tasks('lost', $1, $2)")
        .bind(&ids)
        .bind(WORKER)
        .execute(pool)
        .await
        .unwrap_err();
    let msg = err.as_database_error().unwrap().message().to_string();
    assert_eq!(
        msg,
        "start_tasks(): visibility updated 1 of 2 claimed messages"
    );
    assert_eq!(task_statuses(pool, run, "a").await, ["queued"]);
    assert_eq!(
        task_statuses(pool, run, "b").await,
        ["queued"],
        "nothing was claimed"
    );
}

// e. Exactly one of two overlapping claims wins.
#[tokio::test]
async fn two_overlapping_claims_of_one_message_return_the_task_exactly_once() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('race'); select pgflow.add_step('race', 'only');",
    )
    .await;
    let run = start(pool, "race", json!({})).await;
    register_worker(pool).await;
    let ids = read(pool, "race", 1).await;

    let mut first = pool.begin().await.unwrap();
    let won: Vec<(i64,)> = sqlx::query_as("select msg_id from pgflow.start_tasks('race', $1, $2)")
        .bind(&ids)
        .bind(WORKER)
        .fetch_all(&mut *first)
        .await
        .unwrap();
    assert_eq!(won.len(), 1);

    let second_pool = pool.clone();
    let second_ids = ids.clone();
    let second = tokio::spawn(async move {
        sqlx::query_as::<_, (i64,)>("select msg_id from pgflow.start_tasks('race', $1, $2)")
            .bind(&second_ids)
            .bind(WORKER)
            .fetch_all(&second_pool)
            .await
            .unwrap()
    });
    wait_until(Duration::from_secs(10), "the second claim to block on the task row", || async {
        sqlx::query_scalar::<_, bool>(
            "select exists (select 1 from pg_stat_activity
              where datname = current_database() and wait_event_type = 'Lock' and query like '%start_tasks%')",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    })
    .await;
    first.commit().await.unwrap();

    let lost = second.await.unwrap();
    assert!(lost.is_empty(), "the second claimer must not get the task");
    let attempts: i32 =
        sqlx::query_scalar("select attempts_count from pgflow.step_tasks where run_id = $1")
            .bind(run)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(attempts, 1);
}

#[tokio::test]
async fn claim_ignores_messages_of_started_or_finished_tasks() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('dupes'); select pgflow.add_step('dupes', 'a');",
    )
    .await;
    let run = start(pool, "dupes", json!({})).await;
    let task = claim(pool, "dupes", "dupes", 1).await.remove(0);
    assert!(
        start_tasks(pool, "dupes", &[task.msg_id]).await.is_empty(),
        "already started"
    );
    complete(pool, run, "a", 0, json!(1)).await;
    assert!(
        start_tasks(pool, "dupes", &[task.msg_id]).await.is_empty(),
        "already completed"
    );
}

#[tokio::test]
async fn claim_with_an_unregistered_worker_fails_on_the_worker_foreign_key() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('noworker'); select pgflow.add_step('noworker', 'a');",
    )
    .await;
    start(pool, "noworker", json!({})).await;
    let ids = read(pool, "noworker", 1).await;
    let err = sqlx::query("select * from pgflow.start_tasks('noworker', $1, gen_random_uuid())")
        .bind(&ids)
        .execute(pool)
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("step_tasks_last_worker_id_fkey"),
        "{err}"
    );
}

// f. Conditions hold for steps released by an empty map.
#[tokio::test]
async fn condition_is_checked_for_a_step_released_by_an_empty_root_map() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('emptygate');
         select pgflow.add_step('emptygate', 'items', step_type => 'map');
         select pgflow.add_step('emptygate', 'notify', array['items'],
                forbidden_input_pattern => '{\"items\": []}', when_unmet => 'fail');",
    )
    .await;
    let run = start(pool, "emptygate", json!([])).await;
    assert_eq!(step_status(pool, run, "notify").await, "failed");
    assert_eq!(run_status(pool, run).await, "failed");
    assert_eq!(active_tasks(pool, run).await, 0);
}

#[tokio::test]
async fn condition_is_checked_for_a_step_released_by_an_empty_dependent_map() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('emptydep');
         select pgflow.add_step('emptydep', 'list');
         select pgflow.add_step('emptydep', 'each', array['list'], step_type => 'map');
         select pgflow.add_step('emptydep', 'report', array['each'], required_input_pattern => '{\"each\": [1]}');",
    )
    .await;
    let run = start(pool, "emptydep", json!({})).await;
    claim(pool, "emptydep", "emptydep", 1).await;
    complete(pool, run, "list", 0, json!([])).await;
    assert_eq!(step_status(pool, run, "each").await, "completed");
    assert_eq!(step_status(pool, run, "report").await, "skipped");
    assert_eq!(run_status(pool, run).await, "completed");
}
