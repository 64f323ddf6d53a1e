//! Flow shapes end to end: linear, diamond, root map, dependent map, map to map, empty map.

use crate::support::*;
use pgflow_tests::test_db;
use serde_json::json;

#[tokio::test]
async fn linear_flow_passes_each_output_to_the_next_step_and_completes_with_the_leaf_output() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('linear');
         select pgflow.add_step('linear', 'first');
         select pgflow.add_step('linear', 'second', array['first']);
         select pgflow.add_step('linear', 'last', array['second']);",
    )
    .await;
    let run = start(pool, "linear", json!({"n": 1})).await;

    let tasks = claim(pool, "linear", "linear", 10).await;
    assert_eq!(tasks.len(), 1);
    assert_eq!(tasks[0].step_slug, "first");
    assert_eq!(tasks[0].input, Some(json!({})));
    assert_eq!(tasks[0].run_id, run);
    assert_eq!(
        tasks[0].flow_input,
        Some(json!({"n": 1})),
        "root single steps get the run input"
    );
    complete(pool, run, "first", 0, json!("one")).await;

    let tasks = claim(pool, "linear", "linear", 10).await;
    assert_eq!(tasks[0].step_slug, "second");
    assert_eq!(tasks[0].input, Some(json!({"first": "one"})));
    assert_eq!(
        tasks[0].flow_input, None,
        "dependent steps load the run input lazily"
    );
    complete(pool, run, "second", 0, json!("two")).await;

    let tasks = claim(pool, "linear", "linear", 10).await;
    assert_eq!(tasks[0].input, Some(json!({"second": "two"})));
    assert_eq!(run_status(pool, run).await, "started");
    complete(pool, run, "last", 0, json!({"done": true})).await;

    assert_eq!(run_status(pool, run).await, "completed");
    assert_eq!(
        run_output(pool, run).await,
        Some(json!({"last": {"done": true}}))
    );
    assert_eq!(
        live_messages(pool, "linear").await,
        0,
        "every message is archived"
    );
}

#[tokio::test]
async fn diamond_join_starts_only_after_both_parents_and_receives_both_outputs() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('diamond');
         select pgflow.add_step('diamond', 'a');
         select pgflow.add_step('diamond', 'b', array['a']);
         select pgflow.add_step('diamond', 'c', array['a']);
         select pgflow.add_step('diamond', 'd', array['b', 'c']);",
    )
    .await;
    let run = start(pool, "diamond", json!({})).await;
    claim(pool, "diamond", "diamond", 10).await;
    complete(pool, run, "a", 0, json!(1)).await;

    let tasks = claim(pool, "diamond", "diamond", 10).await;
    let slugs: Vec<_> = tasks.iter().map(|t| t.step_slug.as_str()).collect();
    assert_eq!(slugs, ["b", "c"]);
    assert!(tasks.iter().all(|t| t.input == Some(json!({"a": 1}))));

    complete(pool, run, "b", 0, json!("B")).await;
    assert_eq!(step_status(pool, run, "d").await, "created");
    complete(pool, run, "c", 0, json!("C")).await;

    let tasks = claim(pool, "diamond", "diamond", 10).await;
    assert_eq!(tasks[0].step_slug, "d");
    assert_eq!(tasks[0].input, Some(json!({"b": "B", "c": "C"})));
    complete(pool, run, "d", 0, json!("D")).await;
    assert_eq!(run_output(pool, run).await, Some(json!({"d": "D"})));
}

#[tokio::test]
async fn root_map_runs_one_task_per_element_and_orders_outputs_by_task_index() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('rootmap');
         select pgflow.add_step('rootmap', 'each', step_type => 'map');",
    )
    .await;
    let run = start(pool, "rootmap", json!([10, null, "x"])).await;
    let tasks = claim(pool, "rootmap", "rootmap", 10).await;
    let inputs: Vec<_> = tasks
        .iter()
        .map(|t| (t.task_index, t.input.clone()))
        .collect();
    assert_eq!(
        inputs,
        [
            (0, Some(json!(10))),
            (1, Some(json!(null))),
            (2, Some(json!("x")))
        ]
    );
    assert!(tasks.iter().all(|t| t.flow_input.is_none()));

    complete(pool, run, "each", 2, json!("third")).await;
    complete(pool, run, "each", 0, json!("first")).await;
    assert_eq!(step_status(pool, run, "each").await, "started");
    complete(pool, run, "each", 1, json!(null)).await;

    let output: serde_json::Value = sqlx::query_scalar(
        "select output from pgflow.step_states where run_id = $1 and step_slug = 'each'",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(output, json!(["first", null, "third"]));
    assert_eq!(
        run_output(pool, run).await,
        Some(json!({"each": ["first", null, "third"]}))
    );
}

