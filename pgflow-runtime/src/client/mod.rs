//! Starting runs, reading their state and waiting for their outcome.

use std::any::type_name;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use sqlx::PgPool;
use tokio::sync::OnceCell;
use uuid::Uuid;

use crate::deployments::Deployment;
use crate::flows::Flow;
use crate::pooling::{run, Pooling};
use crate::statements;
use crate::watch::Hub;

mod control;
mod handle;
mod start;
mod state;

pub use control::{CancelFilter, CancelOutcome, Start};
pub use handle::RunHandle;
pub use start::{start, start_by_slug, start_deployed, start_many, start_many_by_slug, StartedRun};
pub use state::{RunRow, RunState, RunStatus, StepState, StepStatus};

/// An error starting a run or reading one.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The input does not serialize to JSON.
    #[error("cannot serialize the input of flow `{flow_slug}` as JSON: {source}")]
    Input {
        /// The flow slug.
        flow_slug: String,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// The database refused (for example an unknown flow slug, or a root map given a non-array).
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// `get_run_with_states` returned something this build cannot read.
    #[error("cannot read the state of run {run_id}: {source}")]
    State {
        /// The run.
        run_id: Uuid,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
}

/// Why waiting for a run did not give its output.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WaitError {
    /// The run failed.
    #[error("run {run_id} failed{}{}", failed_step.as_ref().map(|s| format!(" in step `{s}`")).unwrap_or_default(), error_message.as_ref().map(|m| format!(": {m}")).unwrap_or_default())]
    Failed {
        /// The run.
        run_id: Uuid,
        /// The step whose failure failed the run, when known.
        failed_step: Option<String>,
        /// That step's (or task's) error message.
        error_message: Option<String>,
    },
    /// The run was cancelled (`pgflow.cancel_run`): it will not produce an output.
    #[error("run {run_id} was cancelled{}", reason.as_ref().map(|r| format!(": {r}")).unwrap_or_default())]
    Cancelled {
        /// The run.
        run_id: Uuid,
        /// The reason given to the cancel.
        reason: Option<String>,
    },
    /// The run did not finish in time; it keeps running.
    #[error("run {run_id} did not finish within {waited:?}")]
    TimedOut {
        /// The run.
        run_id: Uuid,
        /// How long the caller waited.
        waited: Duration,
    },
    /// No such run.
    #[error("run {run_id} does not exist")]
    NotFound {
        /// The run.
        run_id: Uuid,
    },
    /// The run completed, but its output is not the flow's output type.
    #[error(
        "run {run_id} completed, but its output does not deserialize as `{expected}`: {source}"
    )]
    Output {
        /// The run.
        run_id: Uuid,
        /// The expected Rust type.
        expected: &'static str,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// The handle is typed by one version, but its run is of another (an alias resolved to the version it
    /// points at now): take the handle of the run's version with [`RunHandle::as_version`].
    #[error("run {run_id} is a run of `{flow_slug}`, not of `{expected_flow_slug}` (the alias resolved to `{flow_slug}`); wait through the handle `as_version::<F>()` returns for the flow type of `{flow_slug}`")]
    OtherVersion {
        /// The run.
        run_id: Uuid,
        /// The flow the handle is typed by.
        expected_flow_slug: &'static str,
        /// The run's concrete flow.
        flow_slug: String,
    },
    /// A database error.
    #[error("database error while waiting: {0}")]
    Database(#[from] sqlx::Error),
}

/// Starts runs and watches them. Cheap to clone; the pool stays the caller's.
///
/// ```no_run
/// # use pgflow_runtime::{flow, StepError};
/// # #[flow(slug = "greet", input = String)]
/// # mod greet { use pgflow_runtime::StepError;
/// #   #[step] async fn hello(name: String) -> Result<String, StepError> { Ok(name) } }
/// use pgflow_runtime::Client;
/// use std::time::Duration;
///
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let client = Client::new(pool);
/// let run = client.start::<greet::Greet>(&"Ada".to_owned()).await?;
/// let output = run.wait(Duration::from_secs(30)).await?;
/// assert_eq!(output.hello, "Ada");
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Client {
    pool: PgPool,
    pooling: Pooling,
    poll_fallback: Duration,
    key_window: Option<Duration>,
    hub: Arc<OnceCell<Option<Hub>>>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("poll_fallback", &self.poll_fallback)
            .finish_non_exhaustive()
    }
}

