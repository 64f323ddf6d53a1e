//! Per-step queues: isolation, several instances, coverage, unsupported messages and routing checks.
//! (The Rust and SQL queue-name resolvers are compared in the SQL tests, `queue_names.rs`.)
#![allow(unreachable_pub)] // flow input types appear in the generated (public) flow items

use std::time::Duration;

use pgflow_runtime::worker::UnsupportedBatch;
use pgflow_runtime::{flow, worker::WorkerError, Client, StepError, StepQueued, Worker};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::support::{self, LIMIT};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Label {
    pub route: String,
}

#[flow(slug = "communityV1", input = Thread, step_queues)]
mod community {
    use super::*;

    #[step]
    async fn classify(thread: Thread) -> Result<Label, StepError> {
        if thread.text.starts_with(SPREAD_MARK) {
            // Wait (bounded) until two classify handlers run at once: with workers of one slot each,
            // that is two workers sharing the queue.
            let _in_flight = SPREADING.enter();
            SPREADING.overlap(Duration::from_secs(5)).await;
        }
        let route = if thread.text.contains('?') {
            "help"
        } else {
            "chat"
        };
        Ok(Label {
            route: route.into(),
        })
    }

    #[step(depends_on = [classify], slug = "deliverSlack", if = { classify: { route: "help" } })]
    async fn deliver_slack(classify: Label) -> Result<String, StepError> {
        Ok(format!("delivered {}", classify.route))
    }
}

use community::{Community, Step};
use pgflow_runtime::sql::SqlState;

/// Threads whose text starts with this belong to the test of several classify workers.
const SPREAD_MARK: &str = "spread: ";
/// Classify handlers of that test running at once.
static SPREADING: support::Gauge = support::Gauge::new();

async fn step_worker(pool: &sqlx::PgPool, step: Step) -> support::Running {
    support::spawn_with(support::fast(
        StepQueued::<Community>::worker(step).builder(pool.clone()),
    ))
    .await
}

async fn coverage(pool: &sqlx::PgPool, step: &str) -> (i64, i64, bool) {
    sqlx::query_as(
        "select queued_tasks, live_workers, uncovered from pgflow.queue_coverage \
         where flow_slug = 'communityV1' and step_slug = $1",
    )
    .bind(step)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn step_workers_poll_only_their_queue_and_a_missing_one_leaves_work_queued_and_visible_in_coverage(
) {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let classify = step_worker(pool, Step::Classify).await;
    let client = Client::new(pool.clone());
    let run = client
        .start::<Community>(&Thread {
            text: "help?".into(),
        })
        .await
        .unwrap();
    pgflow_tests::wait_until(LIMIT, "classify to complete", || async {
        support::step_status(pool, run.run_id(), "classify").await == "completed"
    })
    .await;
    assert_eq!(
        support::task(pool, run.run_id(), "deliverSlack", 0).await.0,
        "queued"
    );
    let waiting: i64 = sqlx::query_scalar("select count(*) from pgmq.q_communityv1__deliverslack")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(waiting, 1);
    assert_eq!(coverage(pool, "deliverSlack").await, (1, 0, true));
    assert_eq!(coverage(pool, "classify").await, (0, 1, false));

    let deliver = step_worker(pool, Step::DeliverSlack).await;
    assert_eq!(
        run.wait(LIMIT).await.unwrap().deliver_slack.as_deref(),
        Some("delivered help")
    );
    assert_eq!(coverage(pool, "deliverSlack").await, (0, 1, false));
    let report = classify.stop().await;
    assert_eq!(report.completed, 1);
    assert_eq!(deliver.stop().await.completed, 1);
}

#[tokio::test]
async fn several_instances_of_one_step_worker_share_its_queue() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let mut classifiers = Vec::new();
    for _ in 0..3 {
        classifiers.push(
            support::spawn_with(
                support::fast(
                    StepQueued::<Community>::worker(Step::Classify).builder(pool.clone()),
                )
                .max_concurrent(1),
            )
            .await,
        );
    }
    let deliver = step_worker(pool, Step::DeliverSlack).await;
    let client = Client::new(pool.clone());
    let mut runs = Vec::new();
    for i in 0..12 {
        let text = if i % 2 == 0 { "q?" } else { "hi" };
        let text = format!("{SPREAD_MARK}{text}");
        runs.push(client.start::<Community>(&Thread { text }).await.unwrap());
    }
    for run in &runs {
        run.wait(LIMIT).await.unwrap();
    }
    let workers: i64 = sqlx::query_scalar(
        "select count(distinct last_worker_id) from pgflow.step_tasks where step_slug = 'classify'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(
        workers >= 2,
        "classify tasks were spread over {workers} worker(s)"
    );
    let mut total = 0;
    for c in classifiers {
        total += c.stop().await.completed;
    }
    assert_eq!(total, 12);
    assert_eq!(deliver.stop().await.completed, 6);
}

