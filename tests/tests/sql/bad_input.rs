//! Bad definitions and extreme options get a clear error, never a stuck run: duplicate dependencies,
//! changed dependencies, overflowing retry delays and timeouts.

use crate::step_support::*;
use crate::support::*;
use pgflow_sql::SqlState;
use pgflow_tests::test_db;
use serde_json::json;
use uuid::Uuid;

#[tokio::test]
async fn duplicate_dependency_slugs_are_rejected_with_the_flow_step_and_dependency() {
    let db = test_db().await;
    let pool = db.pool();
    let shape = shape(vec![step("a", &[]), step("b", &["a", "a"])]);
    let err = try_compile(pool, "dup", &shape, "flow", false)
        .await
        .unwrap_err();
    let e = db_error(err);
    assert_eq!(e.code, SqlState::InvalidParameterValue);
    assert_eq!(
        e.message,
        "Step \"b\" of flow \"dup\" lists dependency \"a\" more than once"
    );
    assert_eq!(e.hint.as_deref(), Some("List each dependency once."));
    // Nothing was compiled: the whole compilation rolled back.
    let flows: i64 = sqlx::query_scalar("select count(*) from pgflow.flows")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(flows, 0);

    exec(
        pool,
        "select pgflow.create_flow('dup2'); select pgflow.add_step('dup2', 'a');",
    )
    .await;
    let message = exec_err(pool, "select pgflow.add_step('dup2', 'b', array['a', 'a'])").await;
    assert_eq!(
        message,
        "Step \"b\" of flow \"dup2\" lists dependency \"a\" more than once"
    );
}

#[tokio::test]
async fn adding_an_existing_step_again_with_other_dependencies_is_rejected() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('re');
         select pgflow.add_step('re', 'a');
         select pgflow.add_step('re', 'b');
         select pgflow.add_step('re', 'b');",
    )
    .await;
    let message = exec_err(pool, "select pgflow.add_step('re', 'b', array['a'])").await;
    assert_eq!(
        message,
        "Step \"b\" of flow \"re\" already exists with other dependencies"
    );
    // The stored step is untouched: a run completes.
    let run = start(pool, "re", json!({})).await;
    for task in claim(pool, "re", "re", 10).await {
        complete(pool, run, &task.step_slug, task.task_index, json!(1)).await;
    }
    assert_eq!(run_status(pool, run).await, "completed");
}

#[tokio::test]
async fn retry_delays_are_capped_at_one_day_and_never_overflow() {
    let db = test_db().await;
    let pool = db.pool();
    let delays: Vec<i32> = sqlx::query_scalar(
        "select pgflow.calculate_retry_delay(b, n)
         from (values (5, 29), (3600, 20), (1, 2147483647), (2147483647, 64), (5, 3), (0, 100), (-5, 2))
           as v(b, n)",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(delays, [86400, 86400, 86400, 86400, 40, 0, 0]);
}

#[tokio::test]
async fn a_failure_after_many_attempts_with_a_large_base_delay_is_recorded() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('slow', max_attempts => 50, base_delay => 3600);
         select pgflow.add_step('slow', 'a');",
    )
    .await;
    let run = start(pool, "slow", json!({})).await;
    let tasks = claim(pool, "slow", "slow", 1).await;
    exec(
        pool,
        &format!("update pgflow.step_tasks set attempts_count = 20 where run_id = '{run}'"),
    )
    .await;
    assert_eq!(fail(pool, run, "a", 0, "again").await, "queued");
    let secs = seconds_until_visible(pool, "slow", tasks[0].msg_id).await;
    assert!((86390.0..=86400.0).contains(&secs), "{secs}");

    // A handler-chosen delay is capped the same way.
    let worker = Uuid::new_v4();
    register(pool, worker, "slow", "slow", "slow", None).await;
    make_visible(pool, "slow").await;
    let msgs = read(pool, "slow", 1).await;
    let claimed = claim_tasks(pool, "slow", "slow", None, &msgs, worker).await;
    let attempt = claimed["tasks"][0]["attempts_count"].as_i64().unwrap() as i32;
    let outcome: String = sqlx::query_scalar(
        "select outcome from pgflow.fail_task(run_id => $1, step_slug => 'a', task_index => 0,
           error_message => 'later', attempt => $2, retry_delay_seconds => 2147483647)",
    )
    .bind(run)
    .bind(attempt)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(outcome, "applied");
    let secs = seconds_until_visible(pool, "slow", msgs[0]).await;
    assert!((86390.0..=86400.0).contains(&secs), "{secs}");
}

#[tokio::test]
async fn the_largest_step_timeout_claims_defers_and_recovers_without_overflow() {
    let db = test_db().await;
    let pool = db.pool();
    let mut shape = roots(&["long"]);
    shape["options"]["timeout"] = json!(2147483647);
    compile(pool, "huge", &shape, "flow").await;
    let worker = Uuid::new_v4();
    register(pool, worker, "huge", "huge", "huge", None).await;
    let run = start(pool, "huge", json!({})).await;
    let msgs = read(pool, "huge", 1).await;
    let claimed = claim_tasks(pool, "huge", "huge", None, &msgs, worker).await;
    assert_eq!(claimed["outcome"], "claimed");
    assert_eq!(claimed["tasks"][0]["timeout"], 2147483647);
    // A duplicate read is deferred to the recovery boundary, decades away.
    make_visible(pool, "huge").await;
    let again = read(pool, "huge", 1).await;
    let deferred = claim_tasks(pool, "huge", "huge", None, &again, worker).await;
    assert_eq!(deferred["deferred"], json!(again));
    assert!(seconds_until_visible(pool, "huge", msgs[0]).await > 2.0e9);
    let requeued: i32 = sqlx::query_scalar("select pgflow.requeue_stalled_tasks()")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(requeued, 0);
    assert_eq!(
        task_state(pool, run, "long", 0).await,
        ("started".into(), 1)
    );
}