impl Client {
    /// A client on `pool`.
    pub fn new(pool: PgPool) -> Self {
        Client {
            pool,
            pooling: Pooling::Direct,
            poll_fallback: Duration::from_millis(500),
            key_window: None,
            hub: Arc::new(OnceCell::new()),
        }
    }

    /// How often [`Client::wait`] re-reads the run when no notification arrives (default 500 ms).
    #[must_use]
    pub fn with_poll_fallback(mut self, every: Duration) -> Self {
        self.poll_fallback = every.max(Duration::from_millis(1));
        self
    }

    /// How the pool reaches PostgreSQL (default [`Pooling::Direct`]). Behind PgBouncer in transaction
    /// mode, give [`Pooling::transaction()`] (waits poll every poll-fallback period) or
    /// [`Pooling::transaction_with_listen`] (waits listen on that direct connection).
    #[must_use]
    pub fn with_pooling(mut self, pooling: Pooling) -> Self {
        self.pooling = pooling;
        self
    }

    /// How long the idempotency keys of this client's starts live (default: the database setting
    /// `pgflow.idempotency_key_ttl`, else 24 hours). Retention (`prune_history`) removes expired keys.
    #[must_use]
    pub fn with_idempotency_window(mut self, window: Duration) -> Self {
        self.key_window = Some(window.max(Duration::from_secs(1)));
        self
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Starts a typed run: `&input`, or a [`Start`] with an idempotency key.
    ///
    /// ```no_run
    /// # use pgflow_runtime::{flow, StepError};
    /// # #[flow(slug = "greet", input = String)]
    /// # mod greet { use pgflow_runtime::StepError;
    /// #   #[step] async fn hello(name: String) -> Result<String, StepError> { Ok(name) } }
    /// use pgflow_runtime::client::{Client, Start};
    ///
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// let client = Client::new(pool);
    /// let name = "Ada".to_owned();
    /// let first = client.start::<greet::Greet>(Start::new(&name).idempotency_key("signup-42")).await?;
    /// let again = client.start::<greet::Greet>(Start::new(&name).idempotency_key("signup-42")).await?;
    /// assert_eq!(first.run_id(), again.run_id());
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// See [`start()`]; with a key, SQLSTATE `PF035` when the key was used for another input.
    pub async fn start<'a, F: Flow>(
        &self,
        input: impl Into<Start<'a, F::Input>>,
    ) -> Result<RunHandle<F>, ClientError>
    where
        F::Input: 'a,
    {
        let one = input.into();
        if one.idempotency_key.is_none() && one.priority == 0 {
            let input = start::to_input(F::SLUG, one.input)?;
            let started = self.start_named(F::SLUG, &input).await?;
            return Ok(self.handle(started.run_id));
        }
        let mut handles = self.start_many::<F>([one]).await?;
        Ok(handles.remove(0))
    }

