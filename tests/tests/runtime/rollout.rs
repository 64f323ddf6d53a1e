//! Rolling a flow out from V1 to V2 behind one alias, with each step on a shared named queue and one queue
//! worker function per queue: the fenced procedure of OPERATIONS.md, activation by the first new worker,
//! and draining and retiring V1.

use pgflow_runtime::{
    worker::AliasActivation, worker::GapReason, worker::OnQueue, worker::StopReason,
    worker::WorkerBuilder, worker::WorkerError, Client, QueueWorker,
};
use pgflow_tests::deployed::{
    threads_v1::ThreadsV1, threads_v2::ThreadsV2, ClassifyThreads, CommunityV1, CommunityV2,
    DeliverAlerts, Thread, ALIAS,
};
use serde_json::Value;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::support::Bounded;
use crate::support::{self, LIMIT};
use pgflow_runtime::sql::SqlState;

const V1: &str = "communityThreadsV1";
const V2: &str = "communityThreadsV2";

fn thread(text: &str) -> Thread {
    Thread { text: text.into() }
}

/// The worker function `community-classify` with the given versions.
fn classify(pool: &PgPool, v1: bool, v2: bool) -> WorkerBuilder<OnQueue<ClassifyThreads>> {
    let mut b = QueueWorker::<ClassifyThreads>::builder(pool.clone());
    if v1 {
        b = b.serve::<CommunityV1>();
    }
    if v2 {
        b = b.serve::<CommunityV2>();
    }
    support::fast(b).worker_name("community-classify")
}

/// The worker function `community-deliver` with the given versions.
fn deliver(pool: &PgPool, v1: bool, v2: bool) -> WorkerBuilder<OnQueue<DeliverAlerts>> {
    let mut b = QueueWorker::<DeliverAlerts>::builder(pool.clone());
    if v1 {
        b = b.serve::<CommunityV1>();
    }
    if v2 {
        b = b.serve::<CommunityV2>();
    }
    support::fast(b).worker_name("community-deliver")
}

