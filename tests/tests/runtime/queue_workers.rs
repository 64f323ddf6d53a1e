//! Queue workers: one declared queue, the steps of several deployments on it. Shared queues across flows,
//! one queue per step with its own concurrency, the startup coverage refusal, an unsupported pair arriving
//! after startup, the registry's own rules, and starting runs by alias.

use std::time::Duration;

use pgflow_runtime::client::start_deployed;
use pgflow_runtime::{
    deployment, flow, queue, worker::AliasActivation, worker::Compilation, worker::CompileStatus,
    worker::GapReason, worker::WorkerError, Client, Deployment, FlowStep, Queue, QueueWorker,
    RoutesTo, Routing, StepError,
};
use serde_json::{json, Value};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::support::Bounded;
use crate::support::{self, LIMIT};

#[flow(slug = "signupsV1", input = String)]
mod signups_v1 {
    use super::*;

    #[step]
    async fn welcome(name: String) -> Result<String, StepError> {
        Ok(format!("welcome {name}"))
    }
}

#[flow(slug = "billingV1", input = u32)]
mod billing_v1 {
    use super::*;

    #[step]
    async fn charge(cents: u32) -> Result<u32, StepError> {
        Ok(cents)
    }

    #[step(depends_on = [charge])]
    async fn receipt(charge: u32) -> Result<String, StepError> {
        Ok(format!("charged {charge}"))
    }
}

/// A queue two flows share.
#[queue("shared_work")]
struct SharedWork;

/// Signups behind the alias `signups`, on the shared queue.
#[deployment(alias = "signups")]
fn signups(step: signups_v1::Step) {
    match step {
        signups_v1::Step::Welcome => SharedWork,
    }
}

/// The same concrete flow again, under another alias.
#[deployment(alias = "signupsAgain", name = SignupsAgain)]
fn signups_again(step: signups_v1::Step) {
    match step {
        signups_v1::Step::Welcome => SharedWork,
    }
}

/// Billing without an alias (started by its concrete slug), both steps on the shared queue. Written by
/// hand: `#[deployment]` always declares an alias, and `Deployment::ALIAS` may be `None`.
struct Billing;
impl Deployment for Billing {
    type Flow = billing_v1::BillingV1;
    const ALIAS: Option<&'static str> = None;
    fn routing() -> Routing<billing_v1::Step> {
        Routing::Named(|_| SharedWork::NAME)
    }
}
impl RoutesTo<SharedWork> for Billing {}

/// Compiles deployment `D` by hand, as another deployment's worker would, without running a worker for it,
/// activating `alias` (`D::ALIAS`, or none).
async fn compile_named<D: Deployment>(pool: &PgPool, alias: Option<&str>) {
    let Routing::Named(route) = D::routing() else {
        panic!("a named deployment")
    };
    let routes: Vec<Value> = <<D::Flow as pgflow_runtime::Flow>::Step as FlowStep>::ALL
        .iter()
        .map(|s| json!({"step_slug": s.slug(), "queue_name": route(*s)}))
        .collect();
    let result: Value = sqlx::query_scalar(
        "select pgflow.ensure_flow_compiled(flow_slug => $1, shape => $2, queue_mode => 'named', \
         routes => $3, alias => $4)",
    )
    .bind(<D::Flow as pgflow_runtime::Flow>::SLUG)
    .bind(<D::Flow as pgflow_runtime::Flow>::shape())
    .bind(Value::Array(routes))
    .bind(alias)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(result["status"], "compiled", "{result}");
}

