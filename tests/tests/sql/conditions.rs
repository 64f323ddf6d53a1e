//! Conditions (`if` / `ifNot` with whenUnmet fail / skip / skip-cascade) and whenExhausted in every mode.

use crate::support::*;
use pgflow_tests::test_db;
use serde_json::json;

/// a -> gated (if a = {"ok": true}) -> after; plus an independent `other` root.
async fn gated_flow(pool: &sqlx::PgPool, flow: &str, when_unmet: &str) {
    exec(
        pool,
        &format!(
            "select pgflow.create_flow('{flow}');
             select pgflow.add_step('{flow}', 'a');
             select pgflow.add_step('{flow}', 'gated', array['a'],
                    required_input_pattern => '{{\"a\": {{\"ok\": true}}}}', when_unmet => '{when_unmet}');
             select pgflow.add_step('{flow}', 'after', array['gated']);
             select pgflow.add_step('{flow}', 'other');"
        ),
    )
    .await;
}

#[tokio::test]
async fn met_condition_lets_the_step_run() {
    let db = test_db().await;
    let pool = db.pool();
    gated_flow(pool, "met", "fail").await;
    let run = start(pool, "met", json!({})).await;
    claim(pool, "met", "met", 10).await;
    complete(pool, run, "a", 0, json!({"ok": true, "extra": 1})).await;
    let tasks = claim(pool, "met", "met", 10).await;
    assert_eq!(tasks[0].step_slug, "gated");
    assert_eq!(step_status(pool, run, "gated").await, "started");
}

#[tokio::test]
async fn unmet_condition_with_skip_skips_only_that_step_and_dependents_run_without_its_key() {
    let db = test_db().await;
    let pool = db.pool();
    gated_flow(pool, "skipper", "skip").await;
    let run = start(pool, "skipper", json!({})).await;
    claim(pool, "skipper", "skipper", 10).await;
    complete(pool, run, "a", 0, json!({"ok": false})).await;

    assert_eq!(step_status(pool, run, "gated").await, "skipped");
    assert_eq!(
        skip_reason(pool, run, "gated").await.as_deref(),
        Some("condition_unmet")
    );
    let tasks = claim(pool, "skipper", "skipper", 10).await;
    assert_eq!(tasks[0].step_slug, "after");
    assert_eq!(tasks[0].input, Some(json!({})));
    complete(pool, run, "after", 0, json!(1)).await;
    complete(pool, run, "other", 0, json!(2)).await;
    assert_eq!(run_status(pool, run).await, "completed");
}

#[tokio::test]
async fn unmet_condition_with_skip_cascade_skips_every_descendant() {
    let db = test_db().await;
    let pool = db.pool();
    gated_flow(pool, "cascader", "skip-cascade").await;
    let run = start(pool, "cascader", json!({})).await;
    claim(pool, "cascader", "cascader", 10).await;
    complete(pool, run, "a", 0, json!({"ok": false})).await;

    assert_eq!(
        skip_reason(pool, run, "gated").await.as_deref(),
        Some("condition_unmet")
    );
    assert_eq!(
        skip_reason(pool, run, "after").await.as_deref(),
        Some("dependency_skipped")
    );
    assert_eq!(
        run_status(pool, run).await,
        "started",
        "the independent root is still running"
    );
    complete(pool, run, "other", 0, json!(2)).await;
    assert_eq!(run_status(pool, run).await, "completed");
    assert_eq!(
        run_output(pool, run).await,
        Some(json!({"other": 2})),
        "skipped leaves are omitted"
    );
}

#[tokio::test]
async fn unmet_condition_with_fail_fails_the_step_and_the_run() {
    let db = test_db().await;
    let pool = db.pool();
    gated_flow(pool, "strict", "fail").await;
    let run = start(pool, "strict", json!({})).await;
    claim(pool, "strict", "strict", 10).await;
    complete(pool, run, "a", 0, json!({"ok": false})).await;

    assert_eq!(step_status(pool, run, "gated").await, "failed");
    let msg: String = sqlx::query_scalar(
        "select error_message from pgflow.step_states where run_id = $1 and step_slug = 'gated'",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(msg, "Condition not met");
    assert_eq!(run_status(pool, run).await, "failed");
    assert_eq!(task_statuses(pool, run, "other").await, ["cancelled"]);
}

#[tokio::test]
async fn root_if_not_pattern_is_checked_against_the_run_input() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('ifnot');
         select pgflow.add_step('ifnot', 'unless_test', forbidden_input_pattern => '{\"test\": true}');
         select pgflow.add_step('ifnot', 'always');",
    )
    .await;
    let skipped = start(pool, "ifnot", json!({"test": true})).await;
    assert_eq!(step_status(pool, skipped, "unless_test").await, "skipped");
    let ran = start(pool, "ifnot", json!({"test": false})).await;
    assert_eq!(step_status(pool, ran, "unless_test").await, "started");
}

#[tokio::test]
async fn if_not_with_an_empty_object_matches_a_skipped_dependency() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('fallback');
         select pgflow.add_step('fallback', 'maybe', required_input_pattern => '{\"go\": true}');
         select pgflow.add_step('fallback', 'plan_b', array['maybe'], forbidden_input_pattern => '{\"maybe\": {}}');",
    )
    .await;
    let run = start(pool, "fallback", json!({"go": false})).await;
    assert_eq!(step_status(pool, run, "maybe").await, "skipped");
    assert_eq!(step_status(pool, run, "plan_b").await, "started");
}

