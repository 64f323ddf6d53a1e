//! Set-based completion: one complete_tasks call over several runs, steps and queues gives exactly the
//! results the single-task calls give one by one.

use crate::step_support::*;
use crate::support::*;
use pgflow_tests::test_db;
use serde_json::{json, Value};
use sqlx::PgPool;
use uuid::Uuid;

/// diamond: a -> (b, c) -> d, plus a map over a's array output and a root step, in flow mode.
async fn setup(pool: &PgPool) -> Uuid {
    exec(
        pool,
        "select pgflow.create_flow('batch');
         select pgflow.add_step('batch', 'a');
         select pgflow.add_step('batch', 'b', array['a']);
         select pgflow.add_step('batch', 'c', array['a']);
         select pgflow.add_step('batch', 'd', array['b', 'c']);
         select pgflow.add_step('batch', 'each', array['a'], step_type => 'map');",
    )
    .await;
    let worker = Uuid::new_v4();
    register(pool, worker, "batch", "batch", "batch", None).await;
    worker
}

/// Claims every visible message of the queue for `worker`; returns (run, step, index, attempt) per task.
async fn claim_all(pool: &PgPool, worker: Uuid) -> Vec<(Uuid, String, i32, i32)> {
    let msgs = read(pool, "batch", 100).await;
    let result = claim_tasks(pool, "batch", "batch", None, &msgs, worker).await;
    result["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                serde_json::from_value(t["run_id"].clone()).unwrap(),
                t["step_slug"].as_str().unwrap().to_owned(),
                t["task_index"].as_i64().unwrap() as i32,
                t["attempts_count"].as_i64().unwrap() as i32,
            )
        })
        .collect()
}

async fn complete_batch(
    pool: &PgPool,
    worker: Uuid,
    items: &[(Uuid, String, i32, i32, Value)],
) -> Vec<(Uuid, String, i32, String, String)> {
    let runs: Vec<Uuid> = items.iter().map(|i| i.0).collect();
    let steps: Vec<&str> = items.iter().map(|i| i.1.as_str()).collect();
    let indexes: Vec<i32> = items.iter().map(|i| i.2).collect();
    let attempts: Vec<i32> = items.iter().map(|i| i.3).collect();
    let outputs: Vec<&Value> = items.iter().map(|i| &i.4).collect();
    sqlx::query_as(
        "select run_id, step_slug, task_index, outcome, status from pgflow.complete_tasks(
           run_ids => $1, step_slugs => $2, task_indexes => $3, outputs => $4, attempts => $5, worker_id => $6)",
    )
    .bind(&runs)
    .bind(&steps)
    .bind(&indexes)
    .bind(&outputs)
    .bind(&attempts)
    .bind(worker)
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn one_batch_over_many_runs_completes_steps_releases_dependents_and_finishes_runs() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let runs = [
        start(pool, "batch", json!({"n": 1})).await,
        start(pool, "batch", json!({"n": 2})).await,
    ];
    // Both runs' `a` in one batch: each releases b, c and a two-element map.
    let items: Vec<_> = claim_all(pool, worker)
        .await
        .into_iter()
        .map(|(r, s, i, a)| (r, s, i, a, json!([10, 20])))
        .collect();
    assert_eq!(items.len(), 2);
    let outcomes = complete_batch(pool, worker, &items).await;
    assert!(
        outcomes
            .iter()
            .all(|o| o.3 == "applied" && o.4 == "completed"),
        "{outcomes:?}"
    );
    for run in runs {
        assert_eq!(task_statuses(pool, run, "each").await, ["queued", "queued"]);
        assert_eq!(step_status(pool, run, "b").await, "started");
        assert_eq!(step_status(pool, run, "d").await, "created");
    }

    // Everything claimable of both runs in one batch: b, c and both map elements of each run, plus a duplicate
    // item and one with a wrong attempt. d becomes ready in both runs within the same call.
    let mut items: Vec<_> = claim_all(pool, worker)
        .await
        .into_iter()
        .map(|(r, s, i, a)| {
            let out = json!({"step": s, "index": i});
            (r, s, i, a, out)
        })
        .collect();
    assert_eq!(items.len(), 8);
    let dup = items[0].clone();
    let mut wrong = items[1].clone();
    wrong.3 += 5;
    items.push(dup);
    items.insert(0, wrong);
    let outcomes = complete_batch(pool, worker, &items).await;
    assert_eq!(outcomes.len(), 10);
    assert_eq!(
        outcomes[0].3, "stale",
        "the wrong attempt comes first and changes nothing"
    );
    assert_eq!(outcomes[9].3, "stale", "the duplicate is applied once");
    assert_eq!(outcomes.iter().filter(|o| o.3 == "applied").count(), 8);
    for run in runs {
        assert_eq!(step_status(pool, run, "each").await, "completed");
        assert_eq!(task_statuses(pool, run, "d").await, ["queued"]);
        let each: Value = sqlx::query_scalar(
            "select output from pgflow.step_states where run_id = $1 and step_slug = 'each'",
        )
        .bind(run)
        .fetch_one(pool)
        .await
        .unwrap();
        assert_eq!(
            each,
            json!([{"step": "each", "index": 0}, {"step": "each", "index": 1}])
        );
    }

    // The last step of both runs in one batch finishes both runs with their leaf outputs.
    let items: Vec<_> = claim_all(pool, worker)
        .await
        .into_iter()
        .map(|(r, s, i, a)| (r, s, i, a, json!("done")))
        .collect();
    complete_batch(pool, worker, &items).await;
    for run in runs {
        assert_eq!(run_status(pool, run).await, "completed");
        assert_eq!(
            run_output(pool, run).await,
            Some(
                json!({"d": "done", "each": [{"step": "each", "index": 0}, {"step": "each", "index": 1}]})
            )
        );
        assert_eq!(active_tasks(pool, run).await, 0);
    }
    assert_eq!(live_messages(pool, "batch").await, 0);
}

#[tokio::test]
async fn a_type_violation_inside_a_batch_fails_only_its_run() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let bad = start(pool, "batch", json!({})).await;
    let good = start(pool, "batch", json!({})).await;
    let items: Vec<_> = claim_all(pool, worker)
        .await
        .into_iter()
        .map(|(r, s, i, a)| {
            let out = if r == bad {
                json!({"not": "an array"})
            } else {
                json!([1])
            };
            (r, s, i, a, out)
        })
        .collect();
    let outcomes = complete_batch(pool, worker, &items).await;
    assert!(outcomes.iter().all(|o| o.3 == "applied"), "{outcomes:?}");
    assert_eq!(run_status(pool, bad).await, "failed");
    assert_eq!(task_statuses(pool, bad, "a").await, ["failed"]);
    assert_eq!(run_status(pool, good).await, "started");
    assert_eq!(task_statuses(pool, good, "each").await, ["queued"]);
}
