//! Starting runs with any executor: a pool, a connection, or the caller's transaction.

use serde_json::Value;
use sqlx::Postgres;
use uuid::Uuid;

use super::ClientError;
use crate::deployments::Deployment;
use crate::flows::Flow;
use crate::statements;

/// Starts a typed run with any executor: a pool, a connection, or the caller's transaction
/// (`&mut *tx`), so a run can start atomically with the caller's own writes.
///
/// ```no_run
/// # use pgflow_runtime::{flow, StepError};
/// # #[flow(slug = "greet", input = String)]
/// # mod greet { use pgflow_runtime::StepError;
/// #   #[step] async fn hello(name: String) -> Result<String, StepError> { Ok(name) } }
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let mut tx = pool.begin().await?;
/// sqlx::query("insert into signups (name) values ($1)").bind("Ada").execute(&mut *tx).await?;
/// let run_id = pgflow_runtime::client::start::<greet::Greet, _>(&mut *tx, &"Ada".to_owned()).await?;
/// tx.commit().await?;
/// # let _ = run_id; Ok(()) }
/// ```
///
/// # Errors
///
/// [`ClientError::Input`] when the input does not serialize, [`ClientError::Database`] when
/// `pgflow.start_flow` fails (unknown flow, a root map given a non-array).
pub async fn start<'e, F, E>(executor: E, input: &F::Input) -> Result<Uuid, ClientError>
where
    F: Flow,
    E: sqlx::Executor<'e, Database = Postgres>,
{
    let input = serde_json::to_value(input).map_err(|source| ClientError::Input {
        flow_slug: F::SLUG.to_owned(),
        source,
    })?;
    start_by_slug(executor, F::SLUG, &input, None).await
}

/// Starts one typed run per input in one statement (`pgflow.start_flows`), with any executor; returns the
/// run ids in input order. Either every run starts or none does. Starting many runs this way costs the
/// database far less than one [`start`] each: most of a start is fixed cost per call.
///
/// ```no_run
/// # use pgflow_runtime::{flow, StepError};
/// # #[flow(slug = "greet", input = String)]
/// # mod greet { use pgflow_runtime::StepError;
/// #   #[step] async fn hello(name: String) -> Result<String, StepError> { Ok(name) } }
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let names = ["Ada".to_owned(), "Grace".to_owned()];
/// let run_ids = pgflow_runtime::client::start_many::<greet::Greet, _>(&pool, &names).await?;
/// assert_eq!(run_ids.len(), 2);
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// [`ClientError::Input`] when an input does not serialize, [`ClientError::Database`] when
/// `pgflow.start_flows` fails (unknown flow, a root map given a non-array: the message names its position).
pub async fn start_many<'e, F, E>(
    executor: E,
    inputs: &[F::Input],
) -> Result<Vec<Uuid>, ClientError>
where
    F: Flow,
    E: sqlx::Executor<'e, Database = Postgres>,
{
    let inputs = inputs
        .iter()
        .map(serde_json::to_value)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| ClientError::Input {
            flow_slug: F::SLUG.to_owned(),
            source,
        })?;
    start_many_by_slug(executor, F::SLUG, &inputs).await
}

/// Starts one run per JSON input of a flow slug or an alias, in one statement; returns the run ids in input
/// order. Either every run starts or none does.
///
/// # Errors
///
/// [`ClientError::Database`] when `pgflow.start_flows` fails.
pub async fn start_many_by_slug<'e, E>(
    executor: E,
    flow_slug: &str,
    inputs: &[Value],
) -> Result<Vec<Uuid>, ClientError>
where
    E: sqlx::Executor<'e, Database = Postgres>,
{
    start_many_with(executor, flow_slug, inputs, true).await
}

/// [`start_many_by_slug`], with a named (cached) statement or an unnamed one (behind a transaction pooler).
pub(crate) async fn start_many_with<'e, E>(
    executor: E,
    flow_slug: &str,
    inputs: &[Value],
    persistent: bool,
) -> Result<Vec<Uuid>, ClientError>
where
    E: sqlx::Executor<'e, Database = Postgres>,
{
    #[cfg(feature = "otel")]
    let query = sqlx::query_scalar(statements::START_FLOWS_TRACED)
        .bind(flow_slug)
        .bind(inputs)
        .bind(crate::observability::otel::start_setting(flow_slug));
    #[cfg(not(feature = "otel"))]
    let query = sqlx::query_scalar(statements::START_FLOWS)
        .bind(flow_slug)
        .bind(inputs);
    Ok(query.persistent(persistent).fetch_all(executor).await?)
}

/// What a keyed start gives per input besides the input: an idempotency key (`None`: no key) and a priority,
/// and for all of them the keys' lifetime (`None`: the database's default).
pub(crate) struct Keyed<'a> {
    pub(crate) keys: &'a [Option<String>],
    pub(crate) priorities: &'a [i32],
    pub(crate) window_seconds: Option<f64>,
}

