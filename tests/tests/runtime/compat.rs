//! Compatibility: runs started by hand in SQL, shape verification, mismatches, schema checks.

use pgflow_runtime::{
    flow, worker::AliasActivation, worker::Compilation, worker::CompileStatus, worker::WorkerError,
    Client, Flow, StepError, Worker,
};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::support;
use crate::support::Bounded;

#[flow(slug = "compatFlow", input = String, max_attempts = 2, timeout = 30)]
mod original {
    use super::*;

    #[step]
    async fn upper(s: String) -> Result<String, StepError> {
        Ok(s.to_uppercase())
    }

    #[step(depends_on = [upper], timeout = 5)]
    async fn exclaim(upper: String) -> Result<String, StepError> {
        Ok(format!("{upper}!"))
    }
}

#[flow(slug = "compatFlow", input = String)]
mod changed {
    use super::*;

    #[step]
    async fn lower(s: String) -> Result<String, StepError> {
        Ok(s.to_lowercase())
    }
}

#[tokio::test]
async fn a_run_started_by_hand_in_sql_is_executed() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn::<original::Original>(pool).await;
    support::wait_for_workers(pool, 1).await;
    let run_id = pgflow_tests::state::start(pool, "compatFlow", json!("hey")).await;
    assert_eq!(support::wait_finished(pool, run_id).await, "completed");
    assert_eq!(
        support::run_output(pool, run_id).await,
        Some(json!({"exclaim": "HEY!"}))
    );
    worker.stop().await;
}

#[tokio::test]
async fn the_macro_shape_is_verified_against_a_database_compiled_from_the_same_flow() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let first = support::spawn::<original::Original>(pool)
        .await
        .stop()
        .await;
    assert_eq!(first.compile_status, CompileStatus::Compiled);
    let stored: Value = sqlx::query_scalar("select pgflow._get_flow_shape('compatFlow')")
        .fetch_one(pool)
        .await
        .unwrap();
    // Options are not part of the stored shape (upstream compares structure only).
    let mut ours = original::Original::shape()["steps"].clone();
    for step in ours.as_array_mut().unwrap() {
        step.as_object_mut().unwrap().remove("options");
    }
    assert_eq!(stored["steps"], ours);
    let second = support::spawn::<original::Original>(pool)
        .await
        .stop()
        .await;
    assert_eq!(second.compile_status, CompileStatus::Verified);
}

#[tokio::test]
async fn a_different_stored_flow_refuses_to_start_listing_the_differences() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    support::spawn::<original::Original>(pool)
        .await
        .stop()
        .await;
    let err = support::fast(Worker::<changed::Changed>::builder(pool.clone()))
        .run(CancellationToken::new())
        .bounded()
        .await
        .unwrap_err();
    let WorkerError::ShapeMismatch {
        flow_slug,
        differences,
    } = &err
    else {
        panic!("expected a mismatch, got {err}");
    };
    assert_eq!(flow_slug, "compatFlow");
    assert!(!differences.is_empty());
    assert!(err.to_string().contains(&differences[0]), "{err}");
    let workers: i64 =
        sqlx::query_scalar("select count(*) from pgflow.workers where stopped_at is null")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(
        workers, 0,
        "nothing registered before compilation succeeded"
    );

    let report = support::fast(Worker::<changed::Changed>::builder(pool.clone()))
        .compilation(Compilation::AllowDataLoss)
        .build()
        .unwrap();
    let token = CancellationToken::new();
    token.cancel();
    assert_eq!(
        report.run(token).bounded().await.unwrap().compile_status,
        CompileStatus::Recompiled
    );
}

#[tokio::test]
async fn a_database_without_pgflow_is_refused_unless_auto_install_is_on() {
    let db = pgflow_tests::db_with(pgflow_tests::Contents::Pgmq).await;
    let pool = db.pool();
    let err = support::fast(Worker::<original::Original>::builder(pool.clone()))
        .run(CancellationToken::new())
        .bounded()
        .await
        .unwrap_err();
    assert!(matches!(err, WorkerError::SchemaMissing { .. }), "{err}");
    let token = CancellationToken::new();
    token.cancel();
    let report = support::fast(Worker::<original::Original>::builder(pool.clone()))
        .auto_install(true)
        .run(token)
        .bounded()
        .await
        .unwrap();
    assert_eq!(report.compile_status, CompileStatus::Compiled);
}

#[tokio::test]
async fn the_step_timeout_comes_from_the_database_at_startup() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    support::spawn::<original::Original>(pool)
        .await
        .stop()
        .await;
    let timeouts: Vec<(String, i32)> = sqlx::query_as(
        "select s.step_slug, coalesce(s.opt_timeout, f.opt_timeout) from pgflow.steps s \
         join pgflow.flows f using (flow_slug) where flow_slug = 'compatFlow' order by step_index",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(timeouts, [("upper".into(), 30), ("exclaim".into(), 5)]);
}