#[tokio::test]
async fn an_unsupported_message_stops_the_step_worker_without_mutation_and_fences_its_restarts() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    // Compile the flow (a deliver worker), then queue a real classify task and a foreign message.
    let deliver = step_worker(pool, Step::DeliverSlack).await;
    let client = Client::new(pool.clone());
    let run = client
        .start::<Community>(&Thread {
            text: "help?".into(),
        })
        .await
        .unwrap();
    let foreign: i64 = sqlx::query_scalar(
        "select pgmq.send('communityv1__classify', '{\"secret\": \"body\"}'::jsonb)",
    )
    .fetch_one(pool)
    .await
    .unwrap();

    let err = support::fast(StepQueued::<Community>::worker(Step::Classify).builder(pool.clone()))
        .run(CancellationToken::new())
        .await
        .unwrap_err();
    let WorkerError::Unsupported(batch) = &err else {
        panic!("expected an unsupported batch, got {err}");
    };
    let UnsupportedBatch {
        queue,
        msg_ids,
        supported,
        function_name,
        ..
    } = &**batch;
    assert_eq!(queue, "communityv1__classify");
    assert!(msg_ids.contains(&foreign), "{msg_ids:?}");
    assert_eq!(
        supported,
        &[("communityV1".to_owned(), "classify".to_owned())]
    );
    assert_eq!(function_name, "communityv1__classify");
    assert!(
        !err.to_string().contains("secret"),
        "no message bodies: {err}"
    );

    // No mutation: the real task is untouched, every message visible again.
    let (status, attempts, _) = support::task(pool, run.run_id(), "classify", 0).await;
    assert_eq!((status.as_str(), attempts), ("queued", 0));
    let hidden: i64 = sqlx::query_scalar(
        "select count(*) from pgmq.q_communityv1__classify where vt > clock_timestamp()",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(hidden, 0);
    let (enabled, reason): (bool, Option<String>) = sqlx::query_as(
        "select enabled, disabled_reason from pgflow.worker_functions where function_name = 'communityv1__classify'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(!enabled);
    assert!(reason.unwrap().contains("communityv1__classify"));

    // A restarted worker of the disabled function claims nothing.
    let err = support::fast(StepQueued::<Community>::worker(Step::Classify).builder(pool.clone()))
        .run(CancellationToken::new())
        .await
        .unwrap_err();
    assert!(matches!(err, WorkerError::FunctionDisabled { .. }), "{err}");
    assert_eq!(support::task(pool, run.run_id(), "classify", 0).await.1, 0);
    deliver.stop().await;
}

#[tokio::test]
async fn a_flow_compiled_with_one_queue_refuses_step_workers_with_the_routing_error() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    support::spawn::<Community>(pool).await.stop().await;
    let err = support::fast(StepQueued::<Community>::worker(Step::Classify).builder(pool.clone()))
        .run(CancellationToken::new())
        .await
        .unwrap_err();
    let WorkerError::Routing { code, .. } = &err else {
        panic!("expected a routing error, got {err}");
    };
    assert_eq!(*code, SqlState::RoutingChanged);
    assert!(err.to_string().contains("Hint:"), "{err}");
    // And the other way round: a plain worker for a step-queued flow.
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    step_worker(pool, Step::Classify).await.stop().await;
    let err = support::fast(Worker::<Community>::builder(pool.clone()))
        .run(CancellationToken::new())
        .await
        .unwrap_err();
    assert!(matches!(err, WorkerError::Routing { .. }), "{err}");
}