/// Starts one run per input with an idempotency key and a priority each, as `pgflow.start_flows_with_keys`:
/// a key already used for the same input returns its run.
pub(crate) async fn start_keyed_with<'e, E>(
    executor: E,
    flow_slug: &str,
    inputs: &[Value],
    keyed: Keyed<'_>,
    persistent: bool,
) -> Result<Vec<Uuid>, ClientError>
where
    E: sqlx::Executor<'e, Database = Postgres>,
{
    #[cfg(feature = "otel")]
    let query = sqlx::query_scalar(statements::START_FLOWS_WITH_KEYS_TRACED)
        .bind(flow_slug)
        .bind(inputs)
        .bind(keyed.keys)
        .bind(keyed.window_seconds)
        .bind(keyed.priorities)
        .bind(crate::observability::otel::start_setting(flow_slug));
    #[cfg(not(feature = "otel"))]
    let query = sqlx::query_scalar(statements::START_FLOWS_WITH_KEYS)
        .bind(flow_slug)
        .bind(inputs)
        .bind(keyed.keys)
        .bind(keyed.window_seconds)
        .bind(keyed.priorities);
    Ok(query.persistent(persistent).fetch_all(executor).await?)
}

/// A typed input as JSON, or [`ClientError::Input`] naming the flow.
pub(crate) fn to_input<T: serde::Serialize>(name: &str, input: &T) -> Result<Value, ClientError> {
    serde_json::to_value(input).map_err(|source| ClientError::Input {
        flow_slug: name.to_owned(),
        source,
    })
}

/// Starts a run of deployment `D` by its alias, with a typed input, with any executor (a pool, a connection,
/// or the caller's transaction). `pgflow.start_flow` resolves the alias to the concrete version it points at
/// now; a deployment without an alias starts its concrete slug.
///
/// ```no_run
/// # use pgflow_runtime::{deployment, flow, queue};
/// # #[flow(slug = "communityThreadsV2", input = String)]
/// # mod community_v2 { use pgflow_runtime::StepError;
/// #   #[step] async fn classify(text: String) -> Result<String, StepError> { Ok(text) } }
/// # #[queue("classify_threads")]
/// # pub struct ClassifyThreads;
/// # #[deployment(alias = "communityThreads", name = CommunityV2Deployment)]
/// # pub fn community_v2(step: community_v2::Step) {
/// #     match step { community_v2::Step::Classify => ClassifyThreads }
/// # }
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let mut tx = pool.begin().await?;
/// let started = pgflow_runtime::client::start_deployed::<CommunityV2Deployment, _>(&mut *tx, &"help?".to_owned()).await?;
/// tx.commit().await?;
/// println!("run {} of {}", started.run_id, started.flow_slug);
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// [`ClientError::Input`] when the input does not serialize, [`ClientError::Database`] when
/// `pgflow.start_flow` fails (an alias no worker has activated yet and no concrete slug of that name, a root
/// map given a non-array).
pub async fn start_deployed<'e, D, E>(
    executor: E,
    input: &<D::Flow as Flow>::Input,
) -> Result<StartedRun, ClientError>
where
    D: Deployment,
    E: sqlx::Executor<'e, Database = Postgres>,
{
    let name = D::ALIAS.unwrap_or(<D::Flow as Flow>::SLUG);
    let input = serde_json::to_value(input).map_err(|source| ClientError::Input {
        flow_slug: name.to_owned(),
        source,
    })?;
    start_named(executor, name, &input, None).await
}

/// Starts a run by flow slug with a JSON input, optionally with a chosen run id.
///
/// # Errors
///
/// [`ClientError::Database`] when `pgflow.start_flow` fails.
pub async fn start_by_slug<'e, E>(
    executor: E,
    flow_slug: &str,
    input: &Value,
    run_id: Option<Uuid>,
) -> Result<Uuid, ClientError>
where
    E: sqlx::Executor<'e, Database = Postgres>,
{
    Ok(start_named(executor, flow_slug, input, run_id)
        .await?
        .run_id)
}

/// `pgflow.start_flow` of a concrete slug or an alias.
async fn start_named<'e, E>(
    executor: E,
    name: &str,
    input: &Value,
    run_id: Option<Uuid>,
) -> Result<StartedRun, ClientError>
where
    E: sqlx::Executor<'e, Database = Postgres>,
{
    start_named_with(executor, name, input, run_id, true).await
}

/// [`start_named`], with a named (cached) statement or an unnamed one (behind a transaction pooler).
pub(crate) async fn start_named_with<'e, E>(
    executor: E,
    name: &str,
    input: &Value,
    run_id: Option<Uuid>,
    persistent: bool,
) -> Result<StartedRun, ClientError>
where
    E: sqlx::Executor<'e, Database = Postgres>,
{
    #[cfg(feature = "otel")]
    let query = sqlx::query_as(statements::START_FLOW_TRACED)
        .bind(name)
        .bind(input)
        .bind(run_id)
        .bind(crate::observability::otel::start_setting(name));
    #[cfg(not(feature = "otel"))]
    let query = sqlx::query_as(statements::START_FLOW)
        .bind(name)
        .bind(input)
        .bind(run_id);
    let (run_id, flow_slug) = query.persistent(persistent).fetch_one(executor).await?;
    Ok(StartedRun { run_id, flow_slug })
}

/// A run just started: its id and the concrete flow slug it runs (what an alias resolved to).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StartedRun {
    /// The run id (`pgflow.runs.run_id`).
    pub run_id: Uuid,
    /// The concrete flow slug (`pgflow.runs.flow_slug`).
    pub flow_slug: String,
}
