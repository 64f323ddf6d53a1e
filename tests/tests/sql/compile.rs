//! Definitions and startup compilation: create_flow, add_step, flow shapes, ensure_flow_compiled, is_local.

use crate::support::*;
use pgflow_tests::test_db;
use serde_json::{json, Value};

fn step(slug: &str, deps: &[&str]) -> Value {
    json!({
        "slug": slug, "stepType": "single", "dependencies": deps,
        "whenUnmet": "skip", "whenExhausted": "fail",
        "requiredInputPattern": {"defined": false}, "forbiddenInputPattern": {"defined": false}
    })
}

fn shape(steps: Vec<Value>) -> Value {
    json!({"options": {"maxAttempts": 4, "timeout": 30}, "steps": steps})
}

async fn ensure(pool: &sqlx::PgPool, slug: &str, shape: &Value, allow_data_loss: bool) -> Value {
    sqlx::query_scalar(
        "select pgflow.ensure_flow_compiled(flow_slug => $1, shape => $2, allow_data_loss => $3)",
    )
    .bind(slug)
    .bind(shape)
    .bind(allow_data_loss)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn ensure_flow_compiled_compiles_a_missing_flow_with_its_options() {
    let db = test_db().await;
    let pool = db.pool();
    let s = shape(vec![step("fetch", &[]), step("save", &["fetch"])]);
    assert_eq!(
        ensure(pool, "etl", &s, false).await,
        json!({"status": "compiled", "differences": []})
    );
    let (attempts, timeout): (i32, i32) = sqlx::query_as(
        "select opt_max_attempts, opt_timeout from pgflow.flows where flow_slug = 'etl'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((attempts, timeout), (4, 30));
    let stored: Value = sqlx::query_scalar("select pgflow._get_flow_shape('etl')")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(stored["steps"], s["steps"]);
}

#[tokio::test]
async fn ensure_flow_compiled_verifies_an_identical_shape_even_with_other_options() {
    let db = test_db().await;
    let pool = db.pool();
    let s = shape(vec![step("fetch", &[])]);
    ensure(pool, "same", &s, false).await;
    let mut tuned = s.clone();
    tuned["options"] = json!({"maxAttempts": 9});
    assert_eq!(
        ensure(pool, "same", &tuned, false).await,
        json!({"status": "verified", "differences": []})
    );
}

#[tokio::test]
async fn ensure_flow_compiled_reports_a_mismatch_in_production_and_changes_nothing() {
    let db = test_db().await;
    let pool = db.pool();
    ensure(pool, "prod", &shape(vec![step("x", &[])]), false).await;
    let run = start(pool, "prod", json!({})).await;
    let result = ensure(pool, "prod", &shape(vec![step("y", &[])]), false).await;
    assert_eq!(
        result,
        json!({"status": "mismatch", "differences": ["Step at index 0: slug differs 'y' vs 'x'"]})
    );
    assert_eq!(run_status(pool, run).await, "started", "history is kept");
    let stored: Value = sqlx::query_scalar("select pgflow._get_flow_shape('prod')")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(stored["steps"][0]["slug"], "x");
}

#[tokio::test]
async fn ensure_flow_compiled_recompiles_destructively_only_when_data_loss_is_allowed() {
    let db = test_db().await;
    let pool = db.pool();
    ensure(pool, "dev_flow", &shape(vec![step("x", &[])]), false).await;
    start(pool, "dev_flow", json!({})).await;
    let result = ensure(
        pool,
        "dev_flow",
        &shape(vec![step("x", &[]), step("z", &["x"])]),
        true,
    )
    .await;
    assert_eq!(result["status"], "recompiled");
    assert_eq!(
        result["differences"],
        json!([
            "Step count differs: 2 vs 1",
            "Step at index 1: missing in second shape (first has 'z')"
        ])
    );
    let runs: i64 = sqlx::query_scalar("select count(*) from pgflow.runs")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(runs, 0);
    assert_eq!(
        live_messages(pool, "dev_flow").await,
        0,
        "the queue was recreated empty"
    );
}

#[tokio::test]
async fn database_marked_local_recompiles_without_the_explicit_flag() {
    let db = test_db().await;
    let pool = db.pool();
    ensure(pool, "local_flow", &shape(vec![step("x", &[])]), false).await;
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("set local pgflow.local = 'true'")
        .execute(&mut *tx)
        .await
        .unwrap();
    let result: Value = sqlx::query_scalar("select pgflow.ensure_flow_compiled('local_flow', $1)")
        .bind(shape(vec![step("y", &[])]))
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(result["status"], "recompiled");
}

#[tokio::test]
async fn concurrent_compilations_of_one_flow_create_it_exactly_once() {
    let db = test_db().await;
    let pool = db.pool();
    let s = shape(vec![
        step("a", &[]),
        step("b", &["a"]),
        step("c", &["a", "b"]),
    ]);
    let calls = (0..8).map(|_| {
        let pool = pool.clone();
        let s = s.clone();
        tokio::spawn(async move { ensure(&pool, "contended", &s, false).await })
    });
    let mut statuses: Vec<String> = Vec::new();
    for call in calls {
        statuses.push(call.await.unwrap()["status"].as_str().unwrap().to_string());
    }
    statuses.sort();
    assert_eq!(
        statuses.iter().filter(|s| *s == "compiled").count(),
        1,
        "{statuses:?}"
    );
    assert_eq!(
        statuses.iter().filter(|s| *s == "verified").count(),
        7,
        "{statuses:?}"
    );
    let steps: i64 = sqlx::query_scalar("select count(*) from pgflow.steps")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(steps, 3);
}

#[tokio::test]
async fn compare_flow_shapes_lists_every_difference_in_order() {
    let db = test_db().await;
    let pool = db.pool();
    let mut a = step("s", &["p", "o"]);
    a["stepType"] = json!("map");
    a["whenUnmet"] = json!("fail");
    a["requiredInputPattern"] = json!({"defined": true, "value": {"k": 1}});
    let local = json!({"steps": [a]});
    let db_shape = json!({"steps": [step("s", &["o"]), step("t", &[])]});
    let diffs: Vec<String> =
        sqlx::query_scalar("select unnest(pgflow._compare_flow_shapes($1, $2))")
            .bind(&local)
            .bind(&db_shape)
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(
        diffs,
        [
            "Step count differs: 1 vs 2",
            "Step at index 0: type differs 'map' vs 'single'",
            "Step at index 0: dependencies differ [o, p] vs [o]",
            "Step at index 0: whenUnmet differs 'fail' vs 'skip'",
            "Step at index 0: requiredInputPattern differs '{\"value\": {\"k\": 1}, \"defined\": true}' vs '{\"defined\": false}'",
            "Step at index 1: missing in first shape (second has 't')",
        ]
    );
}

#[tokio::test]
async fn unknown_flow_has_an_empty_shape() {
    let db = test_db().await;
    let shape: Value = sqlx::query_scalar("select pgflow._get_flow_shape('ghost')")
        .fetch_one(db.pool())
        .await
        .unwrap();
    assert_eq!(shape, json!({"steps": []}));
}

#[tokio::test]
async fn is_local_recognises_the_supabase_secret_and_the_pgflow_local_setting() {
    let db = test_db().await;
    let mut conn = db.pool().acquire().await.unwrap();
    let local = |sql: &'static str| sqlx::query_scalar::<_, bool>(sql);
    assert!(!local("select pgflow.is_local()")
        .fetch_one(&mut *conn)
        .await
        .unwrap());
    sqlx::query(
        "set app.settings.jwt_secret = 'super-secret-jwt-token-with-at-least-32-characters-long'",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    assert!(local("select pgflow.is_local()")
        .fetch_one(&mut *conn)
        .await
        .unwrap());
    sqlx::query("set app.settings.jwt_secret = 'production'")
        .execute(&mut *conn)
        .await
        .unwrap();
    assert!(!local("select pgflow.is_local()")
        .fetch_one(&mut *conn)
        .await
        .unwrap());
    sqlx::query("set pgflow.local = 'true'")
        .execute(&mut *conn)
        .await
        .unwrap();
    assert!(local("select pgflow.is_local()")
        .fetch_one(&mut *conn)
        .await
        .unwrap());
    sqlx::query("reset pgflow.local")
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query("reset app.settings.jwt_secret")
        .execute(&mut *conn)
        .await
        .unwrap();
}

#[tokio::test]
async fn create_flow_uses_upstream_defaults_and_is_idempotent() {
    let db = test_db().await;
    let pool = db.pool();
    exec(pool, "select pgflow.create_flow('defaults')").await;
    exec(
        pool,
        "select pgflow.create_flow('defaults', max_attempts => 9)",
    )
    .await;
    let opts: (i32, i32, i32) = sqlx::query_as(
        "select opt_max_attempts, opt_base_delay, opt_timeout from pgflow.flows where flow_slug = 'defaults'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(opts, (3, 5, 60));
    let queues: i64 =
        sqlx::query_scalar("select count(*) from pgmq.meta where queue_name = 'defaults'")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(queues, 1);
    let err = exec_err(pool, "select pgflow.create_flow('bad-slug')").await;
    assert!(err.contains("slug_is_valid"), "{err}");
}

#[tokio::test]
async fn add_step_assigns_indexes_in_order_and_is_idempotent() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('idx');
         select pgflow.add_step('idx', 'a');
         select pgflow.add_step('idx', 'b', array['a'], timeout => 5);
         select pgflow.add_step('idx', 'b', array['a'], timeout => 99);",
    )
    .await;
    let rows: Vec<(String, i32, i32, Option<i32>)> = sqlx::query_as(
        "select step_slug, step_index, deps_count, opt_timeout from pgflow.steps where flow_slug = 'idx' order by step_index",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        rows,
        [("a".into(), 0, 0, None), ("b".into(), 1, 1, Some(5))]
    );
}

#[tokio::test]
async fn add_step_rejects_bad_definitions_with_upstream_errors() {
    let db = test_db().await;
    let pool = db.pool();
    exec(pool, "select pgflow.create_flow('bad'); select pgflow.add_step('bad', 'a'); select pgflow.add_step('bad', 'b');").await;
    let cases = [
        (
            "select pgflow.add_step('bad', 'm', array['a', 'b'], step_type => 'map')",
            "Map step \"m\" can have at most one dependency, but 2 were provided: a, b",
        ),
        (
            "select pgflow.add_step('nope', 's')",
            "steps_flow_slug_fkey",
        ),
        (
            "select pgflow.add_step('bad', 's', array['ghost'])",
            "deps_flow_slug_dep_slug_fkey",
        ),
        (
            "select pgflow.add_step('bad', 'run')",
            "steps_step_slug_check",
        ),
        (
            "select pgflow.add_step('bad', 's', step_type => 'loop')",
            "steps_step_type_check",
        ),
        (
            "select pgflow.add_step('bad', 's', start_delay => -1)",
            "opt_start_delay_is_nonnegative",
        ),
        (
            "select pgflow.add_step('bad', 's', timeout => 0)",
            "opt_timeout_is_positive",
        ),
        (
            "select pgflow.add_step('bad', 's', max_attempts => -1)",
            "opt_max_attempts_is_nonnegative",
        ),
    ];
    for (sql, expected) in cases {
        let err = exec_err(pool, sql).await;
        assert!(err.contains(expected), "{sql}: {err}");
    }
}

#[tokio::test]
async fn is_valid_slug_accepts_identifiers_and_rejects_the_rest() {
    let db = test_db().await;
    let results: Vec<(String, bool)> = sqlx::query_as(
        "select s, coalesce(pgflow.is_valid_slug(s), false) from unnest(array['ok', '_x1', 'Mixed', '1st', 'a-b', 'run', '', repeat('a', 129)]) s",
    )
    .fetch_all(db.pool())
    .await
    .unwrap();
    let valid: Vec<_> = results
        .iter()
        .filter(|(_, v)| *v)
        .map(|(s, _)| s.as_str())
        .collect();
    assert_eq!(valid, ["ok", "_x1", "Mixed"]);
}

#[tokio::test]
async fn ensure_flow_compiled_refuses_to_adopt_a_queue_that_exists_without_its_flow() {
    let db = test_db().await;
    let pool = db.pool();
    exec(pool, "select pgmq.create('squatter')").await;
    let err = sqlx::query("select pgflow.ensure_flow_compiled('squatter', $1)")
        .bind(shape(vec![step("a", &[])]))
        .execute(pool)
        .await
        .unwrap_err();
    assert_eq!(
        err.as_database_error().unwrap().message(),
        "ensure_flow_compiled(): PGMQ queue \"squatter\" already exists but flow \"squatter\" does not"
    );
    let flows: i64 = sqlx::query_scalar("select count(*) from pgflow.flows")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(flows, 0);
}

#[tokio::test]
async fn ensure_flow_compiled_rejects_a_slug_that_differs_only_in_case_from_a_compiled_flow() {
    let db = test_db().await;
    let pool = db.pool();
    ensure(pool, "Billing", &shape(vec![step("a", &[])]), false).await;
    let err = sqlx::query("select pgflow.ensure_flow_compiled('billing', $1)")
        .bind(shape(vec![step("a", &[])]))
        .execute(pool)
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("differs only in case from existing flow \"Billing\""),
        "{err}"
    );
}
