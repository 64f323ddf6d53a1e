//! The community-threads pipeline (`classify` → `deliverSlack`) deployed behind the stable alias
//! `communityThreads`, each step on a shared, named queue served by its own worker function, and the
//! fenced procedure that rolls it from V1 to V2 while runs are in flight (`pgflow-sql/OPERATIONS.md`,
//! "Rolling out a new version behind an alias").
//!
//! The module is what an application owns, in four parts:
//!
//! * **domain**: the thread tables and the two handlers' work, with their transition guards
//!   ([`DOMAIN_SCHEMA`], [`classify_thread`], [`deliver_thread`]);
//! * **versions**: two `#[flow]` modules, [`threads_v1`] and [`threads_v2`] (V2 adds a confidence to
//!   the classification);
//! * **routing**: two `#[queue]`s and one `#[deployment]` per version, both behind the same alias;
//! * **operations**: one worker builder per worker function ([`classify_worker`], [`deliver_worker`]),
//!   the SQL steps of the fence ([`fence`], [`deprecate_and_wait`], [`lift_fence`]), the retirement check
//!   ([`version_retirable`]) and the operator's explicit alias move ([`activate_alias`]) for a rollback or a
//!   roll forward.
//!
//! The `community_rollout` binary runs it all end to end and measures it; `examples/INTEGRATION.md` is its
//! report.
//!
//! The handlers stand in for a model call and a Slack webhook, with deterministic trouble: some threads
//! make the model fail once ([`overloaded_once`]), and two thread ids are slow on purpose
//! ([`SLOW_MODEL_THREAD`], [`SLOW_WEBHOOK_THREAD`]) so that a fault can be injected while they run. Every
//! handler invocation is written to `community.invocations` (instrumentation, not domain) so that the
//! binary can count retries, overlaps and duplicates across worker processes.

use std::time::{Duration, Instant};

use pgflow_runtime::{
    deployment, queue, worker::OnQueue, worker::WorkerBuilder, Flow, Queue, QueueWorker, RoutesTo,
    StepContext, StepError,
};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;

// ------------------------------------------------------------------------------------------------------
// Domain
// ------------------------------------------------------------------------------------------------------

/// A community thread to triage: the flow input of every version.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Thread {
    /// The thread's id (`community.threads.id`).
    pub id: i64,
    /// Its text.
    pub text: String,
}

/// What V1's `classify` decided.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Label {
    /// `help` (delivered to Slack) or `chat`.
    pub route: String,
}

/// What V2's `classify` decides: V1's route plus the model's confidence.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScoredLabel {
    /// `help` (delivered to Slack) or `chat`.
    pub route: String,
    /// How sure the model is, 0 to 1.
    pub confidence: f64,
}

/// What `deliverSlack` did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Delivery {
    /// The channel posted to.
    pub channel: String,
    /// The version of the handler that ran (`v1` or `v2`).
    pub version: String,
    /// The attempt that produced this output.
    pub attempt: i32,
    /// `false` when the post already existed (the domain guard refused a second one).
    pub posted: bool,
}

/// The application's tables, created once before any worker starts: the threads with their status
/// (`new` → `classified` → `delivered`), the Slack posts (one per thread, the unique key is the guard
/// against posting twice), and `invocations`, one row per handler call (instrumentation for the report).
pub const DOMAIN_SCHEMA: &str = "
create schema if not exists community;
create table if not exists community.threads (
  id bigint primary key,
  body text not null,
  status text not null default 'new' check (status in ('new', 'classified', 'delivered')),
  route text,
  confidence double precision,
  classified_by text
);
create table if not exists community.slack_posts (
  thread_id bigint primary key references community.threads (id),
  channel text not null,
  body text not null,
  posted_by text not null,
  attempt int not null,
  posted_at timestamptz not null default clock_timestamp()
);
create table if not exists community.invocations (
  id bigserial primary key,
  flow_slug text not null,
  step_slug text not null,
  run_id uuid not null,
  thread_id bigint not null,
  attempt int not null,
  pid int not null,
  started_at timestamptz not null default clock_timestamp(),
  finished_at timestamptz,
  outcome text
);
";

/// The thread whose classification takes [`SLOW_CALL`] (the model is slow for it).
pub const SLOW_MODEL_THREAD: i64 = 9_001;
/// The thread whose Slack delivery takes [`SLOW_CALL`] (the webhook is slow for it).
pub const SLOW_WEBHOOK_THREAD: i64 = 9_002;
/// How long the slow calls take.
pub const SLOW_CALL: Duration = Duration::from_millis(2_500);

