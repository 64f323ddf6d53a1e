//! Deployed flows: stable aliases over immutable concrete versions, named routes to shared queues,
//! queue-scoped claims across several concrete flows, startup coverage and drain checks.

use std::time::Duration;

use crate::step_support::*;
use crate::support::*;
use pgflow_sql::SqlState;
use pgflow_tests::test_db;
use serde_json::{json, Value};
use sqlx::postgres::PgListener;
use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

/// classify -> deliver, the community-threads pipeline.
fn pipeline() -> Value {
    shape(vec![step("classify", &[]), step("deliver", &["classify"])])
}

/// The classify step on `classify_threads`, deliver on `deliver_alerts`.
const ROUTES: &[(&str, &str)] = &[
    ("classify", "classify_threads"),
    ("deliver", "deliver_alerts"),
];

fn routes_json(routes: &[(&str, &str)]) -> Value {
    Value::Array(
        routes
            .iter()
            .map(|(s, q)| json!({"step_slug": s, "queue_name": q}))
            .collect(),
    )
}

/// ensure_flow_compiled in named mode.
async fn try_named(
    pool: &PgPool,
    flow: &str,
    shape: &Value,
    routes: &[(&str, &str)],
    alias: Option<&str>,
    adopt: bool,
) -> Result<Value, sqlx::Error> {
    sqlx::query_scalar(
        "select pgflow.ensure_flow_compiled(flow_slug => $1, shape => $2, queue_mode => 'named', routes => $3,
           alias => $4, adopt_queues => $5)",
    )
    .bind(flow)
    .bind(shape)
    .bind(routes_json(routes))
    .bind(alias)
    .bind(adopt)
    .fetch_one(pool)
    .await
}

async fn named(pool: &PgPool, flow: &str, routes: &[(&str, &str)], alias: Option<&str>) -> Value {
    try_named(pool, flow, &pipeline(), routes, alias, false)
        .await
        .unwrap_or_else(|e| panic!("ensure_flow_compiled({flow}): {e}"))
}

/// The concrete slug `start_flow(name)` records.
async fn started_slug(pool: &PgPool, name: &str) -> (Uuid, String) {
    sqlx::query_as(
        "select run_id, flow_slug from pgflow.start_flow(flow_slug => $1, input => '{}')",
    )
    .bind(name)
    .fetch_one(pool)
    .await
    .unwrap_or_else(|e| panic!("start_flow({name}): {e}"))
}

async fn alias_row(pool: &PgPool, alias: &str) -> (String, Option<String>) {
    sqlx::query_as("select flow_slug, previous_flow_slug from pgflow.flow_aliases where alias = $1")
        .bind(alias)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Rows of pgflow.claim_tasks for explicit pairs, as JSON (see claim_json).
async fn claim_pairs(
    pool: &PgPool,
    queue: &str,
    ids: &[i64],
    worker: Uuid,
    pairs: &[(&str, &str)],
) -> Value {
    let flows: Vec<&str> = pairs.iter().map(|p| p.0).collect();
    let steps: Vec<&str> = pairs.iter().map(|p| p.1).collect();
    claim_json(
        sqlx::query(
            "select * from pgflow.claim_tasks(queue_name => $1, msg_ids => $2, worker_id => $3,
               flow_slugs => $4, step_slugs => $5)",
        )
        .bind(queue)
        .bind(ids)
        .bind(worker)
        .bind(&flows)
        .bind(&steps)
        .fetch_all(pool)
        .await
        .unwrap_or_else(|e| panic!("claim_tasks({queue}): {e}")),
    )
}

async fn register_pairs(pool: &PgPool, worker: Uuid, queue: &str, pairs: &[(&str, &str)]) -> Value {
    let flows: Vec<&str> = pairs.iter().map(|p| p.0).collect();
    let steps: Vec<&str> = pairs.iter().map(|p| p.1).collect();
    sqlx::query_scalar(
        "select pgflow.register_worker(worker_id => $1, function_name => $2, queue_name => $3,
           flow_slugs => $4, step_slugs => $5)",
    )
    .bind(worker)
    .bind(format!("{queue}-fn"))
    .bind(queue)
    .bind(&flows)
    .bind(&steps)
    .fetch_one(pool)
    .await
    .unwrap_or_else(|e| panic!("register_worker({queue}): {e}"))
}

