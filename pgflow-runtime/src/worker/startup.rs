//! Startup, in this order, before a worker registers or polls: check the registry (one entry per concrete
//! flow, each serving a step of the queue), check the schema, compile or verify every deployment and its
//! routes, derive the (flow, step) pairs of the queue, check the worker function's fence, then activate the
//! aliases and check the queue's coverage in one transaction (rolled back on a gap), and register.
//!
//! Compilation commits before anything else is checked: when a later step fails, the persisted versions stay
//! (they are immutable) and durable tasks stay queued for a worker that can run them. Aliases move only when
//! every check has passed: a fenced or refused start leaves them where they were.

use crate::pooling::run;
use serde_json::Value;
use sqlx::types::Json;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use super::answers::{AliasActivated, Compilation as Compiling, CompileAnswer, FunctionState};
use super::error::{routing_or_database, Context, CoverageGap, GapReason, WorkerError};
use super::registry::{FlowEntry, Registry};
use super::report::{AliasActivation, CompileStatus, DeploymentStatus};
use crate::config::{Compilation, WorkerConfig};
use crate::decode::QueueMode;
use crate::statements;

/// What startup established.
pub(crate) struct Prepared {
    pub(crate) function_name: String,
    /// What startup did with each deployment, in registry order.
    pub(crate) deployments: Vec<DeploymentStatus>,
}

pub(crate) async fn prepare(
    pool: &PgPool,
    registry: &Registry,
    config: &WorkerConfig,
    worker_id: Uuid,
) -> Result<Prepared, WorkerError> {
    check_registry(registry)?;
    let pooled = config.pooling.is_transaction();
    check_schema(pool, config.auto_install).await?;

    let (mut deployments, activations) =
        compile_all(pool, pooled, registry, config.compilation).await?;

    let function_name = config
        .worker_name
        .clone()
        .unwrap_or_else(|| registry.queue.clone());
    check_fence(pool, pooled, &function_name).await?;

    let (flow_slugs, step_slugs) = registry.pairs();
    let mut tx = pool.begin().await.during("activating aliases")?;
    for &(i, alias) in &activations {
        deployments[i].alias = activate(&mut tx, pooled, registry.flows[i].slug, alias).await?;
    }
    check_coverage(&mut tx, pooled, &registry.queue, &flow_slugs, &step_slugs).await?;
    tx.commit().await.during("activating aliases")?;
    for deployment in &deployments {
        if let AliasActivation::Activated {
            alias,
            previous_flow_slug,
        } = &deployment.alias
        {
            tracing::info!(alias = %alias, flow = %deployment.flow_slug, previous = ?previous_flow_slug,
                "alias activated: new runs of the alias start this version");
        }
    }

    register(
        pool,
        pooled,
        registry,
        worker_id,
        &function_name,
        &flow_slugs,
        &step_slugs,
    )
    .await?;
    Ok(Prepared {
        function_name,
        deployments,
    })
}

