//! Private per-step queues: the canonical name resolver, its MESSAGE / DETAIL / HINT errors, private
//! ownership and collisions, queue mode and route map compilation, local recompilation, versions.

use crate::step_support::*;
use crate::support::*;
use pgflow_sql::SqlState;
use pgflow_tests::test_db;
use serde_json::json;
use sqlx::PgPool;

async fn resolve(pool: &PgPool, flow: &str, steps: &[&str]) -> Result<Vec<String>, DbError> {
    sqlx::query_scalar(
        "select queue_name from pgflow.resolve_step_queues(flow_slug => $1, step_slugs => $2) order by step_index",
    )
    .bind(flow)
    .bind(steps)
    .fetch_all(pool)
    .await
    .map_err(db_error)
}

fn slug(n: usize) -> String {
    // "f" followed by a pattern, exactly n characters, mixed case so lower() matters.
    let mut s = String::from("F");
    while s.len() < n {
        s.push(if s.len() % 2 == 0 { 'x' } else { 'Y' });
    }
    s
}

#[tokio::test]
async fn resolver_uses_lowercase_readable_names_in_step_order() {
    let db = test_db().await;
    let names = resolve(
        db.pool(),
        "communityThreadsV1",
        &["classify", "deliverSlack"],
    )
    .await
    .unwrap();
    assert_eq!(
        names,
        [
            "communitythreadsv1__classify",
            "communitythreadsv1__deliverslack"
        ]
    );
}

#[tokio::test]
async fn flow_slugs_of_44_characters_fit_and_45_to_47_are_rejected_with_message_detail_hint() {
    let db = test_db().await;
    let pool = db.pool();
    let f44 = slug(44);
    // Readable "<44>__a" is 47; "<44>__ab" is 48 and falls back to "<44>__1" (47).
    assert_eq!(
        resolve(pool, &f44, &["a", "ab"]).await.unwrap(),
        [
            format!("{}__a", f44.to_lowercase()),
            format!("{}__1", f44.to_lowercase())
        ]
    );
    for n in [45, 46, 47] {
        let flow = slug(n);
        let e = resolve(pool, &flow, &["a"]).await.unwrap_err();
        assert_eq!(e.code, SqlState::StepQueuesImpossible);
        assert_eq!(
            e.message,
            format!("Flow \"{flow}\" cannot use per-step queues.")
        );
        assert_eq!(
            e.detail.as_deref(),
            Some(
                format!(
                    "The shortest required queue \"{}__0\" is {} characters; PGMQ allows at most 47.",
                    flow.to_lowercase(),
                    n + 3
                )
                .as_str()
            )
        );
        assert_eq!(
            e.hint.as_deref(),
            Some("Shorten the concrete flow slug or use the default single queue.")
        );
        // The same flow slug is fine in the default single-queue mode.
        assert_eq!(
            compile(pool, &flow, &roots(&["a"]), "flow").await,
            "compiled"
        );
    }
}

#[tokio::test]
async fn readable_names_of_47_characters_are_used_and_48_fall_back_to_the_step_index() {
    let db = test_db().await;
    let flow = slug(40); // "<40>__" is 42 characters
    let lower = flow.to_lowercase();
    let names = resolve(db.pool(), &flow, &["Abcde", "abcdef", "x"])
        .await
        .unwrap();
    assert_eq!(names[0], format!("{lower}__abcde"));
    assert_eq!(names[0].len(), 47);
    assert_eq!(names[1], format!("{lower}__1"));
    assert_eq!(names[2], format!("{lower}__x"));
}

#[tokio::test]
async fn index_ten_uses_its_fallback_when_it_fits_and_rejects_the_flow_when_it_does_not() {
    let db = test_db().await;
    let pool = db.pool();
    let ten: Vec<String> = (0..10).map(|i| format!("s{i}")).collect();
    let mut steps: Vec<&str> = ten.iter().map(String::as_str).collect();
    steps.push("deliverSlack");

    // 43 characters: "<43>__10" is 47.
    let f43 = slug(43);
    let names = resolve(pool, &f43, &steps).await.unwrap();
    assert_eq!(names[10], format!("{}__10", f43.to_lowercase()));
    assert_eq!(names[0], format!("{}__s0", f43.to_lowercase()));

    // 44 characters: readable 58, fallback 48: the whole flow is rejected, nothing is created.
    let f44 = slug(44);
    let e = resolve(pool, &f44, &steps).await.unwrap_err();
    assert_eq!(e.code, SqlState::StepQueueNameTooLong);
    assert_eq!(
        e.message,
        format!("Cannot derive a queue for step \"deliverSlack\" at index 10 in flow \"{f44}\".")
    );
    assert_eq!(
        e.detail.as_deref(),
        Some("The readable name is 58 characters and the index fallback is 48; PGMQ allows at most 47.")
    );
    assert_eq!(
        e.hint.as_deref(),
        Some("Shorten the concrete flow slug, shorten the step slug enough for the readable name, or use the default single queue.")
    );

    let shape = shape(steps.iter().map(|s| step(s, &[])).collect());
    let e = db_error(
        try_compile(pool, &f44, &shape, "step", false)
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, SqlState::StepQueueNameTooLong);
    let flows: i64 = sqlx::query_scalar("select count(*) from pgflow.flows")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(flows, 0);
    assert!(pgmq_queues(pool).await.is_empty());
}