#[tokio::test]
async fn an_alias_starts_its_current_version_and_records_the_concrete_slug() {
    let db = test_db().await;
    let pool = db.pool();
    let v1 = named(pool, "commV1", ROUTES, Some("comm")).await;
    assert_eq!(v1["status"], "compiled");
    assert_eq!(
        v1["alias"]["activated"], true,
        "a new alias is activated: {v1}"
    );
    assert_eq!(v1["alias"]["previous_flow_slug"], Value::Null);
    let (run, slug) = started_slug(pool, "comm").await;
    assert_eq!(slug, "commV1");
    let stored: String = sqlx::query_scalar("select flow_slug from pgflow.runs where run_id = $1")
        .bind(run)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(stored, "commV1");
    // A concrete slug still starts its own version; start_flow_with_states resolves aliases too.
    assert_eq!(started_slug(pool, "commV1").await.1, "commV1");
    let states: Value = sqlx::query_scalar(
        "select pgflow.start_flow_with_states(flow_slug => 'comm', input => '{}')",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(states["run"]["flow_slug"], "commV1");
    let resolved: String = sqlx::query_scalar("select pgflow.resolve_flow_slug('comm')")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(resolved, "commV1");

    // V2 takes the alias over; its old runs stay on V1.
    let v2 = named(pool, "commV2", ROUTES, Some("comm")).await;
    assert_eq!(v2["alias"]["previous_flow_slug"], "commV1");
    assert_eq!(started_slug(pool, "comm").await.1, "commV2");
    assert_eq!(
        alias_row(pool, "comm").await,
        ("commV2".into(), Some("commV1".into()))
    );
    assert_eq!(run_status(pool, run).await, "started");
}

#[tokio::test]
async fn rollback_activates_the_older_version_with_its_original_shape_and_routing() {
    let db = test_db().await;
    let pool = db.pool();
    named(pool, "commV1", ROUTES, Some("comm")).await;
    let v1_routes = routes(pool, "commV1").await;
    let v1_shape: Value = sqlx::query_scalar("select pgflow._get_flow_shape('commV1')")
        .fetch_one(pool)
        .await
        .unwrap();
    // V2 changes the routing (deliver moves to its own queue) under the same alias.
    named(
        pool,
        "commV2",
        &[("classify", "classify_threads"), ("deliver", "deliver_v2")],
        Some("comm"),
    )
    .await;
    assert_eq!(started_slug(pool, "comm").await.1, "commV2");

    let back = named(pool, "commV1", ROUTES, Some("comm")).await;
    assert_eq!(back["status"], "verified");
    assert_eq!(back["alias"]["activated"], true);
    assert_eq!(back["alias"]["previous_flow_slug"], "commV2");
    assert_eq!(started_slug(pool, "comm").await.1, "commV1");
    assert_eq!(routes(pool, "commV1").await, v1_routes);
    let shape_now: Value = sqlx::query_scalar("select pgflow._get_flow_shape('commV1')")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(shape_now, v1_shape);

    // Activating the current target again changes nothing.
    let again = named(pool, "commV1", ROUTES, Some("comm")).await;
    assert_eq!(again["alias"]["activated"], false);
    assert_eq!(
        alias_row(pool, "comm").await,
        ("commV1".into(), Some("commV2".into()))
    );

    // A routing change under the same concrete slug is refused; the version stays as it was.
    let e = db_error(
        try_named(
            pool,
            "commV1",
            &pipeline(),
            &[("classify", "classify_threads"), ("deliver", "elsewhere")],
            Some("comm"),
            false,
        )
        .await
        .unwrap_err(),
    );
    assert_eq!(e.code, SqlState::RoutingChanged);
    assert_eq!(routes(pool, "commV1").await, v1_routes);
}

#[tokio::test]
async fn the_alias_is_activated_only_when_the_version_is_persisted_and_committed() {
    let db = test_db().await;
    let pool = db.pool();
    named(pool, "commV1", ROUTES, Some("comm")).await;
    let mut a = PgConnection::connect_with(&db.options()).await.unwrap();
    sqlx::query("begin").execute(&mut a).await.unwrap();
    let v2: Value = sqlx::query_scalar(
        "select pgflow.ensure_flow_compiled(flow_slug => 'commV2', shape => $1, queue_mode => 'named',
           routes => $2, alias => 'comm')",
    )
    .bind(pipeline())
    .bind(routes_json(ROUTES))
    .fetch_one(&mut a)
    .await
    .unwrap();
    assert_eq!(v2["alias"]["flow_slug"], "commV2");
    // Until the compile commits, new runs still start V1.
    assert_eq!(started_slug(pool, "comm").await.1, "commV1");
    sqlx::query("commit").execute(&mut a).await.unwrap();
    assert_eq!(started_slug(pool, "comm").await.1, "commV2");

    // A shape mismatch activates nothing.
    let changed = shape(vec![step("classify", &[])]);
    let mismatch = try_named(
        pool,
        "commV1",
        &changed,
        &[("classify", "classify_threads")],
        Some("comm"),
        false,
    )
    .await
    .unwrap();
    assert_eq!(mismatch["status"], "mismatch");
    assert_eq!(alias_row(pool, "comm").await.0, "commV2");
}