async fn execute(pool: &PgPool, sql: &str) {
    sqlx::query(sql)
        .execute(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

async fn retirable(pool: &PgPool, flow: &str, queue: &str) -> Value {
    sqlx::query_scalar("select pgflow.version_retirable(flow_slug => $1, queue_name => $2)")
        .bind(flow)
        .bind(queue)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Whether concrete flow `flow_slug` is compiled.
async fn compiled(pool: &PgPool, flow_slug: &str) -> bool {
    sqlx::query_scalar("select exists (select 1 from pgflow.flows where flow_slug = $1)")
        .bind(flow_slug)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The rollback build of `community-classify`: both versions, V1 served last, so that its startups keep (or
/// point) the alias at V1.
fn classify_v2_then_v1(pool: &PgPool) -> WorkerBuilder<OnQueue<ClassifyThreads>> {
    let b = QueueWorker::<ClassifyThreads>::builder(pool.clone())
        .serve::<CommunityV2>()
        .serve::<CommunityV1>();
    support::fast(b).worker_name("community-classify")
}

/// The rollback build of `community-deliver`.
fn deliver_v2_then_v1(pool: &PgPool) -> WorkerBuilder<OnQueue<DeliverAlerts>> {
    let b = QueueWorker::<DeliverAlerts>::builder(pool.clone())
        .serve::<CommunityV2>()
        .serve::<CommunityV1>();
    support::fast(b).worker_name("community-deliver")
}

/// `pgflow.activate_alias(ALIAS, flow_slug)`, checked to have moved the alias from `from`.
async fn activate(pool: &PgPool, flow_slug: &str, from: &str) {
    let moved: Value = sqlx::query_scalar("select pgflow.activate_alias($1, $2)")
        .bind(ALIAS)
        .bind(flow_slug)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(moved["activated"], true, "{moved}");
    assert_eq!(moved["flow_slug"], flow_slug, "{moved}");
    assert_eq!(moved["previous_flow_slug"], from, "{moved}");
}

/// The alias move a worker's startup made for the deployment it serves last.
fn last_activation(worker: &support::Running) -> AliasActivation {
    worker
        .deployments()
        .last()
        .expect("a deployment")
        .alias
        .clone()
}

/// Which workers ran the tasks of a run.
async fn task_workers(pool: &PgPool, run: Uuid) -> Vec<Uuid> {
    sqlx::query_scalar(
        "select distinct last_worker_id from pgflow.step_tasks where run_id = $1 and last_worker_id is not null",
    )
    .bind(run)
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_fenced_rollout_behind_one_alias_finishes_earlier_runs_on_v1_and_starts_later_runs_on_v2()
{
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let client = Client::new(pool.clone());
    let old_classify = support::spawn_with(classify(pool, true, false)).await;
    let old_deliver = support::spawn_with(deliver(pool, true, false)).await;
    let first = client
        .start_deployed::<CommunityV1>(&thread("first?"))
        .await
        .unwrap();
    assert_eq!(first.flow_slug(), V1);
    assert_eq!(
        first.wait(LIMIT).await.unwrap().deliver_slack,
        "v1 delivered help (classified by v1)"
    );

    // 1. Record the enabled functions and disable them.
    execute(
        pool,
        "create table rollout_fence as \
           select function_name from pgflow.worker_functions \
           where enabled and function_name in ('community-classify', 'community-deliver')",
    )
    .await;
    execute(
        pool,
        "select pgflow.disable_worker_function(function_name, 'rollout communityThreadsV2') from rollout_fence",
    )
    .await;
    // 2. Deprecate their live workers and wait until every one has stopped.
    execute(
        pool,
        "update pgflow.workers set deprecated_at = now() \
         where function_name in (select function_name from rollout_fence) and stopped_at is null",
    )
    .await;
    pgflow_tests::wait_until(LIMIT, "every old worker to stop", || async {
        sqlx::query_scalar::<_, i64>(
            "select count(*) from pgflow.workers \
             where function_name in (select function_name from rollout_fence) and stopped_at is null \
               and last_heartbeat_at > now() - interval '30 seconds'",
        )
        .fetch_one(pool)
        .await
        .unwrap()
            == 0
    })
    .await;
    for old in [old_classify, old_deliver] {
        let report = old.join().await;
        assert!(
            matches!(
                report.stop_reason,
                StopReason::Deprecated | StopReason::Disabled
            ),
            "{:?}",
            report.stop_reason
        );
    }

    // Runs started while the rollout is under way still start V1, and wait with no worker running.
    let mut earlier = Vec::new();
    for i in 0..3 {
        let run = client
            .start_deployed::<CommunityV1>(&thread(&format!("earlier {i}?")))
            .await
            .unwrap();
        assert_eq!(run.flow_slug(), V1);
        earlier.push(run);
    }

    // 3. Deploy every affected function while it stays disabled, each with both versions: the first one
    //    compiles V2; a fenced start activates nothing and claims nothing.
    assert!(
        !compiled(pool, V2).await,
        "V2 is compiled before any build serves it"
    );
    let err = classify(pool, true, true)
        .run(CancellationToken::new())
        .bounded()
        .await
        .unwrap_err();
    assert!(
        matches!(&err, WorkerError::FunctionDisabled { function_name, .. } if function_name == "community-classify"),
        "{err}"
    );
    assert_eq!(
        support::alias_target(pool, ALIAS).await.as_deref(),
        Some(V1)
    );
    assert!(compiled(pool, V2).await, "the fenced start compiled V2");
    let err = deliver(pool, true, true)
        .run(CancellationToken::new())
        .bounded()
        .await
        .unwrap_err();
    assert!(matches!(err, WorkerError::FunctionDisabled { .. }), "{err}");
    for run in &earlier {
        let (status, attempts, _) = support::task(pool, run.run_id(), "classify", 0).await;
        assert_eq!((status.as_str(), attempts), ("queued", 0));
    }

    // 4. Re-enable exactly the recorded set, and let supervision start them: the first one activates V2.
    execute(
        pool,
        "select pgflow.enable_worker_function(function_name) from rollout_fence",
    )
    .await;
    execute(pool, "drop table rollout_fence").await;
    let new_classify = support::spawn_with(classify(pool, true, true)).await;
    let new_deliver = support::spawn_with(deliver(pool, true, true)).await;
    let statuses = new_classify.deployments();
    assert_eq!(
        statuses[0].alias,
        AliasActivation::Superseded {
            alias: ALIAS.into(),
            by_flow_slug: V2.into()
        }
    );
    assert_eq!(
        statuses[1].alias,
        AliasActivation::Activated {
            alias: ALIAS.into(),
            previous_flow_slug: Some(V1.into())
        }
    );
    assert_eq!(
        new_deliver.deployments()[1].alias,
        AliasActivation::AlreadyActive {
            alias: ALIAS.into()
        }
    );
    let new_workers = [new_classify.id(), new_deliver.id()];

    // Runs started now use V2, even when started through the V1 deployment's alias.
    let mut later = Vec::new();
    for i in 0..3 {
        let run = client
            .start_deployed::<CommunityV1>(&thread(&format!("later {i}?")))
            .await
            .unwrap();
        assert_eq!(run.flow_slug(), V2);
        assert!(run.as_version::<ThreadsV1>().is_none());
        later.push(run.as_version::<ThreadsV2>().expect("a V2 run"));
    }
    for run in &later {
        assert_eq!(
            run.wait(LIMIT).await.unwrap().deliver_slack,
            "v2 delivered help (classified by v2)"
        );
    }
    // The earlier runs finished on V1's handlers, run by the new workers.
    for run in &earlier {
        assert_eq!(
            run.wait(LIMIT).await.unwrap().deliver_slack,
            "v1 delivered help (classified by v1)"
        );
        let ran_by = task_workers(pool, run.run_id()).await;
        assert!(!ran_by.is_empty(), "the run's tasks record who ran them");
        for worker in ran_by {
            assert!(new_workers.contains(&worker), "run by {worker}");
        }
    }
    assert_eq!(new_classify.stop().await.completed, 6);
    assert_eq!(new_deliver.stop().await.completed, 6);
}

#[tokio::test]
async fn the_first_new_worker_activates_the_alias_and_v2_tasks_of_the_other_queue_wait_durably_until_its_worker_starts(
) {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let client = Client::new(pool.clone());
    let c1 = support::spawn_with(classify(pool, true, false)).await;
    let d1 = support::spawn_with(deliver(pool, true, false)).await;
    let run = client
        .start_deployed::<CommunityV1>(&thread("v1?"))
        .await
        .unwrap();
    run.wait(LIMIT).await.unwrap();
    c1.stop().await;
    d1.stop().await;

    // The new classify worker starts first and switches new runs to V2.
    let c2 = support::spawn_with(classify(pool, true, true)).await;
    assert_eq!(
        c2.deployments()[1].alias,
        AliasActivation::Activated {
            alias: ALIAS.into(),
            previous_flow_slug: Some(V1.into())
        }
    );
    assert_eq!(
        support::alias_target(pool, ALIAS).await.as_deref(),
        Some(V2)
    );
    let run = client
        .start_deployed::<CommunityV2>(&thread("v2?"))
        .await
        .unwrap();
    assert_eq!(run.flow_slug(), V2);
    pgflow_tests::wait_until(LIMIT, "V2's classify to complete", || async {
        support::step_status(pool, run.run_id(), "classify").await == "completed"
    })
    .await;
    // Its deliver task waits in the deliver queue, durably, with nothing that could take it.
    let (status, attempts, _) = support::task(pool, run.run_id(), "deliverSlack", 0).await;
    assert_eq!((status.as_str(), attempts), ("queued", 0));
    let waiting: i64 = sqlx::query_scalar("select count(*) from pgmq.q_deliver_alerts")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(waiting, 1);
    let uncovered: bool = sqlx::query_scalar(
        "select uncovered from pgflow.queue_coverage where flow_slug = $1 and step_slug = 'deliverSlack'",
    )
    .bind(V2)
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(uncovered);

    // Its worker starts (the alias is already active) and the run completes.
    let d2 = support::spawn_with(deliver(pool, true, true)).await;
    assert_eq!(
        d2.deployments()[1].alias,
        AliasActivation::AlreadyActive {
            alias: ALIAS.into()
        }
    );
    assert_eq!(
        run.wait(LIMIT).await.unwrap().deliver_slack,
        "v2 delivered help (classified by v2)"
    );
    c2.stop().await;
    assert_eq!(d2.stop().await.completed, 1);
}

#[tokio::test]
async fn v1_is_retirable_only_after_its_runs_drain_and_then_a_worker_without_it_starts() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let client = Client::new(pool.clone());
    // V1 runs whose deliver tasks wait: V1's classify worker runs, no deliver worker yet.
    let c1 = support::spawn_with(classify(pool, true, false)).await;
    let mut v1_runs = Vec::new();
    for i in 0..2 {
        v1_runs.push(
            client
                .start_deployed::<CommunityV1>(&thread(&format!("old {i}?")))
                .await
                .unwrap(),
        );
    }
    for run in &v1_runs {
        pgflow_tests::wait_until(LIMIT, "V1's classify to complete", || async {
            support::step_status(pool, run.run_id(), "classify").await == "completed"
        })
        .await;
    }
    c1.stop().await;
    let c2 = support::spawn_with(classify(pool, true, true)).await;
    assert_eq!(
        support::alias_target(pool, ALIAS).await.as_deref(),
        Some(V2)
    );

    // V1 has left the classify queue, but not the deliver queue.
    assert_eq!(
        retirable(pool, V1, "classify_threads").await["retirable"],
        true
    );
    let blocked = retirable(pool, V1, "deliver_alerts").await;
    assert_eq!(blocked["retirable"], false, "{blocked}");
    let reasons: Vec<&str> = blocked["blockers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["reason"].as_str().unwrap())
        .collect();
    assert_eq!(reasons, ["started_run", "task_snapshot"], "{blocked}");
    assert_eq!(blocked["blockers"][0]["count"], 2);

    // A deliver worker without V1 refuses to start while V1 drains.
    let err = deliver(pool, false, true)
        .run(CancellationToken::new())
        .bounded()
        .await
        .unwrap_err();
    let WorkerError::CoverageGap { gaps, .. } = &err else {
        panic!("expected a coverage gap, got {err}");
    };
    assert!(
        gaps.iter()
            .all(|g| g.flow_slug == V1 && g.step_slug == "deliverSlack"),
        "{err}"
    );
    let reasons: Vec<GapReason> = gaps.iter().map(|g| g.reason).collect();
    assert_eq!(reasons, [GapReason::StartedRun, GapReason::TaskSnapshot]);

    // With both versions, V1 drains; then it is retirable from the deliver queue too.
    let d = support::spawn_with(deliver(pool, true, true)).await;
    for run in &v1_runs {
        assert_eq!(
            run.wait(LIMIT).await.unwrap().deliver_slack,
            "v1 delivered help (classified by v1)"
        );
    }
    let drained = retirable(pool, V1, "deliver_alerts").await;
    assert_eq!(drained["retirable"], true, "{drained}");
    assert_eq!(drained["blockers"], serde_json::json!([]));
    d.stop().await;

    // Registries without V1 now start, and V2 keeps running.
    c2.stop().await;
    let c3 = support::spawn_with(classify(pool, false, true)).await;
    let d3 = support::spawn_with(deliver(pool, false, true)).await;
    assert_eq!(c3.deployments().len(), 1);
    let run = client
        .start_deployed::<CommunityV2>(&thread("new?"))
        .await
        .unwrap();
    assert_eq!(
        run.wait(LIMIT).await.unwrap().deliver_slack,
        "v2 delivered help (classified by v2)"
    );
    c3.stop().await;
    d3.stop().await;
}

#[tokio::test]
async fn a_refused_start_of_a_retired_build_leaves_the_alias_where_it_was_and_an_operator_can_move_it(
) {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let client = Client::new(pool.clone());
    // Both versions compiled; V2 active; then a V2 run waits in the classify queue with no worker.
    let both = support::spawn_with(classify(pool, true, true)).await;
    both.stop().await;
    assert_eq!(
        support::alias_target(pool, ALIAS).await.as_deref(),
        Some(V2)
    );
    let run = client
        .start_deployed::<CommunityV2>(&thread("waiting?"))
        .await
        .unwrap();
    assert_eq!(run.flow_slug(), V2);

    // The retired V1-only build, started by mistake: refused, and the alias has not moved.
    let err = classify(pool, true, false)
        .run(CancellationToken::new())
        .bounded()
        .await
        .unwrap_err();
    let WorkerError::CoverageGap { gaps, .. } = &err else {
        panic!("expected a coverage gap, got {err}");
    };
    assert!(gaps.iter().all(|g| g.flow_slug == V2), "{err}");
    assert_eq!(
        support::alias_target(pool, ALIAS).await.as_deref(),
        Some(V2),
        "a refused start moved the alias"
    );

    // An operator rolls back explicitly, and forward again; an unknown version is refused by name.
    let back: Value = sqlx::query_scalar("select pgflow.activate_alias($1, $2)")
        .bind(ALIAS)
        .bind(V1)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(back["activated"], true, "{back}");
    assert_eq!(back["previous_flow_slug"], V2, "{back}");
    let again: Value = sqlx::query_scalar("select pgflow.activate_alias($1, $2)")
        .bind(ALIAS)
        .bind(V2)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(again["flow_slug"], V2, "{again}");
    let err = sqlx::query("select pgflow.activate_alias($1, 'communityThreadsV9')")
        .bind(ALIAS)
        .execute(pool)
        .await
        .unwrap_err();
    let db_err = err.as_database_error().unwrap();
    assert_eq!(SqlState::of(&err), Some(SqlState::AliasTargetMissing));
    assert!(db_err.message().contains("communityThreadsV9"), "{err}");

    // The current build starts and the waiting run completes.
    let c = support::spawn_with(classify(pool, false, true)).await;
    let d = support::spawn_with(deliver(pool, false, true)).await;
    assert_eq!(
        run.as_version::<ThreadsV2>()
            .expect("a V2 run")
            .wait(LIMIT)
            .await
            .unwrap()
            .deliver_slack,
        "v2 delivered help (classified by v2)"
    );
    c.stop().await;
    d.stop().await;
}

#[tokio::test]
async fn a_handle_typed_by_one_version_refuses_to_wait_for_a_run_of_another() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let client = Client::new(pool.clone());
    let both = support::spawn_with(classify(pool, true, true)).await;
    both.stop().await;
    // The alias points at V2: a start through V1's deployment runs V2.
    let run = client
        .start_deployed::<CommunityV1>(&thread("which?"))
        .await
        .unwrap();
    assert_eq!(run.flow_slug(), V2);
    let Err(err) = run.wait(LIMIT).await else {
        panic!("a V1 handle decoded a V2 run");
    };
    assert!(
        matches!(&err, pgflow_runtime::client::WaitError::OtherVersion { expected_flow_slug, flow_slug, .. }
            if *expected_flow_slug == V1 && flow_slug == V2),
        "{err}"
    );
    assert!(err.to_string().contains("as_version"), "{err}");
    assert!(run.as_version::<ThreadsV2>().is_some());
}

#[tokio::test]
async fn an_operators_rollback_holds_until_a_build_serving_another_version_last_starts() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let client = Client::new(pool.clone());
    // Both versions compiled, V2 active, no worker running.
    support::spawn_with(classify(pool, true, true))
        .await
        .stop()
        .await;

    // The operator rolls back: runs started by alias are V1 again, even through V2's deployment.
    activate(pool, V1, V2).await;
    let run = client
        .start_deployed::<CommunityV2>(&thread("back?"))
        .await
        .unwrap();
    assert_eq!(run.flow_slug(), V1);
    let run = run.as_version::<ThreadsV1>().expect("a V1 run");

    // The current V2-only build cannot run it: refused, naming V1's pairs, and the rollback stays.
    let err = classify(pool, false, true)
        .run(CancellationToken::new())
        .bounded()
        .await
        .unwrap_err();
    let WorkerError::CoverageGap { gaps, .. } = &err else {
        panic!("expected a coverage gap, got {err}");
    };
    assert!(gaps.iter().all(|g| g.flow_slug == V1), "{err}");
    assert_eq!(
        support::alias_target(pool, ALIAS).await.as_deref(),
        Some(V1)
    );
    let status: String = sqlx::query_scalar("select status from pgflow.runs where run_id = $1")
        .bind(run.run_id())
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(status, "started", "the V1 run waits for a build serving V1");

    // Rollback builds (V1 served last) keep the alias at V1 and run the V1 run.
    let c = support::spawn_with(classify_v2_then_v1(pool)).await;
    let d = support::spawn_with(deliver_v2_then_v1(pool)).await;
    let already_v1 = AliasActivation::AlreadyActive {
        alias: ALIAS.into(),
    };
    assert_eq!(last_activation(&c), already_v1);
    assert_eq!(
        run.wait(LIMIT).await.unwrap().deliver_slack,
        "v1 delivered help (classified by v1)"
    );
    d.stop().await;
    c.stop().await;

    // The operator rolls forward; a rollback build started again moves the alias back to V1.
    activate(pool, V2, V1).await;
    let c = support::spawn_with(classify_v2_then_v1(pool)).await;
    let back_to_v1 = AliasActivation::Activated {
        alias: ALIAS.into(),
        previous_flow_slug: Some(V2.into()),
    };
    assert_eq!(last_activation(&c), back_to_v1);
    c.stop().await;
    // Builds serving V2 last move it to V2 for good.
    let c = support::spawn_with(classify(pool, true, true)).await;
    assert_eq!(
        last_activation(&c),
        AliasActivation::Activated {
            alias: ALIAS.into(),
            previous_flow_slug: Some(V1.into())
        }
    );
    c.stop().await;

    // With nothing of V2 in flight, the retired V1-only build passes its checks and moves the alias to V1:
    // only keeping it where supervision cannot start it prevents that.
    let retired = support::spawn_with(classify(pool, true, false)).await;
    assert_eq!(last_activation(&retired), back_to_v1);
    retired.stop().await;
    assert_eq!(
        support::alias_target(pool, ALIAS).await.as_deref(),
        Some(V1)
    );
}