async fn exhausting_flow(pool: &sqlx::PgPool, flow: &str, when_exhausted: &str) {
    exec(
        pool,
        &format!(
            "select pgflow.create_flow('{flow}', max_attempts => 1);
             select pgflow.add_step('{flow}', 'work', step_type => 'map', when_exhausted => '{when_exhausted}');
             select pgflow.add_step('{flow}', 'next', array['work']);
             select pgflow.add_step('{flow}', 'then', array['next']);"
        ),
    )
    .await;
}

#[tokio::test]
async fn when_exhausted_fail_fails_the_step_and_the_run() {
    let db = test_db().await;
    let pool = db.pool();
    exhausting_flow(pool, "wx_fail", "fail").await;
    let run = start(pool, "wx_fail", json!([1, 2])).await;
    claim(pool, "wx_fail", "wx_fail", 1).await;
    assert_eq!(fail(pool, run, "work", 0, "boom").await, "failed");
    assert_eq!(step_status(pool, run, "work").await, "failed");
    assert_eq!(run_status(pool, run).await, "failed");
    assert_eq!(
        task_statuses(pool, run, "work").await,
        ["failed", "cancelled"]
    );
}

#[tokio::test]
async fn when_exhausted_skip_skips_the_step_and_dependents_continue_without_it() {
    let db = test_db().await;
    let pool = db.pool();
    exhausting_flow(pool, "wx_skip", "skip").await;
    let run = start(pool, "wx_skip", json!([1, 2])).await;
    claim(pool, "wx_skip", "wx_skip", 1).await;
    fail(pool, run, "work", 0, "boom").await;

    assert_eq!(step_status(pool, run, "work").await, "skipped");
    assert_eq!(
        skip_reason(pool, run, "work").await.as_deref(),
        Some("handler_failed")
    );
    assert_eq!(
        task_statuses(pool, run, "work").await,
        ["failed", "skipped"]
    );
    let tasks = claim(pool, "wx_skip", "wx_skip", 10).await;
    assert_eq!(tasks.len(), 1);
    assert_eq!(tasks[0].step_slug, "next");
    assert_eq!(tasks[0].input, Some(json!({})));
}

#[tokio::test]
async fn when_exhausted_skip_cascade_skips_the_step_and_all_its_dependents() {
    let db = test_db().await;
    let pool = db.pool();
    exhausting_flow(pool, "wx_cascade", "skip-cascade").await;
    let run = start(pool, "wx_cascade", json!([1])).await;
    claim(pool, "wx_cascade", "wx_cascade", 1).await;
    fail(pool, run, "work", 0, "boom").await;

    assert_eq!(
        skip_reason(pool, run, "work").await.as_deref(),
        Some("handler_failed")
    );
    assert_eq!(
        skip_reason(pool, run, "next").await.as_deref(),
        Some("dependency_skipped")
    );
    assert_eq!(
        skip_reason(pool, run, "then").await.as_deref(),
        Some("dependency_skipped")
    );
    assert_eq!(run_status(pool, run).await, "completed");
    assert_eq!(run_output(pool, run).await, None);
}

#[tokio::test]
async fn map_whose_only_dependency_was_skipped_completes_with_an_empty_array() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('skipfeed');
         select pgflow.add_step('skipfeed', 'list', required_input_pattern => '{\"go\": true}');
         select pgflow.add_step('skipfeed', 'each', array['list'], step_type => 'map');",
    )
    .await;
    let run = start(pool, "skipfeed", json!({"go": false})).await;
    assert_eq!(step_status(pool, run, "list").await, "skipped");
    assert_eq!(step_status(pool, run, "each").await, "completed");
    assert_eq!(run_output(pool, run).await, Some(json!({"each": []})));
}

#[tokio::test]
async fn force_skipping_steps_of_an_unknown_run_is_an_error() {
    let db = test_db().await;
    let pool = db.pool();
    let err = exec_err(
        pool,
        "select pgflow._cascade_force_skip_steps('00000000-0000-0000-0000-000000000009', 'x', 'condition_unmet')",
    )
    .await;
    assert_eq!(err, "Run not found: 00000000-0000-0000-0000-000000000009");
}

#[tokio::test]
async fn add_step_rejects_patterns_that_are_not_objects_and_unknown_modes() {
    let db = test_db().await;
    let pool = db.pool();
    exec(pool, "select pgflow.create_flow('bad_conditions')").await;
    let err = exec_err(
        pool,
        "select pgflow.add_step('bad_conditions', 's', required_input_pattern => '[1]')",
    )
    .await;
    assert!(err.contains("required_input_pattern_is_object"), "{err}");
    let err = exec_err(
        pool,
        "select pgflow.add_step('bad_conditions', 's', forbidden_input_pattern => '\"x\"')",
    )
    .await;
    assert!(err.contains("forbidden_input_pattern_is_object"), "{err}");
    let err = exec_err(
        pool,
        "select pgflow.add_step('bad_conditions', 's', when_unmet => 'explode')",
    )
    .await;
    assert!(err.contains("when_unmet_is_valid"), "{err}");
    let err = exec_err(
        pool,
        "select pgflow.add_step('bad_conditions', 's', when_exhausted => 'retry')",
    )
    .await;
    assert!(err.contains("when_exhausted_is_valid"), "{err}");
}