#[tokio::test]
async fn aliases_and_concrete_slugs_never_shadow_each_other() {
    let db = test_db().await;
    let pool = db.pool();
    named(pool, "commV1", ROUTES, None).await;
    let e = db_error(
        try_named(pool, "commV2", &pipeline(), ROUTES, Some("commV1"), false)
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, SqlState::AliasCollision);
    assert_eq!(
        e.message,
        "Alias \"commV1\" cannot point at flow \"commV2\": it is the concrete slug of flow \"commV1\"."
    );
    assert!(
        routes(pool, "commV2").await.is_empty(),
        "nothing was compiled"
    );

    named(pool, "commV2", ROUTES, Some("comm")).await;
    let e = db_error(
        try_named(pool, "comm", &pipeline(), ROUTES, None, false)
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, SqlState::AliasCollision);
    assert_eq!(
        e.message,
        "Flow slug \"comm\" is already the alias \"comm\" of flow \"commV2\"."
    );

    // The default: a flow is its own alias.
    let own = named(pool, "commV3", ROUTES, Some("commV3")).await;
    assert_eq!(own["alias"]["flow_slug"], "commV3");
    let e = db_error(
        try_named(
            pool,
            "commV4",
            &pipeline(),
            ROUTES,
            Some("not a slug"),
            false,
        )
        .await
        .unwrap_err(),
    );
    assert_eq!(e.code, SqlState::InvalidParameterValue);
}

#[tokio::test]
async fn activation_emits_one_event_through_the_event_function() {
    let db = test_db().await;
    let pool = db.pool();
    let mut listener = PgListener::connect_with(pool).await.unwrap();
    listener.listen("pgflow_deployments").await.unwrap();
    named(pool, "commV1", ROUTES, Some("comm")).await;
    let note = tokio::time::timeout(Duration::from_secs(10), listener.recv())
        .await
        .expect("an alias:activated notification")
        .unwrap();
    let payload: Value = serde_json::from_str(note.payload()).unwrap();
    assert_eq!(payload["event_type"], "alias:activated");
    assert_eq!(payload["alias"], "comm");
    assert_eq!(payload["flow_slug"], "commV1");
    // Idempotent activation sends nothing; the next activation does.
    named(pool, "commV1", ROUTES, Some("comm")).await;
    named(pool, "commV2", ROUTES, Some("comm")).await;
    let note = tokio::time::timeout(Duration::from_secs(10), listener.recv())
        .await
        .unwrap()
        .unwrap();
    let payload: Value = serde_json::from_str(note.payload()).unwrap();
    assert_eq!(
        (
            payload["flow_slug"].as_str(),
            payload["previous_flow_slug"].as_str()
        ),
        (Some("commV2"), Some("commV1"))
    );
}