/// How long classifying thread `id` takes: 150 to 450 ms, spread deterministically; [`SLOW_CALL`] for
/// [`SLOW_MODEL_THREAD`].
pub fn classify_cost(id: i64) -> Duration {
    if id == SLOW_MODEL_THREAD {
        return SLOW_CALL;
    }
    let spread = (id as u64).wrapping_mul(2_654_435_761) % 301;
    Duration::from_millis(150 + spread)
}

/// Whether the model is overloaded on the first attempt for thread `id` (every id ending in 3): the
/// handler fails once, asking for a retry after a second.
pub fn overloaded_once(id: i64) -> bool {
    id % 10 == 3
}

/// One handler call, as `community.invocations` records it.
struct Invocation {
    id: i64,
    pool: PgPool,
}

impl Invocation {
    async fn begin(
        pool: &PgPool,
        flow_slug: &str,
        step_slug: &str,
        run_id: Uuid,
        thread_id: i64,
        attempt: i32,
    ) -> Result<Self, sqlx::Error> {
        let id = sqlx::query_scalar(
            "insert into community.invocations (flow_slug, step_slug, run_id, thread_id, attempt, pid) \
             values ($1, $2, $3, $4, $5, $6) returning id",
        )
        .bind(flow_slug)
        .bind(step_slug)
        .bind(run_id)
        .bind(thread_id)
        .bind(attempt)
        .bind(i32::try_from(std::process::id()).unwrap_or(i32::MAX))
        .fetch_one(pool)
        .await?;
        Ok(Invocation {
            id,
            pool: pool.clone(),
        })
    }

    async fn end(self, outcome: &str) -> Result<(), sqlx::Error> {
        sqlx::query(
            "update community.invocations set finished_at = clock_timestamp(), outcome = $2 where id = $1",
        )
        .bind(self.id)
        .bind(outcome)
        .execute(&self.pool)
        .await?;
        Ok(())
    }
}

/// Who is calling a handler: the facts of the step context the handlers need.
#[derive(Debug, Clone)]
pub struct Call {
    /// The concrete flow slug.
    pub flow_slug: &'static str,
    /// The version's short name (`v1`, `v2`).
    pub version: &'static str,
    /// The run.
    pub run_id: Uuid,
    /// The attempt (1 for the first).
    pub attempt: i32,
    /// The worker's pool.
    pub pool: PgPool,
}

impl Call {
    /// The call of a handler of flow `F`, version `version`, from its step context.
    pub fn of<F: Flow>(ctx: &StepContext<F>, version: &'static str) -> Self {
        Call {
            flow_slug: F::SLUG,
            version,
            run_id: ctx.run_id(),
            attempt: ctx.attempt(),
            pool: ctx.pool().clone(),
        }
    }
}

/// `classify` of every version: asks the "model" (a sleep), fails once when it is overloaded, and moves
/// the thread to `classified` unless it is already delivered (the transition guard). Returns the route and
/// the model's confidence; V1 drops the confidence.
///
/// # Errors
/// A retryable error when the model is overloaded or the database fails.
pub async fn classify_thread(call: &Call, thread: &Thread) -> Result<(String, f64), StepError> {
    let inv = Invocation::begin(
        &call.pool,
        call.flow_slug,
        "classify",
        call.run_id,
        thread.id,
        call.attempt,
    )
    .await?;
    tokio::time::sleep(classify_cost(thread.id)).await;
    if overloaded_once(thread.id) && call.attempt == 1 {
        inv.end("failed").await?;
        return Err(
            StepError::msg("model overloaded (HTTP 429)").retry_after(Duration::from_secs(1))
        );
    }
    let (route, confidence) = if thread.text.contains('?') {
        ("help", 0.92)
    } else {
        ("chat", 0.71)
    };
    sqlx::query(
        "update community.threads set status = 'classified', route = $2, confidence = $3, classified_by = $4 \
         where id = $1 and status in ('new', 'classified')",
    )
    .bind(thread.id)
    .bind(route)
    .bind(confidence)
    .bind(call.flow_slug)
    .execute(&call.pool)
    .await?;
    inv.end("ok").await?;
    Ok((route.to_owned(), confidence))
}

