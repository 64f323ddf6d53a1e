//! Rolling a flow out from V1 to V2 behind one alias: two versions routed to the same named queues, a queue
//! worker per queue serving both while V1 drains, starts by alias, and V1 retired once nothing needs it.
//!
//! `cargo run -p pgflow-examples --bin rollout` (a throwaway PostgreSQL when `DATABASE_URL` is unset).
//! In production, fence the rollout as `pgflow-sql/OPERATIONS.md` shows ("Rolling out a new version behind
//! an alias"), so that supervision cannot restart old builds while the new ones deploy.

use std::time::Duration;

use pgflow_runtime::worker::WorkerHandle;
use pgflow_runtime::{prelude::*, BoxError};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// Version 1: decide whether a thread is a question, then deliver it.
#[flow(slug = "threadsV1", input = String)]
pub mod threads_v1 {
    use super::*;

    /// Whether the thread asks something.
    #[step]
    async fn classify(text: String) -> Result<bool, StepError> {
        Ok(text.contains('?'))
    }

    /// Delivers the thread.
    #[step(depends_on = [classify])]
    async fn deliver(classify: bool) -> Result<String, StepError> {
        Ok(format!("v1 delivered it (question: {classify})"))
    }
}

/// Version 2: the same steps with new handlers.
#[flow(slug = "threadsV2", input = String)]
pub mod threads_v2 {
    use super::*;

    /// Whether the thread asks something.
    #[step]
    async fn classify(text: String) -> Result<bool, StepError> {
        Ok(text.trim_end().ends_with('?'))
    }

    /// Delivers the thread, louder.
    #[step(depends_on = [classify])]
    async fn deliver(classify: bool) -> Result<String, StepError> {
        Ok(format!("V2 DELIVERED IT (QUESTION: {classify})"))
    }
}

/// The queue of `classify`, shared by both versions.
#[queue("classify_threads")]
pub struct ClassifyThreads;

/// The queue of `deliver`, shared by both versions.
#[queue("deliver_threads")]
pub struct DeliverThreads;

/// V1 behind the alias `threads`.
#[deployment(alias = "threads")]
pub fn threads_on_v1(step: threads_v1::Step) {
    match step {
        threads_v1::Step::Classify => ClassifyThreads,
        threads_v1::Step::Deliver => DeliverThreads,
    }
}

/// V2 behind the same alias, on the same queues.
#[deployment(alias = "threads")]
pub fn threads_on_v2(step: threads_v2::Step) {
    match step {
        threads_v2::Step::Classify => ClassifyThreads,
        threads_v2::Step::Deliver => DeliverThreads,
    }
}

/// Starts the worker function of queue `Q` serving V1 and/or V2. Of the versions a build serves, its
/// startup points the alias at the one served last.
async fn spawn<Q: Queue>(pool: &PgPool, v1: bool, v2: bool) -> Result<WorkerHandle, BoxError>
where
    ThreadsOnV1: RoutesTo<Q>,
    ThreadsOnV2: RoutesTo<Q>,
{
    let mut b = QueueWorker::<Q>::builder(pool.clone()).worker_name(Q::NAME);
    if v1 {
        b = b.serve::<ThreadsOnV1>();
    }
    if v2 {
        b = b.serve::<ThreadsOnV2>();
    }
    let worker = b.build()?.spawn(CancellationToken::new()).await?;
    println!("  {}", worker.deployments().last().expect("a version"));
    Ok(worker)
}

/// Deploys a build of each worker function.
async fn deploy(pool: &PgPool, v1: bool, v2: bool) -> Result<[WorkerHandle; 2], BoxError> {
    let classify = spawn::<ClassifyThreads>(pool, v1, v2).await?;
    Ok([classify, spawn::<DeliverThreads>(pool, v1, v2).await?])
}

async fn stop(workers: [WorkerHandle; 2]) -> Result<(), BoxError> {
    for worker in workers {
        worker.stop().await?;
    }
    Ok(())
}

/// Starts a run by the alias and waits for it: the version is whichever the alias points at.
async fn start(client: &Client, text: &str) -> Result<(), BoxError> {
    let run = client.start_deployed::<ThreadsOnV1>(&text.into()).await?;
    let output = client
        .wait_json(run.run_id(), Duration::from_secs(30))
        .await?;
    println!("  {}: {}", run.flow_slug(), output["deliver"]);
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let db = pgflow_sql::throwaway::fresh_database(pgflow_sql::throwaway::Contents::Empty).await?;
    let pool = db.pool().clone();
    pgflow_sql::install(&pool).await?;
    let client = Client::new(pool.clone());

    println!("1. V1 in production, started by alias");
    let v1_builds = deploy(&pool, true, false).await?;
    start(&client, "is it on?").await?;
    stop(v1_builds).await?;

    println!("2. The old builds stop; a run started now is V1 and waits in the queues");
    let text = "anyone there?".to_owned();
    let in_flight = client.start_deployed::<ThreadsOnV1>(&text).await?;

    println!("3. The V1+V2 builds start: V2 is compiled and the alias moves to it");
    let both = deploy(&pool, true, true).await?;
    start(&client, "what's new?").await?;
    // The earlier run drains on V1's handlers, which the new builds still serve.
    let drained = in_flight.wait(Duration::from_secs(30)).await?;
    println!("  {}: {:?}", in_flight.flow_slug(), drained.deliver);

    println!("4. Once nothing on its queues needs V1, V2-only builds replace the others");
    let retirable: bool = sqlx::query_scalar(
        "select bool_and((pgflow.version_retirable('threadsV1', queue) ->> 'retirable')::bool) \
         from unnest(array['classify_threads', 'deliver_threads']) queue",
    )
    .fetch_one(&pool)
    .await?;
    if !retirable {
        return Err("V1 is still needed: pgflow.version_retirable lists why".into());
    }
    stop(both).await?;
    let v2_builds = deploy(&pool, false, true).await?;
    start(&client, "still here?").await?;
    stop(v2_builds).await
}
