//! `start_flows`: many runs of one flow in one call, each started exactly as `start_flow` starts one.

use crate::support::*;
use pgflow_sql::SqlState;
use pgflow_tests::test_db;
use serde_json::{json, Value};
use sqlx::PgPool;
use uuid::Uuid;

/// A run's whole state as one document: the run, its step states and tasks, and its messages.
async fn snapshot(pool: &PgPool, flow: &str, run: Uuid) -> Value {
    sqlx::query_scalar(&format!(
        "select jsonb_build_object(
           'run', (select jsonb_build_object('status', r.status, 'input', r.input, 'output', r.output,
                                             'remaining_steps', r.remaining_steps)
                   from pgflow.runs r where r.run_id = $1),
           'steps', (select jsonb_agg(jsonb_build_object('step', s.step_slug, 'status', s.status,
                                       'remaining_deps', s.remaining_deps, 'initial_tasks', s.initial_tasks,
                                       'remaining_tasks', s.remaining_tasks, 'skip_reason', s.skip_reason,
                                       'output', s.output, 'started', s.started_at is not null)
                                     order by s.step_slug)
                     from pgflow.step_states s where s.run_id = $1),
           'tasks', (select jsonb_agg(jsonb_build_object('step', t.step_slug, 'index', t.task_index,
                                       'status', t.status, 'element', t.element,
                                       'message', (select m.message - 'run_id' from pgmq.q_{flow} m where m.msg_id = t.message_id))
                                     order by t.step_slug, t.task_index)
                     from pgflow.step_tasks t where t.run_id = $1))"
    ))
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Root map `m`, root single `a`, and `b` after both.
async fn mixed_flow(pool: &PgPool) {
    exec(
        pool,
        "select pgflow.create_flow('mixed');
         select pgflow.add_step('mixed', 'm', step_type => 'map');
         select pgflow.add_step('mixed', 'a');
         select pgflow.add_step('mixed', 'b', array['m', 'a']);",
    )
    .await;
}