#[tokio::test]
async fn two_flows_share_a_named_queue_and_one_queue_worker_claims_and_runs_the_steps_of_both() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    // Compile both (and register nothing that keeps running), then queue work of both flows at once.
    support::spawn_with(support::fast(
        QueueWorker::<SharedWork>::builder(pool.clone())
            .serve::<Signups>()
            .serve::<Billing>(),
    ))
    .await
    .stop()
    .await;
    let client = Client::new(pool.clone());
    let mut signups = Vec::new();
    let mut bills = Vec::new();
    for i in 0..3u32 {
        signups.push(
            client
                .start_deployed::<Signups>(&format!("user{i}"))
                .await
                .unwrap(),
        );
        bills.push(client.start_deployed::<Billing>(&(100 + i)).await.unwrap());
    }

    let worker = support::spawn_with(support::fast(
        QueueWorker::<SharedWork>::builder(pool.clone())
            .serve::<Signups>()
            .serve::<Billing>(),
    ))
    .await;
    for (i, run) in signups.iter().enumerate() {
        assert_eq!(
            run.wait(LIMIT).await.unwrap().welcome,
            format!("welcome user{i}")
        );
    }
    for (i, run) in bills.iter().enumerate() {
        assert_eq!(
            run.wait(LIMIT).await.unwrap().receipt,
            format!("charged {}", 100 + i)
        );
    }

    assert_eq!(
        support::registered_pairs(pool, worker.id()).await,
        [
            ("billingV1".to_owned(), "charge".to_owned()),
            ("billingV1".to_owned(), "receipt".to_owned()),
            ("signupsV1".to_owned(), "welcome".to_owned()),
        ]
    );
    let by_others: i64 = sqlx::query_scalar(
        "select count(*) from pgflow.step_tasks where last_worker_id is distinct from $1",
    )
    .bind(worker.id())
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(by_others, 0, "the one queue worker ran every task");
    // Its first read took the whole backlog: one claim (one transaction, one start time) carried tasks of
    // both concrete flows.
    let mixed_claims: i64 = sqlx::query_scalar(
        "select count(*) from (select started_at from pgflow.step_tasks \
         group by started_at having count(distinct flow_slug) = 2) c",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(mixed_claims >= 1, "a claim carried tasks of both flows");
    let report = worker.stop().await;
    assert_eq!(report.completed, 9);
    assert_eq!(report.deployments.len(), 2);
}

static CLASSIFYING: support::Gauge = support::Gauge::new();
static DELIVERING: support::Gauge = support::Gauge::new();

#[flow(slug = "pipelineV1", input = u32)]
mod pipeline_v1 {
    use super::*;

    /// Gives a second classify 40 ms to start beside it (the queue worker's concurrency of one must not
    /// let it), and returns as soon as one does.
    #[step]
    async fn classify(n: u32) -> Result<u32, StepError> {
        let _in_flight = CLASSIFYING.enter();
        CLASSIFYING.overlap(Duration::from_millis(40)).await;
        Ok(n)
    }

    /// Waits (bounded) until two deliveries have overlapped once, so the test sees that this queue's
    /// worker runs several at a time.
    #[step(depends_on = [classify])]
    async fn deliver(classify: u32) -> Result<u32, StepError> {
        let _in_flight = DELIVERING.enter();
        DELIVERING.overlap(Duration::from_secs(5)).await;
        Ok(classify + 1)
    }
}

#[queue("pipeline_classify")]
struct PipelineClassify;

#[queue("pipeline_deliver")]
struct PipelineDeliver;

/// Each step on its own named queue.
#[deployment(alias = "pipeline")]
fn pipeline(step: pipeline_v1::Step) {
    match step {
        pipeline_v1::Step::Classify => PipelineClassify,
        pipeline_v1::Step::Deliver => PipelineDeliver,
    }
}