/// `deliverSlack` of every version: posts to the "webhook" (a sleep), records the post at most once per
/// thread (`on conflict do nothing`: a second delivery of the same thread, say by an attempt that was
/// presumed dead, changes nothing) and moves the thread from `classified` to `delivered`.
///
/// # Errors
/// A retryable error when the database fails.
pub async fn deliver_thread(
    call: &Call,
    thread_id: i64,
    route: &str,
    body: String,
) -> Result<Delivery, StepError> {
    let inv = Invocation::begin(
        &call.pool,
        call.flow_slug,
        "deliverSlack",
        call.run_id,
        thread_id,
        call.attempt,
    )
    .await?;
    let cost = if thread_id == SLOW_WEBHOOK_THREAD {
        SLOW_CALL
    } else {
        Duration::from_millis(5)
    };
    tokio::time::sleep(cost).await;
    let channel = format!("#community-{route}");
    let mut tx = call.pool.begin().await?;
    let posted = sqlx::query(
        "insert into community.slack_posts (thread_id, channel, body, posted_by, attempt) \
         values ($1, $2, $3, $4, $5) on conflict (thread_id) do nothing",
    )
    .bind(thread_id)
    .bind(&channel)
    .bind(&body)
    .bind(call.flow_slug)
    .bind(call.attempt)
    .execute(&mut *tx)
    .await?
    .rows_affected()
        == 1;
    sqlx::query(
        "update community.threads set status = 'delivered' where id = $1 and status = 'classified'",
    )
    .bind(thread_id)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    inv.end(if posted { "ok" } else { "duplicate" }).await?;
    Ok(Delivery {
        channel,
        version: call.version.to_owned(),
        attempt: call.attempt,
        posted,
    })
}

// ------------------------------------------------------------------------------------------------------
// Versions
// ------------------------------------------------------------------------------------------------------

/// Version 1: `classify` labels a thread `help` or `chat`; `deliverSlack` posts help threads.
#[pgflow_runtime::flow(slug = "communityThreadsV1", input = Thread, max_attempts = 3, timeout = 10)]
pub mod threads_v1 {
    use super::{classify_thread, deliver_thread, Call, Delivery, Label, Thread};
    use pgflow_runtime::{StepContext, StepError};

    /// Labels the thread.
    #[step]
    async fn classify(thread: Thread, ctx: &StepContext<ThreadsV1>) -> Result<Label, StepError> {
        let call = Call::of(ctx, "v1");
        let (route, _confidence) = classify_thread(&call, &thread).await?;
        Ok(Label { route })
    }

    /// Posts help threads to Slack.
    #[step(depends_on = [classify], slug = "deliverSlack", if = { classify: { route: "help" } })]
    async fn deliver_slack(
        classify: Label,
        ctx: &StepContext<ThreadsV1>,
    ) -> Result<Delivery, StepError> {
        let call = Call::of(ctx, "v1");
        let thread = ctx.flow_input().await?;
        let body = format!("New {} thread: {}", classify.route, thread.text);
        deliver_thread(&call, thread.id, &classify.route, body).await
    }
}

/// Version 2: the same steps; `classify` also returns the model's confidence, and the Slack post shows it.
#[pgflow_runtime::flow(slug = "communityThreadsV2", input = Thread, max_attempts = 3, timeout = 10)]
pub mod threads_v2 {
    use super::{classify_thread, deliver_thread, Call, Delivery, ScoredLabel, Thread};
    use pgflow_runtime::{StepContext, StepError};

    /// Labels the thread and scores the label.
    #[step]
    async fn classify(
        thread: Thread,
        ctx: &StepContext<ThreadsV2>,
    ) -> Result<ScoredLabel, StepError> {
        let call = Call::of(ctx, "v2");
        let (route, confidence) = classify_thread(&call, &thread).await?;
        Ok(ScoredLabel { route, confidence })
    }

    /// Posts help threads to Slack, with the confidence.
    #[step(depends_on = [classify], slug = "deliverSlack", if = { classify: { route: "help" } })]
    async fn deliver_slack(
        classify: ScoredLabel,
        ctx: &StepContext<ThreadsV2>,
    ) -> Result<Delivery, StepError> {
        let call = Call::of(ctx, "v2");
        let thread = ctx.flow_input().await?;
        let body = format!(
            "New {} thread ({:.0}% sure): {}",
            classify.route,
            classify.confidence * 100.0,
            thread.text
        );
        deliver_thread(&call, thread.id, &classify.route, body).await
    }
}

// ------------------------------------------------------------------------------------------------------
// Routing
// ------------------------------------------------------------------------------------------------------

/// The alias producers start, whatever version is current.
pub const ALIAS: &str = "communityThreads";

/// The queue of `classify`, shared by every version.
#[queue("classify_threads")]
pub struct ClassifyThreads;

/// The queue of `deliverSlack`, shared by every version.
#[queue("deliver_slack_alerts")]
pub struct DeliverSlackAlerts;

/// V1 behind `communityThreads`.
#[deployment(alias = "communityThreads")]
pub fn community_threads_v1(step: threads_v1::Step) {
    match step {
        threads_v1::Step::Classify => ClassifyThreads,
        threads_v1::Step::DeliverSlack => DeliverSlackAlerts,
    }
}