#[tokio::test]
async fn named_queues_are_shared_across_steps_flows_and_versions() {
    let db = test_db().await;
    let pool = db.pool();
    // Two steps of one version on one queue, two versions and another flow on the same queues.
    named(
        pool,
        "commV1",
        &[("classify", "work_queue"), ("deliver", "work_queue")],
        None,
    )
    .await;
    named(
        pool,
        "commV2",
        &[("classify", "work_queue"), ("deliver", "alerts")],
        None,
    )
    .await;
    try_named(
        pool,
        "digest",
        &shape(vec![step("collect", &[])]),
        &[("collect", "work_queue")],
        None,
        false,
    )
    .await
    .unwrap();
    assert_eq!(pgmq_queues(pool).await, ["alerts", "work_queue"]);
    let shared: Vec<String> =
        sqlx::query_scalar("select queue_name from pgflow.shared_queues order by 1")
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(shared, ["alerts", "work_queue"]);

    // Tasks of every flow land in the shared queue with its snapshot.
    let (r1, _) = started_slug(pool, "commV1").await;
    let (r2, _) = started_slug(pool, "commV2").await;
    let (r3, _) = started_slug(pool, "digest").await;
    let queues: Vec<(Uuid, String)> = sqlx::query_as(
        "select run_id, queue_name from pgflow.step_tasks where run_id = any($1) order by queue_name, run_id",
    )
    .bind(&[r1, r2, r3][..])
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(queues.iter().all(|(_, q)| q == "work_queue"), "{queues:?}");
    assert_eq!(live_messages(pool, "work_queue").await, 3);

    // Private queues stay private, either way round.
    let e = db_error(
        try_compile(pool, "work_queue", &roots(&["a"]), "flow", false)
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, SqlState::QueueSharingConflict);
    compile(pool, "solo", &roots(&["a"]), "flow").await;
    let e = db_error(
        try_named(
            pool,
            "commV3",
            &pipeline(),
            &[("classify", "solo"), ("deliver", "alerts")],
            None,
            false,
        )
        .await
        .unwrap_err(),
    );
    assert_eq!(e.code, SqlState::QueueSharingConflict);
    assert_eq!(
        e.detail.as_deref(),
        Some("It is the default queue of flow \"solo\".")
    );
}

#[tokio::test]
async fn named_route_maps_route_every_step_once_to_a_valid_queue() {
    let db = test_db().await;
    let pool = db.pool();
    for (routes, code, message) in [
        (
            &[("classify", "q")][..],
            SqlState::InvalidRouteMap,
            "The route map of flow \"bad\" leaves step \"deliver\" without a queue.",
        ),
        (
            &[("classify", "q"), ("deliver", "q"), ("deliver", "r")][..],
            SqlState::InvalidRouteMap,
            "The route map of flow \"bad\" routes step \"deliver\" more than once.",
        ),
        (
            &[("classify", "q"), ("deliver", "q"), ("nope", "q")][..],
            SqlState::InvalidRouteMap,
            "The route map of flow \"bad\" routes \"nope\", which is not a step of the flow.",
        ),
        (
            &[("classify", "Classify"), ("deliver", "q")][..],
            SqlState::InvalidQueueName,
            "Queue \"Classify\" named for step \"classify\" of flow \"bad\" is not a valid queue name.",
        ),
        (
            &[("classify", "q-1"), ("deliver", "q")][..],
            SqlState::InvalidQueueName,
            "Queue \"q-1\" named for step \"classify\" of flow \"bad\" is not a valid queue name.",
        ),
    ] {
        let e = db_error(
            try_named(pool, "bad", &pipeline(), routes, None, false)
                .await
                .unwrap_err(),
        );
        assert_eq!((&e.code, e.message.as_str()), (&code, message));
        assert!(e.hint.is_some());
    }
    let long = "q".repeat(48);
    let e = db_error(
        try_named(
            pool,
            "bad",
            &pipeline(),
            &[("classify", &long), ("deliver", "q")],
            None,
            false,
        )
        .await
        .unwrap_err(),
    );
    assert_eq!(e.code, SqlState::InvalidQueueName);
    assert!(e.detail.unwrap().contains("this one has 48"));
    let e = db_error(
        sqlx::query("select pgflow.ensure_flow_compiled('bad', $1, queue_mode => 'named')")
            .bind(pipeline())
            .execute(pool)
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, SqlState::InvalidRouteMap);
    assert!(
        pgmq_queues(pool).await.is_empty(),
        "nothing was provisioned"
    );
}