#[tokio::test]
async fn dependent_map_iterates_the_array_its_single_parent_produced() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('depmap');
         select pgflow.add_step('depmap', 'list');
         select pgflow.add_step('depmap', 'each', array['list'], step_type => 'map');
         select pgflow.add_step('depmap', 'sum', array['each']);",
    )
    .await;
    let run = start(pool, "depmap", json!({})).await;
    let initial: Option<i32> = sqlx::query_scalar(
        "select initial_tasks from pgflow.step_states where run_id = $1 and step_slug = 'each'",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        initial, None,
        "a dependent map's task count is unknown until its parent completes"
    );

    claim(pool, "depmap", "depmap", 10).await;
    complete(pool, run, "list", 0, json!([1, 2])).await;
    let tasks = claim(pool, "depmap", "depmap", 10).await;
    let inputs: Vec<_> = tasks.iter().map(|t| t.input.clone()).collect();
    assert_eq!(inputs, [Some(json!(1)), Some(json!(2))]);
    complete(pool, run, "each", 0, json!(2)).await;
    complete(pool, run, "each", 1, json!(4)).await;

    let tasks = claim(pool, "depmap", "depmap", 10).await;
    assert_eq!(tasks[0].input, Some(json!({"each": [2, 4]})));
}

#[tokio::test]
async fn map_after_map_gives_task_i_the_element_i_of_the_parent_output() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('mapmap');
         select pgflow.add_step('mapmap', 'one', step_type => 'map');
         select pgflow.add_step('mapmap', 'two', array['one'], step_type => 'map');",
    )
    .await;
    let run = start(pool, "mapmap", json!(["a", "b", "c"])).await;
    claim(pool, "mapmap", "mapmap", 10).await;
    for (i, out) in ["A", "B", "C"].iter().enumerate() {
        complete(pool, run, "one", i as i32, json!(out)).await;
    }
    let tasks = claim(pool, "mapmap", "mapmap", 10).await;
    let inputs: Vec<_> = tasks.iter().map(|t| t.input.clone().unwrap()).collect();
    assert_eq!(inputs, [json!("A"), json!("B"), json!("C")]);
}

#[tokio::test]
async fn empty_root_map_completes_at_start_and_map_dependents_complete_with_empty_arrays() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('empty');
         select pgflow.add_step('empty', 'each', step_type => 'map');
         select pgflow.add_step('empty', 'again', array['each'], step_type => 'map');
         select pgflow.add_step('empty', 'report', array['again']);",
    )
    .await;
    let run = start(pool, "empty", json!([])).await;
    assert_eq!(step_status(pool, run, "each").await, "completed");
    assert_eq!(step_status(pool, run, "again").await, "completed");
    let tasks = claim(pool, "empty", "empty", 10).await;
    assert_eq!(tasks.len(), 1);
    assert_eq!(tasks[0].input, Some(json!({"again": []})));
    complete(pool, run, "report", 0, json!("nothing")).await;
    assert_eq!(run_status(pool, run).await, "completed");
}

#[tokio::test]
async fn flow_made_only_of_an_empty_map_completes_inside_start_flow() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('only_empty');
         select pgflow.add_step('only_empty', 'each', step_type => 'map');",
    )
    .await;
    let run = start(pool, "only_empty", json!([])).await;
    assert_eq!(run_status(pool, run).await, "completed");
    assert_eq!(run_output(pool, run).await, Some(json!({"each": []})));
}

#[tokio::test]
async fn root_map_flow_rejects_null_and_non_array_input() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('needs_array');
         select pgflow.add_step('needs_array', 'each', step_type => 'map');",
    )
    .await;
    let err = exec_err(pool, "select pgflow.start_flow('needs_array', null)").await;
    assert_eq!(err, "Flow needs_array has root map steps but input is NULL");
    let err = exec_err(
        pool,
        "select pgflow.start_flow('needs_array', '{\"a\": 1}')",
    )
    .await;
    assert_eq!(
        err,
        "Flow needs_array has root map steps but input is not an array (got object)"
    );
    let err = exec_err(
        pool,
        "select pgflow.start_flow('needs_array', 'null'::jsonb)",
    )
    .await;
    assert_eq!(
        err,
        "Flow needs_array has root map steps but input is not an array (got null)"
    );
}

#[tokio::test]
async fn starting_an_unknown_flow_or_reusing_a_run_id_fails() {
    let db = test_db().await;
    let pool = db.pool();
    let err = exec_err(pool, "select pgflow.start_flow('nope', '{}')").await;
    assert!(err.contains("runs_flow_slug_fkey"), "{err}");

    exec(
        pool,
        "select pgflow.create_flow('dup'); select pgflow.add_step('dup', 'a');",
    )
    .await;
    exec(
        pool,
        "select pgflow.start_flow('dup', '{}', '00000000-0000-0000-0000-000000000001')",
    )
    .await;
    let err = exec_err(
        pool,
        "select pgflow.start_flow('dup', '{}', '00000000-0000-0000-0000-000000000001')",
    )
    .await;
    assert!(err.contains("runs_pkey"), "{err}");
}