#[tokio::test]
async fn each_step_on_its_own_named_queue_runs_under_its_own_queue_worker_with_its_own_concurrency()
{
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let classify = support::spawn_with(
        support::fast(QueueWorker::<PipelineClassify>::builder(pool.clone()).serve::<Pipeline>())
            .max_concurrent(1),
    )
    .await;
    let deliver = support::spawn_with(
        support::fast(QueueWorker::<PipelineDeliver>::builder(pool.clone()).serve::<Pipeline>())
            .max_concurrent(4),
    )
    .await;
    assert_eq!(
        classify.deployments()[0].alias,
        AliasActivation::Activated {
            alias: "pipeline".into(),
            previous_flow_slug: None
        }
    );
    assert_eq!(
        deliver.deployments()[0].alias,
        AliasActivation::AlreadyActive {
            alias: "pipeline".into()
        }
    );
    assert_eq!(deliver.deployments()[0].steps, ["deliver"]);

    let client = Client::new(pool.clone());
    let mut runs = Vec::new();
    for n in 0..6 {
        runs.push(client.start_deployed::<Pipeline>(&n).await.unwrap());
    }
    for (n, run) in runs.iter().enumerate() {
        assert_eq!(run.flow_slug(), "pipelineV1");
        assert_eq!(run.wait(LIMIT).await.unwrap().deliver, n as u32 + 1);
    }
    assert_eq!(
        CLASSIFYING.max(),
        1,
        "the classify queue runs one at a time"
    );
    let delivering = DELIVERING.max();
    assert!(
        (2..=4).contains(&delivering),
        "the deliver queue ran {delivering} at once"
    );

    assert_eq!(
        support::registered_pairs(pool, classify.id()).await,
        [("pipelineV1".to_owned(), "classify".to_owned())]
    );
    assert_eq!(
        support::registered_pairs(pool, deliver.id()).await,
        [("pipelineV1".to_owned(), "deliver".to_owned())]
    );
    let queues: Vec<(String, String)> = sqlx::query_as(
        "select distinct step_slug, queue_name from pgflow.step_tasks order by step_slug",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        queues,
        [
            ("classify".to_owned(), "pipeline_classify".to_owned()),
            ("deliver".to_owned(), "pipeline_deliver".to_owned()),
        ]
    );
    assert_eq!(classify.stop().await.completed, 6);
    assert_eq!(deliver.stop().await.completed, 6);
}

#[tokio::test]
async fn a_queue_worker_lacking_a_pair_that_an_active_alias_or_an_in_flight_run_needs_refuses_to_start_and_registers_nothing(
) {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    // Both flows compiled on the shared queue, `signups` active; then a billing run waits with no worker.
    support::spawn_with(support::fast(
        QueueWorker::<SharedWork>::builder(pool.clone())
            .serve::<Signups>()
            .serve::<Billing>(),
    ))
    .await
    .stop()
    .await;
    let client = Client::new(pool.clone());
    let bill = client.start_deployed::<Billing>(&250).await.unwrap();

    // Without Signups: the active alias routes `welcome` here.
    let worker = support::fast(QueueWorker::<SharedWork>::builder(pool.clone()).serve::<Billing>())
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
    assert_eq!(queue, "shared_work");
    assert_eq!(gaps.len(), 1, "{err}");
    let gap = &gaps[0];
    assert_eq!(
        (gap.flow_slug.as_str(), gap.step_slug.as_str()),
        ("signupsV1", "welcome")
    );
    assert_eq!(gap.reason, GapReason::ActiveAlias);
    assert_eq!(gap.count, 1);
    assert_eq!(gap.examples, ["signups"]);
    assert!(
        gap.repair.contains("include that version"),
        "{}",
        gap.repair
    );
    let text = err.to_string();
    for part in [
        "shared_work",
        "signupsV1",
        "welcome",
        "active_alias",
        "registers nothing",
    ] {
        assert!(text.contains(part), "{part} missing from: {text}");
    }
    assert!(
        !support::is_registered(pool, id).await,
        "nothing registered"
    );

    // Without Billing: the started run may still create `charge` and `receipt` tasks here, and `charge` waits.
    let worker = support::fast(QueueWorker::<SharedWork>::builder(pool.clone()).serve::<Signups>())
        .build()
        .unwrap();
    let id = worker.id();
    let err = worker
        .run(CancellationToken::new())
        .bounded()
        .await
        .unwrap_err();
    let WorkerError::CoverageGap { gaps, .. } = &err else {
        panic!("expected a coverage gap, got {err}");
    };
    let found: Vec<(&str, &str)> = gaps
        .iter()
        .map(|g| (g.step_slug.as_str(), g.reason.as_str()))
        .collect();
    assert_eq!(
        found,
        [
            ("charge", "started_run"),
            ("charge", "task_snapshot"),
            ("receipt", "started_run")
        ],
        "{err}"
    );
    assert!(gaps.iter().all(|g| g.flow_slug == "billingV1"));
    let run = bill.run_id().to_string();
    assert_eq!(gaps[0].examples, std::slice::from_ref(&run));
    assert!(gaps[1].examples[0].contains(&run), "{:?}", gaps[1].examples);
    assert!(
        gaps[0].repair.contains("pgflow.version_retirable"),
        "{}",
        gaps[0].repair
    );
    assert!(
        !support::is_registered(pool, id).await,
        "nothing registered"
    );
    assert_eq!(
        support::task(pool, bill.run_id(), "charge", 0).await.0,
        "queued"
    );

    // The registry the queue needs starts and drains the waiting run.
    let worker = support::spawn_with(support::fast(
        QueueWorker::<SharedWork>::builder(pool.clone())
            .serve::<Signups>()
            .serve::<Billing>(),
    ))
    .await;
    assert_eq!(bill.wait(LIMIT).await.unwrap().receipt, "charged 250");
    worker.stop().await;
}