#[tokio::test]
async fn an_existing_queue_is_adopted_only_when_the_caller_says_so() {
    let db = test_db().await;
    let pool = db.pool();
    exec(pool, "select pgmq.create('legacy_work')").await;
    let routes = [("classify", "legacy_work"), ("deliver", "alerts")];
    let e = db_error(
        try_named(pool, "commV1", &pipeline(), &routes, None, false)
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, SqlState::QueueNotAdopted);
    assert!(e.hint.unwrap().contains("adopt_queues => true"));
    assert!(routes_of(pool, "commV1").await.is_empty());

    let ok = try_named(pool, "commV1", &pipeline(), &routes, None, true)
        .await
        .unwrap();
    assert_eq!(ok["status"], "compiled");
    let adopted: Vec<(String, bool)> =
        sqlx::query_as("select queue_name, adopted from pgflow.shared_queues order by 1")
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(
        adopted,
        [("alerts".into(), false), ("legacy_work".into(), true)]
    );
    // Once shared, later versions route to it without adopting again.
    named(pool, "commV2", &routes, None).await;
}

async fn routes_of(pool: &PgPool, flow: &str) -> Vec<(String, String)> {
    routes(pool, flow).await
}

#[tokio::test]
async fn deleting_a_flow_never_drops_a_shared_queue() {
    let db = test_db().await;
    let pool = db.pool();
    named(pool, "commV1", ROUTES, Some("comm")).await;
    started_slug(pool, "comm").await;
    exec(pool, "select pgflow.delete_flow_and_data('commV1')").await;
    assert_eq!(
        pgmq_queues(pool).await,
        ["classify_threads", "deliver_alerts"]
    );
    let aliases: i64 = sqlx::query_scalar("select count(*) from pgflow.flow_aliases")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(aliases, 0);
}