#[tokio::test]
async fn a_visible_message_of_a_started_task_never_stops_a_healthy_step_worker() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    // Compile, then claim the classify task "elsewhere" (another registered worker) and make its
    // message visible again, as a late visibility would.
    step_worker(pool, Step::DeliverSlack).await.stop().await;
    let client = Client::new(pool.clone());
    let run = client
        .start::<Community>(&Thread {
            text: "help?".into(),
        })
        .await
        .unwrap();
    let other = uuid::Uuid::new_v4();
    sqlx::query(
        "select pgflow.register_worker(worker_id => $1, function_name => 'elsewhere', \
         queue_name => 'communityv1__classify', flow_slugs => array['communityV1'], \
         step_slugs => array['classify'])",
    )
    .bind(other)
    .execute(pool)
    .await
    .unwrap();
    let claimed: Vec<String> = sqlx::query_scalar(
        "select outcome from pgflow.read_and_claim_tasks(queue_name => 'communityv1__classify', qty => 10, \
         vt => 5, worker_id => $1, flow_slugs => array['communityV1'], step_slugs => array['classify'])",
    )
    .bind(other)
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(claimed, ["claimed"]);
    sqlx::query("update pgmq.q_communityv1__classify set vt = clock_timestamp()")
        .execute(pool)
        .await
        .unwrap();

    let worker = step_worker(pool, Step::Classify).await;
    pgflow_tests::wait_until(LIMIT, "the duplicate to be read and deferred", || async {
        sqlx::query_scalar::<_, bool>(
            "select bool_and(vt > clock_timestamp() + interval '10 seconds') from pgmq.q_communityv1__classify",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    })
    .await;
    let (status, attempts, _) = support::task(pool, run.run_id(), "classify", 0).await;
    assert_eq!(
        (status.as_str(), attempts),
        ("started", 1),
        "no attempt consumed"
    );
    let enabled: bool = sqlx::query_scalar(
        "select enabled from pgflow.worker_functions where function_name = 'communityv1__classify'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(enabled);
    let report = worker.stop().await;
    assert_eq!(
        report.stop_reason,
        pgflow_runtime::worker::StopReason::Shutdown
    );
}

#[tokio::test]
async fn a_step_worker_is_a_one_deployment_registry_serving_only_its_step_with_no_alias() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = step_worker(pool, Step::DeliverSlack).await;
    let status = &worker.deployments()[0];
    assert_eq!(worker.deployments().len(), 1);
    assert_eq!(
        (status.flow_slug.as_str(), status.steps.as_slice()),
        ("communityV1", ["deliverSlack".to_owned()].as_slice())
    );
    assert_eq!(
        status.compile_status,
        pgflow_runtime::worker::CompileStatus::Compiled
    );
    assert_eq!(status.alias, pgflow_runtime::worker::AliasActivation::None);
    assert_eq!(
        support::registered_pairs(pool, worker.id()).await,
        [("communityV1".to_owned(), "deliverSlack".to_owned())]
    );
    let (mode, aliases): (String, i64) = sqlx::query_as(
        "select (select queue_mode from pgflow.flows where flow_slug = 'communityV1'), \
                (select count(*) from pgflow.flow_aliases)",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((mode.as_str(), aliases), ("step", 0));
    worker.stop().await;
}