async fn start_many(pool: &PgPool, flow: &str, inputs: &[Value]) -> Vec<Uuid> {
    sqlx::query_scalar("select run_id from pgflow.start_flows($1, $2)")
        .bind(flow)
        .bind(inputs)
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Starts `inputs` together, then each alone, and compares each pair of runs' whole state.
async fn same_as_one_by_one(pool: &PgPool, flow: &str, inputs: &[Value]) -> Vec<Value> {
    let together = start_many(pool, flow, inputs).await;
    assert_eq!(together.len(), inputs.len());
    let mut states = Vec::new();
    for (run, input) in together.iter().zip(inputs) {
        let alone = start(pool, flow, input.clone()).await;
        let state = snapshot(pool, flow, *run).await;
        assert_eq!(state, snapshot(pool, flow, alone).await, "input {input}");
        states.push(state);
    }
    states
}

fn step_status_in(state: &Value, step: &str) -> String {
    let found = state["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["step"] == step);
    found.unwrap()["status"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn each_run_started_together_is_the_run_start_flow_starts() {
    let db = test_db().await;
    let pool = db.pool();
    mixed_flow(pool).await;
    // A plain start, an empty root map (the cascade: the map completes at once with []), another plain one.
    let states = same_as_one_by_one(pool, "mixed", &[json!([1, 2]), json!([]), json!([3])]).await;
    assert_eq!(step_status_in(&states[0], "m"), "started");
    assert_eq!(step_status_in(&states[1], "m"), "completed");
}

#[tokio::test]
async fn runs_whose_root_condition_needs_the_cascade_start_as_start_flow_starts_them() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('gated');
         select pgflow.add_step('gated', 'a', required_input_pattern => '{\"go\": true}', when_unmet => 'skip');
         select pgflow.add_step('gated', 'b', array['a']);
         select pgflow.add_step('gated', 'c');",
    )
    .await;
    let inputs = [json!({"go": true}), json!({"go": false}), json!({})];
    let states = same_as_one_by_one(pool, "gated", &inputs).await;
    assert_eq!(step_status_in(&states[0], "a"), "started");
    assert_eq!(step_status_in(&states[1], "a"), "skipped");
    assert_eq!(step_status_in(&states[2], "c"), "started");
}

#[tokio::test]
async fn run_ids_are_kept_in_input_order_and_the_runs_complete() {
    let db = test_db().await;
    let pool = db.pool();
    mixed_flow(pool).await;
    let (first, last) = (Uuid::new_v4(), Uuid::new_v4());
    let runs: Vec<(Uuid, Value)> = sqlx::query_as(
        "select run_id, input from pgflow.start_flows('mixed', $1, array[$2, null, $3]::uuid[])",
    )
    .bind([json!([1]), json!([2]), json!([3])])
    .bind(first)
    .bind(last)
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(runs[0], (first, json!([1])));
    assert_eq!(runs[1].1, json!([2]));
    assert_eq!(runs[2], (last, json!([3])));

    let tasks = claim(pool, "mixed", "mixed", 10).await;
    assert_eq!(tasks.len(), 6, "a map task and an `a` task per run");
    for t in &tasks {
        complete(
            pool,
            t.run_id,
            &t.step_slug,
            t.task_index,
            json!(t.task_index),
        )
        .await;
    }
    for t in claim(pool, "mixed", "mixed", 10).await {
        complete(pool, t.run_id, &t.step_slug, t.task_index, json!("b")).await;
    }
    for (run, _) in &runs {
        assert_eq!(run_status(pool, *run).await, "completed");
    }
}

#[tokio::test]
async fn bad_input_names_its_position_and_starts_no_run() {
    let db = test_db().await;
    let pool = db.pool();
    mixed_flow(pool).await;
    let err = sqlx::query("select pgflow.start_flows('mixed', $1)")
        .bind([json!([1]), json!({"not": "an array"}), json!([2])])
        .execute(pool)
        .await
        .unwrap_err();
    assert_eq!(
        err.as_database_error().unwrap().message(),
        "Flow mixed has root map steps but input is not an array (got object) (input 2 of 3)"
    );
    let err = sqlx::query("select pgflow.start_flows('mixed', array['[1]'::jsonb, null])")
        .execute(pool)
        .await
        .unwrap_err();
    assert_eq!(
        err.as_database_error().unwrap().message(),
        "Flow mixed has root map steps but input is NULL (input 2 of 2)"
    );
    // One input: start_flow's own messages, unchanged.
    assert_eq!(
        exec_err(pool, "select pgflow.start_flow('mixed', '{}')").await,
        "Flow mixed has root map steps but input is not an array (got object)"
    );
    assert_eq!(
        exec_err(pool, "select pgflow.start_flows('mixed', array['[1]'::jsonb], array[]::uuid[])").await,
        "start_flows(mixed): 0 run ids for 1 inputs; pass one run id (or NULL) per input, or no run ids"
    );
    assert_eq!(
        exec_err(pool, "select pgflow.start_flows('mixed', null)").await,
        "start_flows(mixed): inputs is NULL; pass an array with one input per run"
    );
    let runs: i64 = sqlx::query_scalar("select count(*) from pgflow.runs")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(runs, 0, "no run of a failed call exists");
    assert_eq!(live_messages(pool, "mixed").await, 0);

    let none: Vec<Uuid> =
        sqlx::query_scalar("select run_id from pgflow.start_flows('mixed', '{}')")
            .fetch_all(pool)
            .await
            .unwrap();
    assert!(none.is_empty(), "no inputs, no runs");
}

#[tokio::test]
async fn a_duplicate_run_id_fails_the_whole_call() {
    let db = test_db().await;
    let pool = db.pool();
    mixed_flow(pool).await;
    let id = Uuid::new_v4();
    let err = sqlx::query("select pgflow.start_flows('mixed', $1, array[$2, $2]::uuid[])")
        .bind([json!([1]), json!([2])])
        .bind(id)
        .execute(pool)
        .await
        .unwrap_err();
    assert_eq!(SqlState::of(&err), Some(SqlState::UniqueViolation));
    assert_eq!(live_messages(pool, "mixed").await, 0);
}

#[tokio::test]
async fn each_run_started_together_sends_its_own_run_started_event() {
    let db = test_db().await;
    let pool = db.pool();
    mixed_flow(pool).await;
    let runs = [Uuid::new_v4(), Uuid::new_v4()];
    let mut listener = sqlx::postgres::PgListener::connect(db.url()).await.unwrap();
    for run in runs {
        listener
            .listen(&format!("pgflow_run_{}", run.simple()))
            .await
            .unwrap();
        sqlx::query("select pgflow.watch_run($1)")
            .bind(run)
            .execute(&mut listener)
            .await
            .unwrap();
    }
    sqlx::query("select pgflow.start_flows('mixed', $1, $2)")
        .bind([json!([1]), json!([2])])
        .bind(runs)
        .execute(pool)
        .await
        .unwrap();
    let mut seen = Vec::new();
    for _ in 0..2 {
        let note = tokio::time::timeout(std::time::Duration::from_secs(10), listener.recv())
            .await
            .expect("an event within 10 s")
            .unwrap();
        let payload: Value = serde_json::from_str(note.payload()).unwrap();
        assert_eq!(payload["event"], "run:started");
        seen.push(payload["run_id"].as_str().unwrap().parse::<Uuid>().unwrap());
    }
    assert_eq!(seen, runs, "one event per run, in input order");
}