#[tokio::test]
async fn flow_without_steps_completes_immediately_with_null_output() {
    let db = test_db().await;
    let pool = db.pool();
    exec(pool, "select pgflow.create_flow('nothing')").await;
    let run = start(pool, "nothing", json!({})).await;
    assert_eq!(run_status(pool, run).await, "completed");
    assert_eq!(run_output(pool, run).await, None);
}

#[tokio::test]
async fn start_delay_keeps_the_first_messages_invisible() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('delayed');
         select pgflow.add_step('delayed', 'later', start_delay => 120);",
    )
    .await;
    start(pool, "delayed", json!({})).await;
    let msg_id: i64 = sqlx::query_scalar("select msg_id from pgmq.q_delayed")
        .fetch_one(pool)
        .await
        .unwrap();
    let secs = seconds_until_visible(pool, "delayed", msg_id).await;
    assert!((100.0..=121.0).contains(&secs), "visible in {secs}s");
    assert!(claim(pool, "delayed", "delayed", 10).await.is_empty());
}

#[tokio::test]
async fn start_flow_with_states_returns_the_run_and_all_step_states() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('states');
         select pgflow.add_step('states', 'a');
         select pgflow.add_step('states', 'b', array['a']);",
    )
    .await;
    let doc: serde_json::Value = sqlx::query_scalar(
        "select pgflow.start_flow_with_states(flow_slug => 'states', input => '{\"k\": 1}')",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(doc["run"]["status"], "started");
    assert_eq!(doc["run"]["input"], json!({"k": 1}));
    assert_eq!(doc["steps"].as_array().unwrap().len(), 2);

    let unknown: Option<serde_json::Value> =
        sqlx::query_scalar("select pgflow.get_run_with_states(gen_random_uuid())")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(unknown, None);
}

#[tokio::test]
async fn a_chain_of_fifty_empty_maps_exceeds_the_cascade_safety_limit() {
    let db = test_db().await;
    let pool = db.pool();
    let mut sql = String::from(
        "select pgflow.create_flow('deep'); select pgflow.add_step('deep', 'm0', step_type => 'map');",
    );
    for i in 1..50 {
        sql.push_str(&format!(
            "select pgflow.add_step('deep', 'm{i}', array['m{}'], step_type => 'map');",
            i - 1
        ));
    }
    exec(pool, &sql).await;
    let err = exec_err(pool, "select pgflow.start_flow('deep', '[]')").await;
    assert_eq!(err, "Cascade loop exceeded safety limit of 50 iterations");
    let runs: i64 = sqlx::query_scalar("select count(*) from pgflow.runs")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(runs, 0, "start_flow rolled back");

    // One map fewer completes inside start_flow.
    exec(pool, "select pgflow.delete_flow_and_data('deep')").await;
    let mut sql = String::from(
        "select pgflow.create_flow('deep'); select pgflow.add_step('deep', 'm0', step_type => 'map');",
    );
    for i in 1..49 {
        sql.push_str(&format!(
            "select pgflow.add_step('deep', 'm{i}', array['m{}'], step_type => 'map');",
            i - 1
        ));
    }
    exec(pool, &sql).await;
    let run = start(pool, "deep", json!([])).await;
    assert_eq!(run_status(pool, run).await, "completed");
}

#[tokio::test]
async fn run_functions_called_directly_leave_terminal_runs_alone() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('direct', max_attempts => 1);
         select pgflow.add_step('direct', 'a');
         select pgflow.add_step('direct', 'b');",
    )
    .await;
    let run = start(pool, "direct", json!({})).await;
    claim(pool, "direct", "direct", 1).await;
    fail(pool, run, "a", 0, "boom").await;
    exec(
        pool,
        &format!(
            "select pgflow.start_ready_steps('{run}');
             select pgflow.maybe_complete_run('{run}');
             select pgflow.cascade_complete_taskless_steps('{run}');"
        ),
    )
    .await;
    let resolved: bool = sqlx::query_scalar("select pgflow.cascade_resolve_conditions($1)")
        .bind(run)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(!resolved, "a failed run cannot continue");
    assert_eq!(run_status(pool, run).await, "failed");
    assert_eq!(active_tasks(pool, run).await, 0);
}

#[tokio::test]
async fn archive_task_message_archives_only_that_task_message() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('arch'); select pgflow.add_step('arch', 'each', step_type => 'map');",
    )
    .await;
    let run = start(pool, "arch", json!([1, 2])).await;
    exec(
        pool,
        &format!("select pgflow._archive_task_message(p_run_id => '{run}', p_step_slug => 'each', p_task_index => 1)"),
    )
    .await;
    let archived: Vec<i32> = sqlx::query_scalar(
        "select t.task_index from pgmq.a_arch a join pgflow.step_tasks t on t.message_id = a.msg_id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(archived, [1]);
    assert_eq!(live_messages(pool, "arch").await, 1);
}
