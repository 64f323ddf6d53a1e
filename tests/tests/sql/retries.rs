//! Retries: stored visibility with exponential backoff, exhaustion, and type violations.

use crate::support::*;
use pgflow_tests::test_db;
use serde_json::json;

#[tokio::test]
async fn calculate_retry_delay_doubles_with_each_attempt() {
    let db = test_db().await;
    let delays: Vec<i32> = sqlx::query_scalar(
        "select pgflow.calculate_retry_delay(base_delay => 5, attempts_count => n) from generate_series(0, 3) n order by n",
    )
    .fetch_all(db.pool())
    .await
    .unwrap();
    assert_eq!(delays, [5, 10, 20, 40]);
}

#[tokio::test]
async fn failed_attempt_requeues_the_task_with_exponential_backoff_visibility() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('backoff', max_attempts => 3, base_delay => 7);
         select pgflow.add_step('backoff', 'flaky');",
    )
    .await;
    let run = start(pool, "backoff", json!({})).await;
    let task = claim(pool, "backoff", "backoff", 1).await.remove(0);

    assert_eq!(fail(pool, run, "flaky", 0, "first").await, "queued");
    let secs = seconds_until_visible(pool, "backoff", task.msg_id).await;
    assert!(
        (12.0..=14.0).contains(&secs),
        "first retry after 2 x base, got {secs}"
    );

    make_visible(pool, "backoff").await;
    let again = claim(pool, "backoff", "backoff", 1).await;
    assert_eq!(
        again[0].msg_id, task.msg_id,
        "a retry reuses the task's message"
    );
    assert_eq!(fail(pool, run, "flaky", 0, "second").await, "queued");
    let secs = seconds_until_visible(pool, "backoff", task.msg_id).await;
    assert!(
        (26.0..=28.0).contains(&secs),
        "second retry after 4 x base, got {secs}"
    );

    let (attempts, error): (i32, String) = sqlx::query_as(
        "select attempts_count, error_message from pgflow.step_tasks where run_id = $1 and step_slug = 'flaky'",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((attempts, error.as_str()), (2, "second"));
}

#[tokio::test]
async fn step_options_override_the_flow_for_attempts_and_delay() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('override', max_attempts => 5, base_delay => 100);
         select pgflow.add_step('override', 'quick', max_attempts => 2, base_delay => 1);",
    )
    .await;
    let run = start(pool, "override", json!({})).await;
    let task = claim(pool, "override", "override", 1).await.remove(0);
    fail(pool, run, "quick", 0, "1").await;
    let secs = seconds_until_visible(pool, "override", task.msg_id).await;
    assert!(
        (1.0..=2.1).contains(&secs),
        "step base_delay 1 -> 2 s, got {secs}"
    );
    make_visible(pool, "override").await;
    claim(pool, "override", "override", 1).await;
    assert_eq!(
        fail(pool, run, "quick", 0, "2").await,
        "failed",
        "step max_attempts 2 is exhausted"
    );
    assert_eq!(run_status(pool, run).await, "failed");
}

#[tokio::test]
async fn exhausted_task_fails_step_and_run_with_its_error_and_archives_the_message() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('exhaust', max_attempts => 1);
         select pgflow.add_step('exhaust', 'once');",
    )
    .await;
    let run = start(pool, "exhaust", json!({})).await;
    claim(pool, "exhaust", "exhaust", 1).await;
    assert_eq!(fail(pool, run, "once", 0, "it broke").await, "failed");
    let (status, error): (String, String) = sqlx::query_as(
        "select status, error_message from pgflow.step_states where run_id = $1 and step_slug = 'once'",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((status.as_str(), error.as_str()), ("failed", "it broke"));
    assert_eq!(run_status(pool, run).await, "failed");
    assert_eq!(live_messages(pool, "exhaust").await, 0);
}

#[tokio::test]
async fn fail_task_on_a_queued_task_changes_nothing() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('notyet'); select pgflow.add_step('notyet', 's');",
    )
    .await;
    let run = start(pool, "notyet", json!({})).await;
    assert_eq!(fail(pool, run, "s", 0, "too early").await, "queued");
    let attempts: i32 =
        sqlx::query_scalar("select attempts_count from pgflow.step_tasks where run_id = $1")
            .bind(run)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(attempts, 0);
    assert_eq!(
        claim(pool, "notyet", "notyet", 1).await.len(),
        1,
        "its message stays visible"
    );
}

#[tokio::test]
async fn single_step_feeding_a_map_with_a_non_array_is_a_type_violation_that_fails_the_run() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('typed', max_attempts => 5);
         select pgflow.add_step('typed', 'list', when_exhausted => 'skip');
         select pgflow.add_step('typed', 'each', array['list'], step_type => 'map');
         select pgflow.add_step('typed', 'side');",
    )
    .await;
    let run = start(pool, "typed", json!({})).await;
    claim(pool, "typed", "typed", 10).await;
    assert_eq!(
        complete(pool, run, "list", 0, json!({"not": "array"})).await,
        "failed"
    );

    let (task_error, task_output): (String, serde_json::Value) = sqlx::query_as(
        "select error_message, output from pgflow.step_tasks where run_id = $1 and step_slug = 'list'",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        task_error,
        "[TYPE_VIOLATION] Produced object instead of array"
    );
    assert_eq!(
        task_output,
        json!({"not": "array"}),
        "the offending output is kept"
    );
    let step_error: String = sqlx::query_scalar(
        "select error_message from pgflow.step_states where run_id = $1 and step_slug = 'list'",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        step_error,
        "[TYPE_VIOLATION] Map step each expects array input but dependency list produced object"
    );
    assert_eq!(
        run_status(pool, run).await,
        "failed",
        "when_exhausted does not apply to type violations"
    );
    assert_eq!(task_statuses(pool, run, "side").await, ["cancelled"]);
}