#[tokio::test]
async fn many_steps_are_resolved_without_a_step_count_limit() {
    let db = test_db().await;
    let slugs: Vec<String> = (0..1200).map(|i| format!("step_{i}")).collect();
    let refs: Vec<&str> = slugs.iter().map(String::as_str).collect();
    let names = resolve(db.pool(), "bulk", &refs).await.unwrap();
    assert_eq!(names.len(), 1200);
    assert_eq!(names[1199], "bulk__step_1199");
}

#[tokio::test]
async fn step_mode_compiles_the_flow_its_steps_and_every_private_queue_and_verifies_idempotently() {
    let db = test_db().await;
    let pool = db.pool();
    let shape = shape(vec![
        step("classify", &[]),
        step("deliverSlack", &["classify"]),
    ]);
    assert_eq!(
        compile(pool, "communityThreadsV1", &shape, "step").await,
        "compiled"
    );
    assert_eq!(
        routes(pool, "communityThreadsV1").await,
        [
            ("classify".into(), "communitythreadsv1__classify".into()),
            (
                "deliverSlack".into(),
                "communitythreadsv1__deliverslack".into()
            )
        ]
    );
    // No default queue: only the private step queues.
    assert_eq!(
        pgmq_queues(pool).await,
        [
            "communitythreadsv1__classify",
            "communitythreadsv1__deliverslack"
        ]
    );
    let mode: String = sqlx::query_scalar(
        "select queue_mode from pgflow.flows where flow_slug = 'communityThreadsV1'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(mode, "step");

    assert_eq!(
        compile(pool, "communityThreadsV1", &shape, "step").await,
        "verified"
    );
    // With the caller's route map, too.
    let status: serde_json::Value = sqlx::query_scalar(
        "select pgflow.ensure_flow_compiled('communityThreadsV1', $1, false, 'step', $2)",
    )
    .bind(&shape)
    .bind(json!([
        {"step_slug": "classify", "queue_name": "communitythreadsv1__classify"},
        {"step_slug": "deliverSlack", "queue_name": "communitythreadsv1__deliverslack"}
    ]))
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(status["status"], "verified");

    // A queue dropped by hand is recreated on verification.
    exec(
        pool,
        "select pgmq.drop_queue('communitythreadsv1__classify')",
    )
    .await;
    assert_eq!(
        compile(pool, "communityThreadsV1", &shape, "step").await,
        "verified"
    );
    assert_eq!(pgmq_queues(pool).await.len(), 2);
}

#[tokio::test]
async fn a_caller_route_map_that_disagrees_with_sql_is_rejected_before_any_mutation() {
    let db = test_db().await;
    let pool = db.pool();
    let err = sqlx::query("select pgflow.ensure_flow_compiled('comm', $1, false, 'step', $2)")
        .bind(roots(&["classify"]))
        .bind(json!([{"step_slug": "classify", "queue_name": "comm__0"}]))
        .execute(pool)
        .await
        .unwrap_err();
    let e = db_error(err);
    assert_eq!(e.code, SqlState::RouteMapDisagrees);
    assert!(e.detail.unwrap().contains("comm__classify"));
    assert!(pgmq_queues(pool).await.is_empty());
}

#[tokio::test]
async fn an_application_created_queue_is_never_adopted() {
    let db = test_db().await;
    let pool = db.pool();
    exec(pool, "select pgmq.create('comm__deliver')").await;
    let e = db_error(
        try_compile(
            pool,
            "comm",
            &roots(&["classify", "deliver"]),
            "step",
            false,
        )
        .await
        .unwrap_err(),
    );
    assert_eq!(e.code, SqlState::QueueNotPrivate);
    assert_eq!(
        e.message,
        "Queue \"comm__deliver\" for step \"deliver\" of flow \"comm\" already exists in PGMQ."
    );
    assert!(e.hint.unwrap().contains("private"));
    // Nothing was created, not even the first step's queue.
    assert_eq!(pgmq_queues(pool).await, ["comm__deliver"]);
}

#[tokio::test]
async fn a_case_alias_of_a_generated_queue_is_rejected() {
    let db = test_db().await;
    let pool = db.pool();
    exec(pool, "select pgmq.create('COMM__Classify')").await;
    let e = db_error(
        try_compile(pool, "comm", &roots(&["classify"]), "step", false)
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, SqlState::QueueNotPrivate);
    assert!(
        e.message
            .contains("collides with the PGMQ queue \"COMM__Classify\""),
        "{e:?}"
    );
}

#[tokio::test]
async fn another_flows_queue_is_rejected_in_both_directions() {
    let db = test_db().await;
    let pool = db.pool();
    // "ab" + "c__d" and "ab__c" + "d" both generate "ab__c__d".
    assert_eq!(
        compile(pool, "ab", &roots(&["c__d"]), "step").await,
        "compiled"
    );
    let e = db_error(
        try_compile(pool, "ab__c", &roots(&["d"]), "step", false)
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, SqlState::QueueNotPrivate);
    assert_eq!(
        e.detail.as_deref(),
        Some("It is the queue of step \"c__d\" in flow \"ab\".")
    );

    // A plain flow whose default queue is that name is rejected too, even after the queue was dropped.
    exec(pool, "select pgmq.drop_queue('ab__c__d')").await;
    let e = db_error(
        try_compile(pool, "ab__c__d", &roots(&["x"]), "flow", false)
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, SqlState::QueueNotPrivate);

    // And a step queue equal to an existing plain flow's default queue.
    assert_eq!(
        compile(pool, "plain__x", &roots(&["a"]), "flow").await,
        "compiled"
    );
    let e = db_error(
        try_compile(pool, "plain", &roots(&["x"]), "step", false)
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, SqlState::QueueNotPrivate);
    assert_eq!(
        e.detail.as_deref(),
        Some("It is the default queue of flow \"plain__x\".")
    );
}

#[tokio::test]
async fn step_slugs_that_differ_only_in_case_generate_duplicate_names() {
    let db = test_db().await;
    let pool = db.pool();
    let e = resolve(pool, "comm", &["fetch", "Fetch"])
        .await
        .unwrap_err();
    assert_eq!(e.code, SqlState::DuplicateQueueName);
    assert_eq!(
        e.message,
        "Steps \"fetch\" (index 0) and \"Fetch\" (index 1) of flow \"comm\" resolve to the same queue \"comm__fetch\"."
    );
}

#[tokio::test]
async fn mode_mismatch_in_production_is_a_routing_error_distinct_from_a_shape_mismatch() {
    let db = test_db().await;
    let pool = db.pool();
    let shape = roots(&["classify", "deliver"]);
    compile(pool, "comm", &shape, "flow").await;
    let e = db_error(
        try_compile(pool, "comm", &shape, "step", false)
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, SqlState::RoutingChanged);
    assert_eq!(
        e.message,
        "Flow \"comm\" is deployed with a different queue routing."
    );
    let detail = e.detail.unwrap();
    assert!(
        detail.starts_with("Queue mode differs: persisted 'flow', requested 'step'"),
        "{detail}"
    );
    assert!(e.hint.unwrap().contains("new concrete flow slug"));
    // Nothing changed.
    assert_eq!(pgmq_queues(pool).await, ["comm"]);

    // A shape mismatch stays a result, not an error.
    let result = try_compile(pool, "comm", &roots(&["classify"]), "flow", false)
        .await
        .unwrap();
    assert_eq!(result["status"], "mismatch");
}

#[tokio::test]
async fn a_tampered_route_is_detected_even_when_shape_and_mode_match() {
    let db = test_db().await;
    let pool = db.pool();
    let shape = roots(&["classify", "deliver"]);
    compile(pool, "comm", &shape, "step").await;
    exec(
        pool,
        "update pgflow.steps set queue_name = 'comm__classify' where step_slug = 'deliver'",
    )
    .await;
    let e = db_error(
        try_compile(pool, "comm", &shape, "step", false)
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, SqlState::RoutingChanged);
    assert_eq!(
        e.detail.as_deref(),
        Some("Route at index 1 differs: persisted 'deliver' -> 'comm__classify', requested 'deliver' -> 'comm__deliver'.")
    );
}

#[tokio::test]
async fn local_recompilation_switches_modes_and_removes_old_data_and_queues() {
    let db = test_db().await;
    let pool = db.pool();
    let shape = roots(&["classify", "deliver"]);
    compile(pool, "comm", &shape, "flow").await;
    let old_run = start(pool, "comm", json!({})).await;

    // A local database (pgflow.local) recompiles flow -> step.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("set local pgflow.local = 'true'")
        .execute(&mut *tx)
        .await
        .unwrap();
    let result: serde_json::Value = sqlx::query_scalar(
        "select pgflow.ensure_flow_compiled(flow_slug => 'comm', shape => $1, queue_mode => 'step')",
    )
    .bind(&shape)
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(result["status"], "recompiled");
    assert_eq!(
        result["differences"][0],
        "Queue mode differs: persisted 'flow', requested 'step'"
    );
    assert_eq!(pgmq_queues(pool).await, ["comm__classify", "comm__deliver"]);
    let runs: i64 = sqlx::query_scalar("select count(*) from pgflow.runs where run_id = $1")
        .bind(old_run)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(runs, 0);

    // And back (allow_data_loss): the step queues go, the default queue comes back.
    let run = start(pool, "comm", json!({})).await;
    assert_eq!(live_messages(pool, "comm__deliver").await, 1);
    let result = try_compile(pool, "comm", &shape, "flow", true)
        .await
        .unwrap();
    assert_eq!(result["status"], "recompiled");
    assert_eq!(pgmq_queues(pool).await, ["comm"]);
    let runs: i64 = sqlx::query_scalar("select count(*) from pgflow.runs where run_id = $1")
        .bind(run)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(runs, 0);
    assert_eq!(
        routes(pool, "comm").await,
        [
            ("classify".into(), "comm".into()),
            ("deliver".into(), "comm".into())
        ]
    );
}

#[tokio::test]
async fn concrete_versions_use_independent_queues_and_deleting_one_drops_only_its_own() {
    let db = test_db().await;
    let pool = db.pool();
    let shape = shape(vec![
        step("classify", &[]),
        step("deliverSlack", &["classify"]),
    ]);
    compile(pool, "communityThreadsV1", &shape, "step").await;
    compile(pool, "communityThreadsV2", &shape, "step").await;
    let v1 = start(pool, "communityThreadsV1", json!({"v": 1})).await;
    let v2 = start(pool, "communityThreadsV2", json!({"v": 2})).await;
    assert_eq!(live_messages(pool, "communitythreadsv1__classify").await, 1);
    assert_eq!(live_messages(pool, "communitythreadsv2__classify").await, 1);

    // A V2 worker reading the V2 queue sees only V2 work.
    let worker = uuid::Uuid::new_v4();
    register(
        pool,
        worker,
        "v2",
        "communitythreadsv2__classify",
        "communityThreadsV2",
        Some("classify"),
    )
    .await;
    let msgs = read(pool, "communitythreadsv2__classify", 10).await;
    let claimed = claim_tasks(
        pool,
        "communitythreadsv2__classify",
        "communityThreadsV2",
        Some("classify"),
        &msgs,
        worker,
    )
    .await;
    assert_eq!(claimed["tasks"][0]["run_id"], json!(v2));
    assert_eq!(claimed["tasks"].as_array().unwrap().len(), 1);

    exec(
        pool,
        "select pgflow.delete_flow_and_data('communityThreadsV1')",
    )
    .await;
    assert_eq!(
        pgmq_queues(pool).await,
        [
            "communitythreadsv2__classify",
            "communitythreadsv2__deliverslack"
        ]
    );
    assert_eq!(
        task_state(pool, v2, "classify", 0).await,
        ("started".into(), 1)
    );
    let v1_left: i64 = sqlx::query_scalar("select count(*) from pgflow.runs where run_id = $1")
        .bind(v1)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(v1_left, 0);
}

#[tokio::test]
async fn dependency_slugs_are_sorted_in_byte_order_whatever_the_collation() {
    let db = test_db().await;
    let pool = db.pool();
    // Force a linguistic collation on the column: byte order must still win.
    exec(
        pool,
        "alter table pgflow.deps alter column dep_slug type text collate \"en-x-icu\"",
    )
    .await;
    let deps = ["b", "B", "_a", "a", "A_b", "a_B"];
    let mut steps: Vec<serde_json::Value> = deps.iter().map(|d| step(d, &[])).collect();
    steps.push(step("sink", &deps));
    let shape = shape(steps);
    compile(pool, "collated", &shape, "flow").await;
    let stored: serde_json::Value =
        sqlx::query_scalar("select pgflow._get_flow_shape('collated') #> '{steps,6,dependencies}'")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(stored, json!(["A_b", "B", "_a", "a", "a_B", "b"]));
    assert_eq!(compile(pool, "collated", &shape, "flow").await, "verified");
}