/// V2 behind `communityThreads`, on the same queues.
#[deployment(alias = "communityThreads")]
pub fn community_threads_v2(step: threads_v2::Step) {
    match step {
        threads_v2::Step::Classify => ClassifyThreads,
        threads_v2::Step::DeliverSlack => DeliverSlackAlerts,
    }
}

// ------------------------------------------------------------------------------------------------------
// Operations
// ------------------------------------------------------------------------------------------------------

/// The worker function (deployment unit) of the `classify_threads` queue.
pub const CLASSIFY_FUNCTION: &str = "community-classify";
/// The worker function of the `deliver_slack_alerts` queue.
pub const DELIVER_FUNCTION: &str = "community-deliver";

/// Which versions a build of a worker function serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Versions {
    /// V1 only: the build before the rollout.
    V1,
    /// V1 and V2, V2 served last: the build while V1 drains. Its startup points the alias at V2 once its
    /// function is enabled and its queue's coverage holds.
    V1AndV2,
    /// V2 and V1, V1 served last: the rollback build, whose startup keeps (or points) the alias at V1, so
    /// that an operator's rollback to V1 survives restarts.
    V2AndV1,
    /// V2 only: the build after V1 is retired.
    V2,
}

impl Versions {
    /// Parses `v1`, `v1v2`, `v2v1` or `v2`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "v1" => Some(Versions::V1),
            "v1v2" => Some(Versions::V1AndV2),
            "v2v1" => Some(Versions::V2AndV1),
            "v2" => Some(Versions::V2),
            _ => None,
        }
    }

    /// `v1`, `v1v2`, `v2v1` or `v2`.
    pub fn as_str(self) -> &'static str {
        match self {
            Versions::V1 => "v1",
            Versions::V1AndV2 => "v1v2",
            Versions::V2AndV1 => "v2v1",
            Versions::V2 => "v2",
        }
    }
}

/// Adds the deployments of `versions` to a queue worker's registry, in the order [`Versions`] names them:
/// of two deployments sharing the alias, the one served last is the one whose alias the worker activates
/// (after its fence and coverage checks pass; a fenced or refused start moves no alias).
fn serve<Q: Queue, C>(
    b: WorkerBuilder<OnQueue<Q>, C>,
    versions: Versions,
) -> WorkerBuilder<OnQueue<Q>, C>
where
    CommunityThreadsV1: RoutesTo<Q>,
    CommunityThreadsV2: RoutesTo<Q>,
{
    match versions {
        Versions::V1 => b.serve::<CommunityThreadsV1>(),
        Versions::V1AndV2 => b
            .serve::<CommunityThreadsV1>()
            .serve::<CommunityThreadsV2>(),
        Versions::V2AndV1 => b
            .serve::<CommunityThreadsV2>()
            .serve::<CommunityThreadsV1>(),
        Versions::V2 => b.serve::<CommunityThreadsV2>(),
    }
}

/// Timing for the demonstration: heartbeats every 250 ms and a dead worker declared after 1.5 s (the
/// defaults are 2 s and 10 s), so that a crash is recovered within seconds.
pub fn demo_timing<K>(b: WorkerBuilder<K>) -> WorkerBuilder<K> {
    b.heartbeat_interval(Duration::from_millis(250))
        .dead_worker_timeout(Some(DEAD_WORKER_TIMEOUT))
        .maintenance_interval(Some(Duration::from_millis(250)))
        .poll_interval(Duration::from_millis(10))
        .max_poll_wait(Duration::from_millis(100))
        .shutdown_grace(Duration::from_secs(10))
}

/// The dead-worker timeout of [`demo_timing`].
pub const DEAD_WORKER_TIMEOUT: Duration = Duration::from_millis(1_500);

/// Handlers one `community-classify` process runs at once (the model is the bottleneck).
pub const CLASSIFY_CONCURRENCY: usize = 2;
/// Handlers one `community-deliver` process runs at once.
pub const DELIVER_CONCURRENCY: usize = 4;

/// One process of worker function `community-classify`: polls `classify_threads`.
pub fn classify_worker(
    pool: PgPool,
    versions: Versions,
) -> WorkerBuilder<OnQueue<ClassifyThreads>> {
    let b = serve(QueueWorker::<ClassifyThreads>::builder(pool), versions);
    demo_timing(b)
        .worker_name(CLASSIFY_FUNCTION)
        .max_concurrent(CLASSIFY_CONCURRENCY)
}