#[tokio::test]
async fn one_claim_returns_tasks_of_several_concrete_flows_with_their_snapshots() {
    let db = test_db().await;
    let pool = db.pool();
    named(pool, "commV1", ROUTES, Some("comm")).await;
    let (r1, _) = started_slug(pool, "comm").await;
    named(pool, "commV2", ROUTES, Some("comm")).await;
    let (r2, _) = started_slug(pool, "comm").await;
    let worker = Uuid::new_v4();
    let pairs = [("commV1", "classify"), ("commV2", "classify")];
    let state = register_pairs(pool, worker, "classify_threads", &pairs).await;
    assert_eq!(
        state["pairs"],
        json!([["commV1", "classify"], ["commV2", "classify"]])
    );
    let msgs = read(pool, "classify_threads", 10).await;
    let result = claim_pairs(pool, "classify_threads", &msgs, worker, &pairs).await;
    assert_eq!(result["outcome"], "claimed");
    let tasks: Vec<(String, String, Uuid, i64)> = result["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["flow_slug"].as_str().unwrap().to_owned(),
                t["step_slug"].as_str().unwrap().to_owned(),
                serde_json::from_value(t["run_id"].clone()).unwrap(),
                t["attempts_count"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        tasks,
        [
            ("commV1".into(), "classify".into(), r1, 1),
            ("commV2".into(), "classify".into(), r2, 1)
        ]
    );
    // Each completes on its own version; deliver tasks follow their version's route.
    for (run, flow) in [(r1, "commV1"), (r2, "commV2")] {
        complete(pool, run, "classify", 0, json!({"route": flow})).await;
    }
    let delivers: Vec<(String, String)> = sqlx::query_as(
        "select flow_slug, queue_name from pgflow.step_tasks where step_slug = 'deliver' order by flow_slug",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        delivers,
        [
            ("commV1".into(), "deliver_alerts".into()),
            ("commV2".into(), "deliver_alerts".into())
        ]
    );
}

#[tokio::test]
async fn an_unsupported_pair_inside_a_mixed_batch_stops_the_whole_batch() {
    let db = test_db().await;
    let pool = db.pool();
    // One version with both steps on one queue: a worker for one of the two steps is not enough.
    named(
        pool,
        "commV1",
        &[("classify", "shared_work"), ("deliver", "shared_work")],
        None,
    )
    .await;
    named(
        pool,
        "commV2",
        &[("classify", "shared_work"), ("deliver", "shared_work")],
        None,
    )
    .await;
    let (r1, _) = started_slug(pool, "commV1").await;
    let (r2, _) = started_slug(pool, "commV2").await;
    let worker = Uuid::new_v4();
    let pairs = [("commV1", "classify"), ("commV1", "deliver")];
    register_pairs(pool, worker, "shared_work", &pairs).await;
    let msgs = read(pool, "shared_work", 10).await;
    assert_eq!(msgs.len(), 2);
    let result = claim_pairs(pool, "shared_work", &msgs, worker, &pairs).await;
    assert_eq!(result["outcome"], "unsupported");
    let report = &result["unsupported"];
    assert_eq!(report["flows"], json!(["commV2"]));
    assert_eq!(report["steps"], json!(["classify"]));
    assert_eq!(report["messages"][0]["reason"], "unsupported_route");
    assert_eq!(
        report["supported"],
        json!([["commV1", "classify"], ["commV1", "deliver"]])
    );
    // Nothing claimed (not even the supported V1 task), no attempt, the batch visible again.
    assert_eq!(
        task_state(pool, r1, "classify", 0).await,
        ("queued".into(), 0)
    );
    assert_eq!(
        task_state(pool, r2, "classify", 0).await,
        ("queued".into(), 0)
    );
    for id in msgs {
        assert!(seconds_until_visible(pool, "shared_work", id).await <= 0.0);
    }

    // A flow-level allowlist is not enough: a worker for V1's classify only refuses V1's deliver.
    complete_via_sql(pool, r1).await;
    let only_classify = [("commV1", "classify"), ("commV2", "classify")];
    make_visible(pool, "shared_work").await;
    let msgs = read(pool, "shared_work", 10).await;
    let result = claim_pairs(pool, "shared_work", &msgs, worker, &only_classify).await;
    assert_eq!(result["outcome"], "unsupported");
    assert_eq!(result["unsupported"]["steps"], json!(["deliver"]));
}

/// Claims and completes run `run`'s classify task with the upstream functions (any worker).
async fn complete_via_sql(pool: &PgPool, run: Uuid) {
    register_worker(pool).await;
    let msg: i64 = sqlx::query_scalar(
        "select message_id from pgflow.step_tasks where run_id = $1 and step_slug = 'classify'",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();
    sqlx::query(
        "select * from pgflow.start_tasks('commV1', array[$1]::bigint[], $2, 'shared_work')",
    )
    .bind(msg)
    .bind(WORKER)
    .execute(pool)
    .await
    .unwrap();
    complete(pool, run, "classify", 0, json!({})).await;
}

/// (flow, step, reason, count) of the coverage gaps of `queue` for `pairs`.
async fn gaps(
    pool: &PgPool,
    queue: &str,
    pairs: &[(&str, &str)],
) -> Vec<(String, String, String, i64)> {
    let flows: Vec<&str> = pairs.iter().map(|p| p.0).collect();
    let steps: Vec<&str> = pairs.iter().map(|p| p.1).collect();
    sqlx::query_as(
        "select flow_slug, step_slug, reason, count from pgflow.queue_coverage_gaps($1, $2, $3)",
    )
    .bind(queue)
    .bind(&flows)
    .bind(&steps)
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn coverage_names_every_missing_pair_with_its_reason() {
    let db = test_db().await;
    let pool = db.pool();
    // Reason 1: an active alias target routes a step here, before any run exists.
    named(pool, "commV1", ROUTES, Some("comm")).await;
    assert_eq!(
        gaps(pool, "classify_threads", &[]).await,
        [("commV1".into(), "classify".into(), "active_alias".into(), 1)]
    );
    assert!(gaps(pool, "classify_threads", &[("commV1", "classify")])
        .await
        .is_empty());

    // Reason 2: a started V1 run may still create its deliver task on deliver_alerts (V1 is no longer the
    // alias target), and reason 3: its classify task waits in classify_threads.
    let (run, _) = started_slug(pool, "comm").await;
    named(pool, "commV2", ROUTES, Some("comm")).await;
    let v2_only = [("commV2", "classify")];
    assert_eq!(
        gaps(pool, "classify_threads", &v2_only).await,
        [
            ("commV1".into(), "classify".into(), "started_run".into(), 1),
            (
                "commV1".into(),
                "classify".into(),
                "task_snapshot".into(),
                1
            )
        ]
    );
    assert_eq!(
        gaps(pool, "deliver_alerts", &[("commV2", "deliver")]).await,
        [("commV1".into(), "deliver".into(), "started_run".into(), 1)]
    );
    let detail: (Value, String) = sqlx::query_as(
        "select examples, repair from pgflow.queue_coverage_gaps('deliver_alerts', array['commV2'], array['deliver'])",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(detail.0, json!([run]));
    assert!(
        detail
            .1
            .contains("pgflow.version_retirable('commV1', 'deliver_alerts')"),
        "{}",
        detail.1
    );
}

#[tokio::test]
async fn a_version_is_retirable_once_no_run_or_task_of_it_can_reach_the_queue() {
    let db = test_db().await;
    let pool = db.pool();
    named(pool, "commV1", ROUTES, Some("comm")).await;
    let (run, _) = started_slug(pool, "comm").await;
    named(pool, "commV2", ROUTES, Some("comm")).await;
    let retirable = |queue: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, Value>("select pgflow.version_retirable('commV1', $1)")
                .bind(queue)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let r = retirable("deliver_alerts").await;
    assert_eq!(r["retirable"], false);
    assert_eq!(r["blockers"][0]["reason"], "started_run");
    assert_eq!(
        retirable("classify_threads").await["blockers"]
            .as_array()
            .unwrap()
            .len(),
        2
    );

    // The V1 run finishes: V1 can go from both queues. V2, the alias target, cannot.
    let worker = Uuid::new_v4();
    for (queue, step) in [
        ("classify_threads", "classify"),
        ("deliver_alerts", "deliver"),
    ] {
        register_pairs(pool, worker, queue, &[("commV1", step)]).await;
        let msgs = read(pool, queue, 10).await;
        let claimed = claim_pairs(pool, queue, &msgs, worker, &[("commV1", step)]).await;
        assert_eq!(claimed["outcome"], "claimed");
        complete(pool, run, step, 0, json!({})).await;
    }
    assert_eq!(run_status(pool, run).await, "completed");
    assert_eq!(retirable("classify_threads").await["retirable"], true);
    assert_eq!(retirable("deliver_alerts").await["retirable"], true);
    let v2: Value =
        sqlx::query_scalar("select pgflow.version_retirable('commV2', 'classify_threads')")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(v2["blockers"][0]["reason"], "active_alias");
}

#[tokio::test]
async fn concurrent_compiles_of_two_versions_sharing_a_queue_both_succeed() {
    let db = test_db().await;
    let pool = db.pool();
    let mut a = PgConnection::connect_with(&db.options()).await.unwrap();
    sqlx::query("begin").execute(&mut a).await.unwrap();
    let v1: Value = sqlx::query_scalar(
        "select pgflow.ensure_flow_compiled(flow_slug => 'commV1', shape => $1, queue_mode => 'named', routes => $2)",
    )
    .bind(pipeline())
    .bind(routes_json(ROUTES))
    .fetch_one(&mut a)
    .await
    .unwrap();
    assert_eq!(v1["status"], "compiled");
    let b_pool = pool.clone();
    let b = tokio::spawn(async move {
        sqlx::query_scalar::<_, Value>(
            "select pgflow.ensure_flow_compiled(flow_slug => 'commV2', shape => $1, queue_mode => 'named',
               routes => $2) /* second version */",
        )
        .bind(pipeline())
        .bind(routes_json(ROUTES))
        .fetch_one(&b_pool)
        .await
    });
    pgflow_tests::wait_until(
        Duration::from_secs(10),
        "the second compile to wait",
        || async {
            sqlx::query_scalar::<_, bool>(
                "select exists (select 1 from pg_stat_activity where datname = current_database()
               and wait_event_type = 'Lock' and query like '%second version%')",
            )
            .fetch_one(pool)
            .await
            .unwrap()
        },
    )
    .await;
    sqlx::query("commit").execute(&mut a).await.unwrap();
    assert_eq!(b.await.unwrap().unwrap()["status"], "compiled");
    assert_eq!(
        pgmq_queues(pool).await,
        ["classify_threads", "deliver_alerts"]
    );
    assert_eq!(routes(pool, "commV1").await, routes(pool, "commV2").await);
}
