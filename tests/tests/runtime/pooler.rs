//! Through PgBouncer in transaction pooling mode: flow workers, step-queued workers, queue workers, the
//! client's start and wait, the rollout fence and a worker restart, end to end. PgBouncer gets fewer server
//! connections than its clients open, so consecutive transactions of one client connection run on
//! different server connections (what breaks named prepared statements and session state).
#![allow(unreachable_pub)] // flow input types appear in the generated (public) flow items

use std::time::Duration;

use pgflow_runtime::worker::{ConfigError, WorkerError};
use pgflow_runtime::{
    deployment, flow, pooling::Pooling, queue, Client, QueueWorker, StepError, StepQueued, Worker,
};
use pgflow_sql::throwaway::TempPgBouncer;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgPool};

use crate::support::{self, Bounded, LIMIT};

#[flow(slug = "pooledDiamond", input = u32)]
mod diamond {
    use super::*;
    use pgflow_runtime::StepContext;

    #[step]
    async fn root(n: u32) -> Result<u32, StepError> {
        Ok(n + 1)
    }

    #[step(depends_on = [root])]
    async fn left(root: u32) -> Result<u32, StepError> {
        Ok(root * 2)
    }

    #[step(depends_on = [root])]
    async fn right(root: u32) -> Result<u32, StepError> {
        Ok(root * 3)
    }

    #[step(depends_on = [left, right])]
    async fn join(left: u32, right: u32, ctx: &StepContext<Diamond>) -> Result<u32, StepError> {
        // Reads the run input through the pool (`StepContext::flow_input`).
        let input = ctx.flow_input().await?;
        Ok(left + right + *input)
    }
}

#[flow(slug = "pooledSteps", input = u32, step_queues)]
mod per_step {
    use super::*;

    #[step]
    async fn first(n: u32) -> Result<u32, StepError> {
        Ok(n * 10)
    }

    #[step(depends_on = [first])]
    async fn second(first: u32) -> Result<u32, StepError> {
        Ok(first + 1)
    }
}

#[flow(slug = "pooledQueued", input = u32)]
mod queued {
    use super::*;

    #[step]
    async fn only(n: u32) -> Result<u32, StepError> {
        Ok(n + 7)
    }
}

#[queue("pooled_work")]
struct PooledWork;

#[deployment(alias = "pooledQueue")]
fn pooled_queue(step: queued::Step) {
    match step {
        queued::Step::Only => PooledWork,
    }
}

/// PgBouncer with two server connections in front of `db`, and a pool of eight client connections through it.
async fn bouncer(db: &pgflow_tests::TestDb) -> (TempPgBouncer, PgPool) {
    bouncer_with(db, 2).await
}

/// A PgBouncer in transaction mode with `server_connections` connections to `db`, and a pool through it.
async fn bouncer_with(
    db: &pgflow_tests::TestDb,
    server_connections: u32,
) -> (TempPgBouncer, PgPool) {
    let server = pgflow_sql::throwaway::server().await.expect("server");
    let bouncer = TempPgBouncer::start(&server.options(db.name()), server_connections)
        .await
        .unwrap_or_else(|e| panic!("cannot start pgbouncer: {e}"));
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect_with(bouncer.options(db.name()))
        .await
        .expect("connect through pgbouncer");
    (bouncer, pool)
}

fn pooled<K>(
    b: pgflow_runtime::worker::WorkerBuilder<K>,
) -> pgflow_runtime::worker::WorkerBuilder<K> {
    support::fast(b).pooling(Pooling::transaction())
}

#[tokio::test]
async fn flow_workers_and_the_client_work_through_pgbouncer_in_transaction_mode_across_a_restart() {
    let db = pgflow_tests::test_db().await;
    let (_bouncer, pool) = bouncer(&db).await;
    let client = Client::new(pool.clone())
        .with_pooling(Pooling::transaction())
        .with_poll_fallback(Duration::from_millis(20));

    // Two workers on one flow: their transactions interleave on PgBouncer's two server connections.
    let a = support::spawn_with(pooled(Worker::<diamond::Diamond>::builder(pool.clone()))).await;
    let b = support::spawn_with(pooled(Worker::<diamond::Diamond>::builder(pool.clone()))).await;
    let mut runs = Vec::new();
    for n in 0..20u32 {
        runs.push((
            n,
            client.start::<diamond::Diamond>(&n).await.expect("start"),
        ));
    }
    let many = client
        .start_many::<diamond::Diamond>(&[100, 200])
        .await
        .expect("start_many");
    for (n, run) in runs {
        assert_eq!(
            run.wait(LIMIT).await.expect("run completes").join,
            (n + 1) * 5 + n
        );
    }
    for (run, n) in many.into_iter().zip([100u32, 200]) {
        assert_eq!(
            run.wait(LIMIT).await.expect("run completes").join,
            (n + 1) * 5 + n
        );
    }

    // A restart: both stop, work started meanwhile waits, a new worker finishes it.
    a.stop().await;
    b.stop().await;
    let later = client.start::<diamond::Diamond>(&7).await.expect("start");
    let c = support::spawn_with(pooled(Worker::<diamond::Diamond>::builder(pool.clone()))).await;
    assert_eq!(
        later.wait(LIMIT).await.expect("run completes").join,
        8 * 5 + 7
    );
    let state = client
        .run(later.run_id())
        .await
        .expect("run")
        .expect("exists");
    assert_eq!(
        state.run.status,
        pgflow_runtime::client::RunStatus::Completed
    );
    c.stop().await;
}

