//! Persisted queue identity: steps.queue_name, immutable task snapshots, (queue_name, message_id) identity,
//! queue resolution from persisted steps, and slugs that cannot be queue names.

use crate::support::*;
use pgflow_tests::test_db;
use serde_json::json;
use uuid::Uuid;

#[tokio::test]
async fn steps_and_tasks_record_the_lowercase_flow_queue() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('MixedCase');
         select pgflow.add_step('MixedCase', 'a');
         select pgflow.add_step('MixedCase', 'b', array['a']);",
    )
    .await;
    let step_queues: Vec<String> = sqlx::query_scalar(
        "select queue_name from pgflow.steps where flow_slug = 'MixedCase' order by step_index",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(step_queues, ["mixedcase", "mixedcase"]);
    let run = start(pool, "MixedCase", json!({})).await;
    let task_queue: String =
        sqlx::query_scalar("select queue_name from pgflow.step_tasks where run_id = $1")
            .bind(run)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(task_queue, "mixedcase");
}

#[tokio::test]
async fn task_queue_snapshot_cannot_be_changed() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('pinned'); select pgflow.add_step('pinned', 'a');",
    )
    .await;
    let run = start(pool, "pinned", json!({})).await;
    let err = exec_err(
        pool,
        "update pgflow.step_tasks set queue_name = 'elsewhere'",
    )
    .await;
    assert!(err.contains("step_tasks.queue_name is immutable"), "{err}");
    // Updates that keep the queue are fine.
    exec(
        pool,
        "update pgflow.step_tasks set queue_name = queue_name, requeued_count = 0",
    )
    .await;

    // Changing the step's route later does not move existing tasks.
    exec(
        pool,
        "update pgflow.steps set queue_name = 'pinned_v2' where flow_slug = 'pinned'",
    )
    .await;
    let task_queue: String =
        sqlx::query_scalar("select queue_name from pgflow.step_tasks where run_id = $1")
            .bind(run)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(task_queue, "pinned");
}

#[tokio::test]
async fn direct_task_inserts_take_the_queue_snapshot_from_the_step() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('Direct'); select pgflow.add_step('Direct', 'a');",
    )
    .await;
    let run = start(pool, "Direct", json!({})).await;
    exec(
        pool,
        &format!(
            "insert into pgflow.step_tasks (flow_slug, run_id, step_slug, task_index, message_id)
             values ('Direct', '{run}', 'a', 1, 999)"
        ),
    )
    .await;
    let queue: String =
        sqlx::query_scalar("select queue_name from pgflow.step_tasks where task_index = 1")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(queue, "direct");
}

#[tokio::test]
async fn start_tasks_resolves_the_queue_from_persisted_steps_when_the_slug_has_capitals() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('ShoutyFlow'); select pgflow.add_step('ShoutyFlow', 'a');",
    )
    .await;
    start(pool, "ShoutyFlow", json!({"x": 1})).await;
    // Workers read the queue under any spelling (PGMQ tables are lowercase).
    let tasks = claim(pool, "ShoutyFlow", "ShoutyFlow", 1).await;
    assert_eq!(tasks.len(), 1);
    assert_eq!(tasks[0].flow_slug, "ShoutyFlow");
    assert_eq!(tasks[0].flow_input, Some(json!({"x": 1})));
}

#[tokio::test]
async fn queue_aware_start_tasks_claims_only_from_the_named_queue() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('qa'); select pgflow.add_step('qa', 'a');",
    )
    .await;
    start(pool, "qa", json!({})).await;
    register_worker(pool).await;
    let ids = read(pool, "qa", 1).await;

    let wrong: Vec<(i64,)> = sqlx::query_as(
        "select msg_id from pgflow.start_tasks(flow_slug => 'qa', msg_ids => $1, worker_id => $2, queue_name => 'other')",
    )
    .bind(&ids)
    .bind(WORKER)
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(
        wrong.is_empty(),
        "the same msg_id in another queue is another message"
    );

    let right: Vec<(i64,)> = sqlx::query_as(
        "select msg_id from pgflow.start_tasks(flow_slug => 'qa', msg_ids => $1, worker_id => $2, queue_name => 'qa')",
    )
    .bind(&ids)
    .bind(WORKER)
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(right, [(ids[0],)]);
}

#[tokio::test]
async fn three_argument_start_tasks_asks_for_a_queue_when_a_flow_uses_several() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('split');
         select pgflow.add_step('split', 'a');
         select pgflow.add_step('split', 'b');
         update pgflow.steps set queue_name = 'split__b' where flow_slug = 'split' and step_slug = 'b';",
    )
    .await;
    register_worker(pool).await;
    let err = sqlx::query("select * from pgflow.start_tasks('split', array[1]::bigint[], $1)")
        .bind(WORKER)
        .execute(pool)
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("sends its tasks to 2 queues"),
        "{err}"
    );
}

#[tokio::test]
async fn queue_name_and_message_id_identify_one_task() {
    let db = test_db().await;
    let pool = db.pool();
    exec(pool, "select pgflow.create_flow('uniq'); select pgflow.add_step('uniq', 'a', step_type => 'map');").await;
    let run: Uuid = start(pool, "uniq", json!([1, 2])).await;
    let err = exec_err(
        pool,
        &format!(
            "update pgflow.step_tasks set message_id = (select min(message_id) from pgflow.step_tasks)
             where run_id = '{run}' and task_index = 1"
        ),
    )
    .await;
    assert!(
        err.contains("step_tasks_queue_name_message_id_key"),
        "{err}"
    );
}

#[tokio::test]
async fn flow_slugs_that_differ_only_in_case_are_rejected() {
    let db = test_db().await;
    let pool = db.pool();
    exec(pool, "select pgflow.create_flow('Orders')").await;
    let err = exec_err(pool, "select pgflow.create_flow('orders')").await;
    assert_eq!(
        err,
        "flow slug \"orders\" differs only in case from existing flow \"Orders\""
    );
    exec(pool, "select pgflow.create_flow('Orders')").await; // the exact slug stays idempotent
    let queues: i64 =
        sqlx::query_scalar("select count(*) from pgmq.meta where lower(queue_name) = 'orders'")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(queues, 1);
}

#[tokio::test]
async fn flow_slug_longer_than_47_characters_gets_a_pgflow_error_naming_the_flow_and_the_limit() {
    let db = test_db().await;
    let pool = db.pool();
    let slug = "a".repeat(48);
    let err = sqlx::query("select pgflow.create_flow($1)")
        .bind(&slug)
        .execute(pool)
        .await
        .unwrap_err();
    let db_err = err.as_database_error().unwrap();
    let pg = db_err
        .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
        .unwrap();
    assert!(pg.message().contains(&slug), "{}", pg.message());
    assert!(pg.message().contains("47"), "{}", pg.message());
    assert!(
        pg.hint()
            .unwrap_or_default()
            .contains("Shorten the flow slug"),
        "{:?}",
        pg.hint()
    );
    let flows: i64 = sqlx::query_scalar("select count(*) from pgflow.flows")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(flows, 0, "nothing is created");

    exec(
        pool,
        &format!("select pgflow.create_flow('{}')", "b".repeat(47)),
    )
    .await;
}