/// Compiles or verifies every deployment and checks its routes; returns what was done with each, and the
/// aliases to activate once every check has passed (of those sharing an alias, the one served last).
async fn compile_all(
    pool: &PgPool,
    pooled: bool,
    registry: &Registry,
    compilation: Compilation,
) -> Result<(Vec<DeploymentStatus>, Vec<(usize, &'static str)>), WorkerError> {
    let mut deployments = Vec::with_capacity(registry.flows.len());
    let mut activations: Vec<(usize, &'static str)> = Vec::new();
    for (i, flow) in registry.flows.iter().enumerate() {
        let superseded_by = flow.alias.and_then(|alias| {
            registry.flows[i + 1..]
                .iter()
                .rev()
                .find(|later| later.alias == Some(alias))
                .map(|later| later.slug)
        });
        let compile_status = compile(pool, pooled, flow, compilation).await?;
        verify_routes(pool, pooled, flow, &registry.queue).await?;
        let alias = match (flow.alias, superseded_by) {
            // Compilation skipped: the version is someone else's to deploy, and so is its alias.
            (Some(_), _) if compile_status == CompileStatus::Skipped => AliasActivation::None,
            (Some(alias), Some(by)) => AliasActivation::Superseded {
                alias: alias.to_owned(),
                by_flow_slug: by.to_owned(),
            },
            (Some(alias), None) => {
                activations.push((i, alias));
                AliasActivation::None
            }
            (None, _) => AliasActivation::None,
        };
        deployments.push(DeploymentStatus {
            flow_slug: flow.slug.to_owned(),
            steps: flow.served.iter().map(|s| (*s).to_owned()).collect(),
            compile_status,
            alias,
        });
    }

    Ok((deployments, activations))
}

/// Registers the worker for its (flow, step) pairs; a worker fenced meanwhile is marked stopped at once.
async fn register(
    pool: &PgPool,
    pooled: bool,
    registry: &Registry,
    worker_id: Uuid,
    function_name: &str,
    flow_slugs: &[&'static str],
    step_slugs: &[&'static str],
) -> Result<(), WorkerError> {
    let Json(state): Json<FunctionState> = run!(
        pooled,
        pool,
        sqlx::query_scalar(statements::REGISTER_WORKER)
            .bind(worker_id)
            .bind(function_name)
            .bind(&registry.queue)
            .bind(flow_slugs)
            .bind(step_slugs),
        fetch_one
    )
    .await
    .map_err(|e| {
        routing_or_database(
            flow_slugs.first().copied().unwrap_or_default(),
            "registering the worker",
            e,
        )
    })?;
    if !state.enabled {
        // Registered but fenced: record it as stopped at once, so monitoring does not count it.
        run!(
            pooled,
            pool,
            sqlx::query(statements::MARK_WORKER_STOPPED).bind(worker_id),
            execute
        )
        .await
        .during("marking the worker stopped")?;
        return Err(WorkerError::FunctionDisabled {
            function_name: function_name.to_owned(),
            reason: state.disabled_reason,
        });
    }
    Ok(())
}

/// The registry's own rules, before any database call: at least one deployment, each concrete flow once,
/// each serving at least one step of the queue.
fn check_registry(registry: &Registry) -> Result<(), WorkerError> {
    if registry.flows.is_empty() {
        return Err(WorkerError::EmptyRegistry {
            queue: registry.queue.clone(),
        });
    }
    for (i, flow) in registry.flows.iter().enumerate() {
        if registry.flows[..i].iter().any(|f| f.slug == flow.slug) {
            return Err(WorkerError::DuplicateFlow {
                queue: registry.queue.clone(),
                flow_slug: flow.slug.to_owned(),
            });
        }
        if flow.served.is_empty() {
            return Err(WorkerError::NotRoutedHere {
                queue: registry.queue.clone(),
                flow_slug: flow.slug.to_owned(),
            });
        }
    }
    Ok(())
}

/// A fenced worker function stops here, before it activates anything (`register_worker` checks again: the
/// fence may land in between).
async fn check_fence(pool: &PgPool, pooled: bool, function_name: &str) -> Result<(), WorkerError> {
    let Json(state): Json<FunctionState> = run!(
        pooled,
        pool,
        sqlx::query_scalar(statements::TRACK_WORKER_FUNCTION).bind(function_name),
        fetch_one
    )
    .await
    .during("checking the worker function's fence")?;
    if !state.enabled {
        return Err(WorkerError::FunctionDisabled {
            function_name: function_name.to_owned(),
            reason: state.disabled_reason,
        });
    }
    Ok(())
}

/// Points `alias` at `flow_slug` (`pgflow.activate_alias`), inside the caller's transaction.
async fn activate(
    conn: &mut PgConnection,
    pooled: bool,
    flow_slug: &'static str,
    alias: &'static str,
) -> Result<AliasActivation, WorkerError> {
    let Json(result): Json<AliasActivated> = sqlx::query_scalar(statements::ACTIVATE_ALIAS)
        .bind(alias)
        .bind(flow_slug)
        .persistent(!pooled)
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| routing_or_database(flow_slug, "activating the alias", e))?;
    Ok(if result.activated {
        AliasActivation::Activated {
            alias: alias.to_owned(),
            previous_flow_slug: result.previous_flow_slug,
        }
    } else {
        AliasActivation::AlreadyActive {
            alias: alias.to_owned(),
        }
    })
}

/// Every pair the queue can carry must be one this worker runs (`pgflow.queue_coverage_gaps`); checked in the
/// transaction that activates the aliases, so it sees them pointing at the versions this worker activates.
async fn check_coverage(
    conn: &mut PgConnection,
    pooled: bool,
    queue: &str,
    flow_slugs: &[&'static str],
    step_slugs: &[&'static str],
) -> Result<(), WorkerError> {
    type Row = (String, String, GapReason, i64, Json<Vec<Value>>, String);
    let rows: Vec<Row> = sqlx::query_as(statements::QUEUE_COVERAGE_GAPS)
        .bind(queue)
        .bind(flow_slugs)
        .bind(step_slugs)
        .persistent(!pooled)
        .fetch_all(&mut *conn)
        .await
        .during("checking the queue's coverage")?;
    if rows.is_empty() {
        return Ok(());
    }
    let gaps = rows
        .into_iter()
        .map(
            |(flow_slug, step_slug, reason, count, Json(examples), repair)| CoverageGap {
                flow_slug,
                step_slug,
                reason,
                count,
                // Alias names and run ids are strings; a task is `{"run_id", "msg_id"}`.
                examples: examples
                    .into_iter()
                    .map(|e| match e {
                        Value::String(s) => s,
                        other => other.to_string(),
                    })
                    .collect(),
                repair,
            },
        )
        .collect();
    Err(WorkerError::CoverageGap {
        queue: queue.to_owned(),
        gaps,
    })
}

/// The persisted routes of the flow must send the served steps to this worker's queue.
async fn verify_routes(
    pool: &PgPool,
    pooled: bool,
    flow: &FlowEntry,
    queue: &str,
) -> Result<(), WorkerError> {
    let rows: Vec<(String, String)> = run!(
        pooled,
        pool,
        sqlx::query_as(statements::FLOW_ROUTES).bind(flow.slug),
        fetch_all
    )
    .await
    .during("reading the flow's routes")?;
    if rows.is_empty() {
        return Err(WorkerError::FlowMissing {
            flow_slug: flow.slug.to_owned(),
        });
    }
    for (step, _) in &flow.routes {
        if !rows.iter().any(|(slug, _)| slug == step) {
            return Err(WorkerError::StepMissing {
                flow_slug: flow.slug.to_owned(),
                step_slug: (*step).to_owned(),
            });
        }
    }
    if flow.mode == QueueMode::Flow {
        let mut queues: Vec<String> = rows.into_iter().map(|(_, q)| q).collect();
        queues.sort();
        queues.dedup();
        if queues != [queue] {
            return Err(WorkerError::SeveralQueues {
                flow_slug: flow.slug.to_owned(),
                queues,
            });
        }
        return Ok(());
    }
    for step in &flow.served {
        let persisted = rows
            .iter()
            .find(|(slug, _)| slug == step)
            .map(|(_, q)| q.clone())
            .unwrap_or_default();
        if persisted != queue {
            return Err(WorkerError::QueueMismatch {
                flow_slug: flow.slug.to_owned(),
                step_slug: (*step).to_owned(),
                expected_queue: queue.to_owned(),
                persisted_queue: persisted,
            });
        }
    }
    Ok(())
}

async fn check_schema(pool: &PgPool, auto_install: bool) -> Result<(), WorkerError> {
    let required = pgflow_sql::latest_version();
    // In a transaction of its own, so that it works behind a transaction pooler too.
    let mut tx = pool.begin().await.during("checking the pgflow schema")?;
    let installed = pgflow_sql::applied_versions(&mut tx)
        .await?
        .pop()
        .unwrap_or_default();
    tx.commit().await.during("checking the pgflow schema")?;
    if installed.as_str() >= required {
        if installed.as_str() > required {
            tracing::warn!(
                installed = %installed,
                known = required,
                "the pgflow schema is newer than this build"
            );
        }
        return Ok(());
    }
    if auto_install {
        let report = pgflow_sql::install(pool).await?;
        tracing::info!(applied = ?report.applied, "installed the pgflow schema");
        return Ok(());
    }
    if installed.is_empty() {
        Err(WorkerError::SchemaMissing {
            required: required.to_owned(),
        })
    } else {
        Err(WorkerError::SchemaOutdated {
            installed,
            required: required.to_owned(),
        })
    }
}

/// Compiles or verifies one deployment (no alias: aliases move once every startup check has passed).
async fn compile(
    pool: &PgPool,
    pooled: bool,
    flow: &FlowEntry,
    compilation: Compilation,
) -> Result<CompileStatus, WorkerError> {
    let allow_data_loss = match compilation {
        Compilation::Skip => return Ok(CompileStatus::Skipped),
        Compilation::Verify => false,
        Compilation::AllowDataLoss => true,
    };
    let (queue_mode, routes) = flow.compile_arguments();
    let Json(result): Json<Compiling> = run!(
        pooled,
        pool,
        sqlx::query_scalar(statements::ENSURE_FLOW_COMPILED)
            .bind(flow.slug)
            .bind(&flow.shape)
            .bind(allow_data_loss)
            .bind(queue_mode)
            .bind(routes)
            .bind(None::<&str>),
        fetch_one
    )
    .await
    .map_err(|e| routing_or_database(flow.slug, "compiling the flow", e))?;
    let status = match result.status {
        CompileAnswer::Compiled => CompileStatus::Compiled,
        CompileAnswer::Verified => CompileStatus::Verified,
        CompileAnswer::Recompiled => {
            tracing::warn!(
                flow = flow.slug,
                differences = ?result.differences,
                "flow recompiled: its previous definition and every run of it were deleted"
            );
            CompileStatus::Recompiled
        }
        CompileAnswer::Mismatch => {
            return Err(WorkerError::ShapeMismatch {
                flow_slug: flow.slug.to_owned(),
                differences: result.differences,
            })
        }
    };
    Ok(status)
}

/// Startup visibility of missing step workers: routes with queued work and no live worker.
pub(crate) async fn log_uncovered_routes(pool: &PgPool, pooled: bool, flow_slug: &str) {
    let rows: Result<Vec<(String, String, i64)>, sqlx::Error> = run!(
        pooled,
        pool,
        sqlx::query_as(statements::UNCOVERED_ROUTES).bind(flow_slug),
        fetch_all
    )
    .await;
    match rows {
        Ok(rows) => {
            for (step, queue, queued) in rows {
                tracing::warn!(flow = flow_slug, step = %step, queue = %queue, queued,
                    "step has queued work and no live worker; its tasks wait until one starts");
            }
        }
        Err(e) => tracing::debug!(error = %e, "cannot read pgflow.queue_coverage"),
    }
}