#[tokio::test]
async fn step_queued_and_queue_workers_work_through_pgbouncer_and_the_fence_holds() {
    let db = pgflow_tests::test_db().await;
    let (_bouncer, pool) = bouncer(&db).await;
    let client = Client::new(pool.clone())
        .with_pooling(Pooling::transaction())
        .with_poll_fallback(Duration::from_millis(20));

    let first = support::spawn_with(pooled(
        StepQueued::<per_step::PerStep>::worker(per_step::Step::First).builder(pool.clone()),
    ))
    .await;
    let second = support::spawn_with(pooled(
        StepQueued::<per_step::PerStep>::worker(per_step::Step::Second).builder(pool.clone()),
    ))
    .await;
    let queue = support::spawn_with(pooled(
        QueueWorker::<PooledWork>::builder(pool.clone()).serve::<PooledQueue>(),
    ))
    .await;
    for n in 0..5u32 {
        let run = client.start::<per_step::PerStep>(&n).await.expect("start");
        assert_eq!(run.wait(LIMIT).await.expect("completes").second, n * 10 + 1);
        let run = client
            .start_deployed::<PooledQueue>(&n)
            .await
            .expect("start by alias");
        assert_eq!(run.flow_slug(), "pooledQueued");
        assert_eq!(run.wait(LIMIT).await.expect("completes").only, n + 7);
    }
    queue.stop().await;

    // The rollout fence: a disabled worker function refuses to start through the pooler too.
    sqlx::query("select pgflow.disable_worker_function('pooled_work', 'rollout under test')")
        .execute(db.pool())
        .await
        .expect("disable");
    let err = pooled(QueueWorker::<PooledWork>::builder(pool.clone()).serve::<PooledQueue>())
        .build()
        .expect("valid config")
        .run(tokio_util::sync::CancellationToken::new())
        .bounded()
        .await
        .expect_err("fenced");
    assert!(
        matches!(err, WorkerError::FunctionDisabled { ref function_name, .. } if function_name == "pooled_work"),
        "{err}"
    );
    sqlx::query("select pgflow.enable_worker_function('pooled_work')")
        .execute(db.pool())
        .await
        .expect("enable");
    let queue = support::spawn_with(pooled(
        QueueWorker::<PooledWork>::builder(pool.clone()).serve::<PooledQueue>(),
    ))
    .await;
    let run = client
        .start_deployed::<PooledQueue>(&1)
        .await
        .expect("start");
    assert_eq!(run.wait(LIMIT).await.expect("completes").only, 8);
    for w in [first, second, queue] {
        w.stop().await;
    }
}

#[tokio::test]
async fn a_direct_listen_connection_wakes_pooled_workers_and_waits() {
    let db = pgflow_tests::test_db().await;
    // One server connection: a start signals from the very server process that ran the worker's exchanges,
    // and the worker must still wake for it.
    let (_bouncer, pool) = bouncer_with(&db, 1).await;
    let direct = db.options();
    let client = Client::new(pool.clone())
        .with_pooling(Pooling::transaction_with_listen(direct.clone()))
        // Longer than the whole test's limit: only a notification can end the wait in time.
        .with_poll_fallback(Duration::from_secs(600));
    let worker = support::spawn_with(
        support::fast(Worker::<diamond::Diamond>::builder(pool.clone()))
            .pooling(Pooling::transaction_with_listen(direct))
            .poll_interval(Duration::from_secs(600))
            .max_poll_wait(Duration::from_secs(600)),
    )
    .await;
    // The second start comes after the worker's exchanges of the first run, from their server process.
    for n in [2, 3] {
        let run = client.start::<diamond::Diamond>(&n).await.expect("start");
        assert_eq!(
            run.wait(LIMIT).await.expect("completes").join,
            5 * (n + 1) + n
        );
    }
    worker.stop().await;
}

#[tokio::test]
async fn auto_install_behind_a_transaction_pooler_is_refused_with_the_way_out() {
    let pool = PgPoolOptions::new()
        .connect_lazy("postgres://localhost/unused")
        .expect("lazy");
    let Err(err) = Worker::<diamond::Diamond>::builder(pool)
        .pooling(Pooling::transaction())
        .auto_install(true)
        .build()
    else {
        panic!("auto_install behind a transaction pooler was accepted");
    };
    assert_eq!(err, ConfigError::AutoInstallBehindPooler);
    assert!(err.to_string().contains("direct connection"), "{err}");
}

#[tokio::test]
async fn installing_through_pgbouncer_is_refused_with_the_way_out() {
    let db = pgflow_tests::db_with(pgflow_tests::Contents::Empty).await;
    let server = pgflow_sql::throwaway::server().await.expect("server");
    // One server connection: another client's named statement is certainly on it.
    let bouncer = TempPgBouncer::start(&server.options(db.name()), 1)
        .await
        .unwrap_or_else(|e| panic!("cannot start pgbouncer: {e}"));
    let mut other = sqlx::PgConnection::connect_with(&bouncer.options(db.name()))
        .await
        .expect("connect");
    sqlx::query_scalar::<_, i32>("select 1")
        .fetch_one(&mut other)
        .await
        .expect("a named statement on the server connection");
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(bouncer.options(db.name()))
        .await
        .expect("connect through pgbouncer");
    let err = pgflow_sql::install(&pool).await.expect_err("refused");
    assert!(
        matches!(err, pgflow_sql::InstallError::ThroughPooler(_)),
        "{err}"
    );
    assert!(err.to_string().contains("direct connection"), "{err}");
    let schema: Option<String> =
        sqlx::query_scalar("select nspname::text from pg_namespace where nspname = 'pgflow'")
            .fetch_optional(db.pool())
            .await
            .expect("read");
    assert_eq!(schema, None, "nothing installed");
}