/// One process of worker function `community-deliver`: polls `deliver_slack_alerts`.
pub fn deliver_worker(
    pool: PgPool,
    versions: Versions,
) -> WorkerBuilder<OnQueue<DeliverSlackAlerts>> {
    let b = serve(QueueWorker::<DeliverSlackAlerts>::builder(pool), versions);
    demo_timing(b)
        .worker_name(DELIVER_FUNCTION)
        .max_concurrent(DELIVER_CONCURRENCY)
}

/// Rollout step 1: records which of `functions` are enabled (in table `rollout_fence`) and disables them,
/// so supervision cannot restart old code. Returns the recorded set.
///
/// # Errors
/// A database error, or a `rollout_fence` table left by an unfinished rollout.
pub async fn fence(
    pool: &PgPool,
    functions: &[&str],
    reason: &str,
) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query(
        "create table rollout_fence as select function_name from pgflow.worker_functions \
         where enabled and function_name = any ($1)",
    )
    .bind(functions)
    .execute(pool)
    .await?;
    sqlx::query("select pgflow.disable_worker_function(function_name, $1) from rollout_fence")
        .bind(reason)
        .execute(pool)
        .await?;
    sqlx::query_scalar("select function_name from rollout_fence order by 1")
        .fetch_all(pool)
        .await
}

/// Rollout step 2: deprecates the live workers of the fenced functions and waits until none is alive. A
/// worker counts as alive while it is not stopped and its heartbeat is younger than `liveness`: the workers'
/// dead-worker timeout (10 s by default, as in `pgflow-sql/OPERATIONS.md`; [`DEAD_WORKER_TIMEOUT`] here).
/// Returns how long the drain took.
///
/// # Errors
/// A database error, or workers still alive after `limit`.
pub async fn deprecate_and_wait(
    pool: &PgPool,
    liveness: Duration,
    limit: Duration,
) -> Result<Duration, Box<dyn std::error::Error + Send + Sync>> {
    let started = Instant::now();
    sqlx::query(
        "update pgflow.workers set deprecated_at = now() \
         where function_name in (select function_name from rollout_fence) and stopped_at is null",
    )
    .execute(pool)
    .await?;
    loop {
        let alive: i64 = sqlx::query_scalar(
            "select count(*) from pgflow.workers \
             where function_name in (select function_name from rollout_fence) and stopped_at is null \
               and last_heartbeat_at > now() - make_interval(secs => $1)",
        )
        .bind(liveness.as_secs_f64())
        .fetch_one(pool)
        .await?;
        if alive == 0 {
            return Ok(started.elapsed());
        }
        if started.elapsed() > limit {
            return Err(format!("{alive} deprecated worker(s) still alive after {limit:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Rollout step 4: re-enables exactly the functions recorded in step 1 and drops the record.
///
/// # Errors
/// A database error.
pub async fn lift_fence(pool: &PgPool) -> Result<(), sqlx::Error> {
    sqlx::query("select pgflow.enable_worker_function(function_name) from rollout_fence")
        .execute(pool)
        .await?;
    sqlx::query("drop table rollout_fence")
        .execute(pool)
        .await?;
    Ok(())
}

/// `pgflow.version_retirable(flow_slug, queue)`: whether V1 (say) can leave the registries of `queue`'s
/// workers, with the blockers when not.
///
/// # Errors
/// A database error.
pub async fn version_retirable(
    pool: &PgPool,
    flow_slug: &str,
    queue: &str,
) -> Result<serde_json::Value, sqlx::Error> {
    sqlx::query_scalar("select pgflow.version_retirable(flow_slug => $1, queue_name => $2)")
        .bind(flow_slug)
        .bind(queue)
        .fetch_one(pool)
        .await
}

/// `pgflow.activate_alias(alias, flow_slug)`: points the alias at a compiled version, the operator's rollback
/// (or roll forward). Returns `{alias, flow_slug, previous_flow_slug, activated_at, activated}`.
///
/// Runs started by the alias afterwards are runs of `flow_slug`, so a build serving `flow_slug` must be
/// running (or come up) on every queue it routes to; the workers' next startups move the alias again to the
/// version their registries serve last, so a lasting move also deploys registries that serve `flow_slug`
/// last ([`Versions::V2AndV1`] for a rollback to V1).
///
/// # Errors
/// A database error; `PF019` when `flow_slug` is not compiled.
pub async fn activate_alias(
    pool: &PgPool,
    alias: &str,
    flow_slug: &str,
) -> Result<serde_json::Value, sqlx::Error> {
    sqlx::query_scalar("select pgflow.activate_alias(alias => $1, flow_slug => $2)")
        .bind(alias)
        .bind(flow_slug)
        .fetch_one(pool)
        .await
}