#[tokio::test]
async fn a_task_of_a_pair_the_worker_cannot_run_arriving_after_startup_stops_it_without_mutation_and_disables_its_function(
) {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn_with(support::fast(
        QueueWorker::<SharedWork>::builder(pool.clone()).serve::<Signups>(),
    ))
    .await;
    let client = Client::new(pool.clone());
    let signup = client
        .start_deployed::<Signups>(&"Ada".to_owned())
        .await
        .unwrap();
    assert_eq!(signup.wait(LIMIT).await.unwrap().welcome, "welcome Ada");

    // After the worker started, another deployment routes billing to the same queue and a run starts.
    compile_named::<Billing>(pool, Billing::ALIAS).await;
    let bill = client.start_deployed::<Billing>(&990).await.unwrap();
    let err = worker.outcome().await.unwrap_err();
    let WorkerError::Unsupported(batch) = &err else {
        panic!("expected an unsupported batch, got {err}");
    };
    let msg_id: i64 = sqlx::query_scalar(
        "select message_id from pgflow.step_tasks where run_id = $1 and step_slug = 'charge'",
    )
    .bind(bill.run_id())
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(batch.queue, "shared_work");
    assert!(batch.msg_ids.contains(&msg_id), "{:?}", batch.msg_ids);
    assert_eq!(batch.message_flows, ["billingV1"]);
    assert_eq!(batch.message_steps, ["charge"]);
    assert_eq!(
        batch.supported,
        [("signupsV1".to_owned(), "welcome".to_owned())]
    );
    let text = err.to_string();
    for part in ["shared_work", "billingV1", "charge", &msg_id.to_string()] {
        assert!(text.contains(part), "{part} missing from: {text}");
    }

    // No mutation: the task is untouched and its message visible again; the function is fenced.
    let (status, attempts, _) = support::task(pool, bill.run_id(), "charge", 0).await;
    assert_eq!((status.as_str(), attempts), ("queued", 0));
    let hidden: i64 =
        sqlx::query_scalar("select count(*) from pgmq.q_shared_work where vt > clock_timestamp()")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(hidden, 0);
    let enabled: bool = sqlx::query_scalar(
        "select enabled from pgflow.worker_functions where function_name = 'shared_work'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(!enabled);
}

#[tokio::test]
async fn a_queue_worker_serving_no_deployment_or_one_concrete_flow_twice_refuses_before_touching_the_database(
) {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let err = support::fast(QueueWorker::<SharedWork>::builder(pool.clone()))
        .run(CancellationToken::new())
        .bounded()
        .await
        .unwrap_err();
    assert!(
        matches!(&err, WorkerError::EmptyRegistry { queue } if queue == "shared_work"),
        "{err}"
    );
    let err = support::fast(
        QueueWorker::<SharedWork>::builder(pool.clone())
            .serve::<Signups>()
            .serve::<SignupsAgain>(),
    )
    .run(CancellationToken::new())
    .bounded()
    .await
    .unwrap_err();
    let WorkerError::DuplicateFlow { queue, flow_slug } = &err else {
        panic!("expected a duplicate flow, got {err}");
    };
    assert_eq!(
        (queue.as_str(), flow_slug.as_str()),
        ("shared_work", "signupsV1")
    );
    assert!(err.to_string().contains("twice"), "{err}");
    let (flows, workers): (i64, i64) = sqlx::query_as(
        "select (select count(*) from pgflow.flows), (select count(*) from pgflow.workers)",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((flows, workers), (0, 0), "nothing compiled or registered");
}

#[tokio::test]
async fn a_run_started_by_alias_reports_its_concrete_slug_also_inside_the_callers_transaction() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn_with(support::fast(
        QueueWorker::<SharedWork>::builder(pool.clone())
            .serve::<Signups>()
            .serve::<Billing>(),
    ))
    .await;
    assert_eq!(
        worker.deployments()[0].compile_status,
        CompileStatus::Compiled
    );
    assert_eq!(
        support::alias_target(pool, "signups").await.as_deref(),
        Some("signupsV1")
    );
    let client = Client::new(pool.clone());

    let run = client
        .start_deployed::<Signups>(&"Grace".to_owned())
        .await
        .unwrap();
    assert_eq!(run.flow_slug(), "signupsV1");
    assert_eq!(run.wait(LIMIT).await.unwrap().welcome, "welcome Grace");

    // The by-executor form, in the caller's transaction: rolled back, the run never existed.
    let mut tx = pool.begin().await.unwrap();
    let started = start_deployed::<Signups, _>(&mut *tx, &"Rolled".to_owned())
        .await
        .unwrap();
    assert_eq!(started.flow_slug, "signupsV1");
    tx.rollback().await.unwrap();
    assert!(client.run(started.run_id).await.unwrap().is_none());
    let mut tx = pool.begin().await.unwrap();
    let started = start_deployed::<Signups, _>(&mut *tx, &"Kept".to_owned())
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        client
            .handle::<signups_v1::SignupsV1>(started.run_id)
            .wait(LIMIT)
            .await
            .unwrap()
            .welcome,
        "welcome Kept"
    );

    // A deployment without an alias starts its concrete slug; no alias row is involved.
    let bill = client.start_deployed::<Billing>(&5).await.unwrap();
    assert_eq!(bill.flow_slug(), "billingV1");
    assert_eq!(bill.wait(LIMIT).await.unwrap().receipt, "charged 5");
    let aliases: Vec<String> = sqlx::query_scalar("select alias from pgflow.flow_aliases")
        .fetch_all(pool)
        .await
        .unwrap();
    assert_eq!(aliases, ["signups"]);
    worker.stop().await;
}

/// With `Compilation::Skip` the version is someone else's to deploy, and so is its alias: a worker that serves
/// it (here, the version compiled without its alias) leaves the alias alone.
#[tokio::test]
async fn a_worker_that_skips_compilation_leaves_the_alias_alone() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    compile_named::<Signups>(pool, None).await;
    let report = support::spawn_with(
        support::fast(QueueWorker::<SharedWork>::builder(pool.clone()).serve::<Signups>())
            .compilation(Compilation::Skip),
    )
    .await
    .stop()
    .await;
    assert_eq!(report.deployments[0].compile_status, CompileStatus::Skipped);
    assert_eq!(report.deployments[0].alias, AliasActivation::None);
    assert_eq!(support::alias_target(pool, "signups").await, None);
}