/// A plain worker classifies its batches too: a message in the flow's queue that belongs to no task of
/// the flow stops it, with nothing claimed, no attempt used and the batch visible again.
#[tokio::test]
async fn a_foreign_message_in_a_plain_flow_queue_stops_the_worker_without_mutation() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    // Compile the flow, then queue a real run and a foreign message in its queue.
    sqlx::query("select pgflow.ensure_flow_compiled('compatFlow', $1)")
        .bind(original::Original::shape())
        .execute(pool)
        .await
        .unwrap();
    let run_id = pgflow_tests::state::start(pool, "compatFlow", json!("hey")).await;
    let foreign: i64 =
        sqlx::query_scalar("select pgmq.send('compatflow', '{\"not\": \"a task\"}'::jsonb)")
            .fetch_one(pool)
            .await
            .unwrap();

    let err = support::fast(Worker::<original::Original>::builder(pool.clone()))
        .run(CancellationToken::new())
        .bounded()
        .await
        .unwrap_err();
    let WorkerError::Unsupported(batch) = &err else {
        panic!("expected an unsupported batch, got {err}");
    };
    assert_eq!(batch.queue, "compatflow");
    assert!(batch.msg_ids.contains(&foreign), "{:?}", batch.msg_ids);
    let (status, attempts, _) = support::task(pool, run_id, "upper", 0).await;
    assert_eq!((status.as_str(), attempts), ("queued", 0));
    let hidden: i64 =
        sqlx::query_scalar("select count(*) from pgmq.q_compatflow where vt > clock_timestamp()")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(hidden, 0, "the whole batch is visible again");
}

/// A plain worker is a one-deployment registry: its flow is the default deployment (no alias, every step on
/// the flow's queue), started by its concrete slug with no alias row involved.
#[tokio::test]
async fn a_plain_flow_started_by_its_concrete_slug_runs_with_no_alias_row_involved() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn::<original::Original>(pool).await;
    let status = &worker.deployments()[0];
    assert_eq!(worker.deployments().len(), 1);
    assert_eq!(status.flow_slug, "compatFlow");
    assert_eq!(status.steps, ["upper", "exclaim"]);
    assert_eq!(status.compile_status, CompileStatus::Compiled);
    assert_eq!(status.alias, AliasActivation::None);
    assert_eq!(
        support::registered_pairs(pool, worker.id()).await,
        [
            ("compatFlow".to_owned(), "exclaim".to_owned()),
            ("compatFlow".to_owned(), "upper".to_owned()),
        ]
    );
    let run = Client::new(pool.clone())
        .start::<original::Original>(&"hi".to_owned())
        .await
        .unwrap();
    assert_eq!(run.flow_slug(), "compatFlow");
    assert_eq!(run.wait(support::LIMIT).await.unwrap().exclaim, "HI!");
    // The flow type is its own deployment without an alias: starting it "by alias" starts its slug.
    let run = Client::new(pool.clone())
        .start_deployed::<original::Original>(&"ho".to_owned())
        .await
        .unwrap();
    assert_eq!(run.flow_slug(), "compatFlow");
    assert_eq!(run.wait(support::LIMIT).await.unwrap().exclaim, "HO!");
    let (aliases, mode): (i64, String) = sqlx::query_as(
        "select (select count(*) from pgflow.flow_aliases), \
                (select queue_mode from pgflow.flows where flow_slug = 'compatFlow')",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((aliases, mode.as_str()), (0, "flow"));
    let report = worker.stop().await;
    assert_eq!(report.compile_status, CompileStatus::Compiled);
    assert_eq!(report.completed, 4);
}

#[flow(slug = "trimmedFlow", input = String)]
mod full {
    use super::*;

    #[step]
    async fn first(s: String) -> Result<String, StepError> {
        Ok(s)
    }

    #[step(depends_on = [first])]
    async fn second(first: String) -> Result<String, StepError> {
        Ok(first)
    }
}

#[flow(slug = "trimmedFlow", input = String)]
mod trimmed {
    use super::*;

    #[step]
    async fn first(s: String) -> Result<String, StepError> {
        Ok(s)
    }
}

/// The startup coverage check applies to plain workers too: a build that lacks a step the queue still
/// carries work for refuses to start (instead of stopping on that step's first message).
#[tokio::test]
async fn a_plain_worker_whose_build_lacks_a_step_with_work_in_flight_refuses_to_start_and_registers_nothing(
) {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    support::compile::<full::Full>(pool).await;
    let run_id = pgflow_tests::state::start(pool, "trimmedFlow", json!("x")).await;
    let worker = support::fast(Worker::<trimmed::Trimmed>::builder(pool.clone()))
        .compilation(Compilation::Skip)
        .build()
        .unwrap();
    let id = worker.id();
    let err = worker
        .run(CancellationToken::new())
        .bounded()
        .await
        .unwrap_err();
    let WorkerError::CoverageGap { queue, gaps } = &err else {
        panic!("expected a coverage gap, got {err}");
    };
    assert_eq!(queue, "trimmedflow");
    assert_eq!(
        gaps.iter()
            .map(|g| (
                g.flow_slug.as_str(),
                g.step_slug.as_str(),
                g.reason.as_str()
            ))
            .collect::<Vec<_>>(),
        [("trimmedFlow", "second", "started_run")],
        "{err}"
    );
    assert!(!support::is_registered(pool, id).await);
    assert_eq!(support::task(pool, run_id, "first", 0).await.0, "queued");
}

/// With `Compilation::Skip` the worker compiles nothing: a flow nobody compiled is refused by name before the
/// worker registers (the routes check, not a failure on the first claim).
#[tokio::test]
async fn a_worker_that_skips_compilation_refuses_a_flow_nobody_compiled() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::fast(Worker::<trimmed::Trimmed>::builder(pool.clone()))
        .compilation(Compilation::Skip)
        .build()
        .unwrap();
    let id = worker.id();
    let err = worker
        .run(CancellationToken::new())
        .bounded()
        .await
        .unwrap_err();
    let WorkerError::FlowMissing { flow_slug } = &err else {
        panic!("expected the missing flow to be named, got {err}");
    };
    assert_eq!(flow_slug, "trimmedFlow");
    assert!(!support::is_registered(pool, id).await);
}