    /// Starts one typed run per input (`&input`, or a [`Start`] with its own idempotency key) in one statement;
    /// the handles come back in input order. Either every run starts (or is found by its key) or none does.
    ///
    /// # Errors
    ///
    /// See [`start_many()`]; with keys, SQLSTATE `PF035` when a key was used for another input.
    pub async fn start_many<'a, F: Flow>(
        &self,
        inputs: impl IntoIterator<Item = impl Into<Start<'a, F::Input>>>,
    ) -> Result<Vec<RunHandle<F>>, ClientError>
    where
        F::Input: 'a,
    {
        let starts: Vec<Start<'a, F::Input>> = inputs.into_iter().map(Into::into).collect();
        let values = starts
            .iter()
            .map(|s| start::to_input(F::SLUG, s.input))
            .collect::<Result<Vec<_>, _>>()?;
        let keys: Option<Vec<Option<String>>> = starts
            .iter()
            .any(|s| s.idempotency_key.is_some() || s.priority != 0)
            .then(|| starts.iter().map(|s| s.idempotency_key.clone()).collect());
        let priorities: Vec<i32> = starts.iter().map(|s| s.priority).collect();
        let window = self.key_window.map(|w| w.as_secs_f64());
        let run_ids = if self.pooling.is_transaction() {
            let mut tx = self.pool.begin().await?;
            let ids = match &keys {
                None => start::start_many_with(&mut *tx, F::SLUG, &values, false).await?,
                Some(keys) => {
                    let keyed = start::Keyed {
                        keys,
                        priorities: &priorities,
                        window_seconds: window,
                    };
                    start::start_keyed_with(&mut *tx, F::SLUG, &values, keyed, false).await?
                }
            };
            tx.commit().await?;
            ids
        } else {
            match &keys {
                None => start::start_many_with(&self.pool, F::SLUG, &values, true).await?,
                Some(keys) => {
                    let keyed = start::Keyed {
                        keys,
                        priorities: &priorities,
                        window_seconds: window,
                    };
                    start::start_keyed_with(&self.pool, F::SLUG, &values, keyed, true).await?
                }
            }
        };
        Ok(run_ids.into_iter().map(|id| self.handle(id)).collect())
    }

    /// Cancels a run (`pgflow.cancel_run`): in one transaction the run becomes `cancelled` with `reason`, its
    /// queued tasks are cancelled with their messages, steps not started never start, and later results of its
    /// running tasks are stale. Its running handlers see `ctx.cancellation()` fire within about a second, and
    /// their workers drop their results. Idempotent: a finished run is left as it is ([`CancelOutcome::changed`]
    /// is `false`).
    ///
    /// # Errors
    ///
    /// A database error; SQLSTATE `PF031` for an unknown run.
    pub async fn cancel(
        &self,
        run_id: Uuid,
        reason: Option<&str>,
    ) -> Result<CancelOutcome, ClientError> {
        type Row = (
            RunStatus,
            bool,
            Option<String>,
            Option<chrono::DateTime<chrono::Utc>>,
        );
        let query = sqlx::query_as(statements::CANCEL_RUN)
            .bind(run_id)
            .bind(reason);
        let (status, changed, reason, cancelled_at): Row =
            run!(self.pooling.is_transaction(), &self.pool, query, fetch_one).await?;
        Ok(CancelOutcome {
            status,
            changed,
            reason,
            cancelled_at,
        })
    }

    /// Retries a failed or cancelled run in place (`pgflow.retry_run`): its failed or cancelled steps and the
    /// steps downstream of them run again with fresh attempts; completed tasks keep their outputs and never run
    /// again. The history of tries is in `pgflow.run_retries`. Returns the run's status afterwards (`Started`,
    /// or `Completed` when nothing was left to run).
    ///
    /// # Errors
    ///
    /// A database error: SQLSTATE `PF031` (unknown run), `PF032` (the run is still started, or completed),
    /// `PF033` (its flow version is gone).
    pub async fn retry(&self, run_id: Uuid) -> Result<RunStatus, ClientError> {
        let query = sqlx::query_scalar(statements::RETRY_RUN).bind(run_id);
        Ok(run!(self.pooling.is_transaction(), &self.pool, query, fetch_one).await?)
    }

    /// Replays a run from `from_step` (`pgflow.replay_run`): a new run linked to it (`replay_of`) that copies
    /// the outputs of the steps not downstream of `from_step` and runs that step and its descendants. Works on
    /// completed runs too. Returns the new run's id.
    ///
    /// # Errors
    ///
    /// A database error: SQLSTATE `PF031` (unknown run), `PF034` (a step the run's flow does not have), `PF036`
    /// (a dependency of the step did not complete), `PF033` (the flow version is gone).
    pub async fn replay(&self, run_id: Uuid, from_step: &str) -> Result<Uuid, ClientError> {
        let query = sqlx::query_scalar(statements::REPLAY_RUN)
            .bind(run_id)
            .bind(from_step);
        Ok(run!(self.pooling.is_transaction(), &self.pool, query, fetch_one).await?)
    }

    /// Starts a run of deployment `D` by its alias (or its concrete slug when it has none), with a typed
    /// input. The handle reports the concrete version the alias resolved to
    /// ([`RunHandle::flow_slug`]); waiting works as for [`Client::start`] when that is `D`'s flow. When the
    /// alias points at another version, [`RunHandle::wait`] refuses ([`WaitError::OtherVersion`]) rather
    /// than decode one version's output as another's: take [`RunHandle::as_version`] of the version it
    /// resolved to.
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
    /// use pgflow_runtime::Client;
    /// use std::time::Duration;
    ///
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// let run = Client::new(pool).start_deployed::<CommunityV2Deployment>(&"help?".to_owned()).await?;
    /// println!("the alias resolved to {}", run.flow_slug());
    /// run.wait(Duration::from_secs(30)).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// See [`start_deployed()`].
    pub async fn start_deployed<D: Deployment>(
        &self,
        input: &<D::Flow as Flow>::Input,
    ) -> Result<RunHandle<D::Flow>, ClientError> {
        let name = D::ALIAS.unwrap_or(<D::Flow as Flow>::SLUG);
        let input = start::to_input(name, input)?;
        let started = self.start_named(name, &input).await?;
        Ok(RunHandle {
            run_id: started.run_id,
            flow_slug: started.flow_slug,
            client: self.clone(),
            _flow: PhantomData,
        })
    }

    /// Starts a run by slug with a JSON input.
    ///
    /// # Errors
    ///
    /// See [`start_by_slug()`].
    pub async fn start_by_slug(&self, flow_slug: &str, input: &Value) -> Result<Uuid, ClientError> {
        Ok(self.start_named(flow_slug, input).await?.run_id)
    }

    /// `pgflow.start_flow` of a slug or an alias, safely behind a transaction pooler.
    async fn start_named(&self, name: &str, input: &Value) -> Result<StartedRun, ClientError> {
        if self.pooling.is_transaction() {
            let mut tx = self.pool.begin().await?;
            let started = start::start_named_with(&mut *tx, name, input, None, false).await?;
            tx.commit().await?;
            Ok(started)
        } else {
            start::start_named_with(&self.pool, name, input, None, true).await
        }
    }

    /// A typed handle on an existing run of `F`.
    pub fn handle<F: Flow>(&self, run_id: Uuid) -> RunHandle<F> {
        RunHandle {
            run_id,
            flow_slug: F::SLUG.to_owned(),
            client: self.clone(),
            _flow: PhantomData,
        }
    }

    /// The run with its step states (`pgflow.get_run_with_states`), `None` when it does not exist.
    ///
    /// # Errors
    ///
    /// A database error, or [`ClientError::State`] when the JSON cannot be read.
    pub async fn run(&self, run_id: Uuid) -> Result<Option<RunState>, ClientError> {
        let query = sqlx::query_scalar(statements::GET_RUN_WITH_STATES).bind(run_id);
        let raw: Option<Value> =
            run!(self.pooling.is_transaction(), &self.pool, query, fetch_one).await?;
        raw.map(|v| {
            serde_json::from_value(v).map_err(|source| ClientError::State { run_id, source })
        })
        .transpose()
    }

    /// Waits until the run completes or fails, for at most `timeout`.
    ///
    /// Woken by the run's notifications (`LISTEN pgflow_run_<id>`, with the listening session
    /// registered by `pgflow.watch_run`: by default the SQL core sends a run's `run:*` events while
    /// someone watches it), with a re-read every poll-fallback period in case a notification is
    /// missed or listening is impossible (for example behind a transaction pooler). All waits of
    /// one client (and its clones) share one listening connection, taken from the pool on the
    /// first wait and kept while the client lives.
    ///
    /// # Errors
    ///
    /// [`WaitError::Failed`] (with the failed step and its message), [`WaitError::Cancelled`] (with the
    /// reason), [`WaitError::TimedOut`],
    /// [`WaitError::NotFound`], [`WaitError::Output`], or a database error.
    pub async fn wait<F: Flow>(
        &self,
        run_id: Uuid,
        timeout: Duration,
    ) -> Result<F::Output, WaitError> {
        let mut output = self.wait_json(run_id, timeout).await?;
        if output.is_null() {
            // A run whose leaves were all skipped completes with a NULL output: no leaf outputs.
            output = Value::Object(serde_json::Map::new());
        }
        serde_json::from_value(output).map_err(|source| WaitError::Output {
            run_id,
            expected: type_name::<F::Output>(),
            source,
        })
    }

    /// [`Client::wait`] returning the raw JSON output.
    ///
    /// # Errors
    ///
    /// As [`Client::wait`], without [`WaitError::Output`].
    pub async fn wait_json(&self, run_id: Uuid, timeout: Duration) -> Result<Value, WaitError> {
        let started = Instant::now();
        let deadline = started + timeout;
        let hub = self
            .hub
            .get_or_init(|| async {
                // Behind a transaction pooler, listen on the direct connection given, or not at all.
                let pool = match self.pooling.listen_on() {
                    None => return None,
                    Some(None) => self.pool.clone(),
                    Some(Some(direct)) => sqlx::postgres::PgPoolOptions::new()
                        .max_connections(1)
                        .connect_lazy_with(direct.clone()),
                };
                Hub::start(&pool)
                    .await
                    .map_err(|e| tracing::debug!(error = %e, "cannot LISTEN; waits poll"))
                    .ok()
            })
            .await;
        let subscription = match hub {
            Some(hub) => hub.subscribe(run_id).await,
            None => None,
        };
        loop {
            if let Some(output) = self.outcome(run_id).await? {
                return Ok(output);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(WaitError::TimedOut {
                    run_id,
                    waited: started.elapsed(),
                });
            }
            let nap = self.poll_fallback.min(deadline - now);
            match &subscription {
                Some(sub) => {
                    let _ = tokio::time::timeout(nap, sub.notified()).await;
                }
                None => tokio::time::sleep(nap).await,
            }
        }
    }

    /// `Some(output)` when completed, an error when failed or missing, `None` while running.
    async fn outcome(&self, run_id: Uuid) -> Result<Option<Value>, WaitError> {
        type Row = (RunStatus, Option<Value>, Option<String>, Option<String>);
        let query = sqlx::query_as(statements::RUN_OUTCOME).bind(run_id);
        let row: Option<Row> = run!(
            self.pooling.is_transaction(),
            &self.pool,
            query,
            fetch_optional
        )
        .await?;
        match row {
            None => Err(WaitError::NotFound { run_id }),
            Some((RunStatus::Completed, output, _, _)) => Ok(Some(output.unwrap_or(Value::Null))),
            Some((RunStatus::Failed, _, failed_step, error_message)) => Err(WaitError::Failed {
                run_id,
                failed_step,
                error_message,
            }),
            Some((RunStatus::Cancelled, _, _, reason)) => {
                Err(WaitError::Cancelled { run_id, reason })
            }
            Some((RunStatus::Started, ..)) => Ok(None),
        }
    }
}
