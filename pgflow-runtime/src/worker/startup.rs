//! Startup: schema check, compilation, route verification, worker-function fence, registration.

use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use super::error::{routing_or_database, Context, WorkerError};
use super::subscription::{FlowEntry, Subscription};
use super::CompileStatus;
use crate::config::{Compilation, WorkerConfig};
use crate::statements;

/// What startup established.
pub(crate) struct Prepared {
    pub(crate) function_name: String,
    /// Each flow's compilation result, in the subscription's order.
    pub(crate) compiled: Vec<(&'static str, CompileStatus)>,
}

pub(crate) async fn prepare(
    pool: &PgPool,
    subscription: &Subscription,
    config: &WorkerConfig,
    worker_id: Uuid,
) -> Result<Prepared, WorkerError> {
    check_schema(pool, config.auto_install).await?;
    let mut compiled = Vec::with_capacity(subscription.flows.len());
    for flow in &subscription.flows {
        compiled.push((flow.slug, compile(pool, flow, config.compilation).await?));
        verify_routes(pool, flow, &subscription.queue).await?;
    }

    let function_name = config
        .worker_name
        .clone()
        .unwrap_or_else(|| subscription.queue.clone());
    let (flow_slugs, step_slugs) = subscription.pairs();
    let state: Value = sqlx::query_scalar(statements::REGISTER_WORKER)
        .bind(worker_id)
        .bind(&function_name)
        .bind(&subscription.queue)
        .bind(&flow_slugs)
        .bind(&step_slugs)
        .fetch_one(pool)
        .await
        .map_err(|e| {
            routing_or_database(
                flow_slugs.first().copied().unwrap_or_default(),
                "registering the worker",
                e,
            )
        })?;
    if state["enabled"] == Value::Bool(false) {
        // Registered but fenced: record it as stopped at once, so monitoring does not count it.
        sqlx::query(statements::MARK_WORKER_STOPPED)
            .bind(worker_id)
            .execute(pool)
            .await
            .during("marking the worker stopped")?;
        return Err(WorkerError::FunctionDisabled {
            function_name,
            reason: state["disabled_reason"].as_str().map(str::to_owned),
        });
    }
    Ok(Prepared {
        function_name,
        compiled,
    })
}

/// The persisted routes of the flow must send the served steps to this worker's queue.
async fn verify_routes(pool: &PgPool, flow: &FlowEntry, queue: &str) -> Result<(), WorkerError> {
    let rows: Vec<(String, String)> = sqlx::query_as(statements::FLOW_ROUTES)
        .bind(flow.slug)
        .fetch_all(pool)
        .await
        .during("reading the flow's routes")?;
    if rows.is_empty() {
        return Err(WorkerError::FlowMissing {
            flow_slug: flow.slug.to_owned(),
        });
    }
    for step in &flow.steps {
        if !rows.iter().any(|(slug, _)| slug == step) {
            return Err(WorkerError::StepMissing {
                flow_slug: flow.slug.to_owned(),
                step_slug: (*step).to_owned(),
            });
        }
    }
    match flow.served_step {
        None => {
            let mut queues: Vec<String> = rows.into_iter().map(|(_, q)| q).collect();
            queues.sort();
            queues.dedup();
            if queues != [queue] {
                return Err(WorkerError::SeveralQueues {
                    flow_slug: flow.slug.to_owned(),
                    queues,
                });
            }
        }
        Some(step) => {
            let persisted = rows
                .into_iter()
                .find(|(slug, _)| slug == step)
                .map(|(_, q)| q)
                .unwrap_or_default();
            if persisted != queue {
                return Err(WorkerError::QueueMismatch {
                    flow_slug: flow.slug.to_owned(),
                    step_slug: step.to_owned(),
                    expected_queue: queue.to_owned(),
                    persisted_queue: persisted,
                });
            }
        }
    }
    Ok(())
}

async fn check_schema(pool: &PgPool, auto_install: bool) -> Result<(), WorkerError> {
    let required = pgflow_sql::latest_version();
    let mut conn = pool.acquire().await.during("checking the pgflow schema")?;
    let installed = pgflow_sql::applied_versions(&mut conn)
        .await?
        .pop()
        .unwrap_or_default();
    drop(conn);
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

async fn compile(
    pool: &PgPool,
    flow: &FlowEntry,
    compilation: Compilation,
) -> Result<CompileStatus, WorkerError> {
    let allow_data_loss = match compilation {
        Compilation::Skip => return Ok(CompileStatus::Skipped),
        Compilation::Verify => false,
        Compilation::AllowDataLoss => true,
    };
    let (queue_mode, routes) = flow.routing.compile_arguments();
    let result: Value = sqlx::query_scalar(statements::ENSURE_FLOW_COMPILED)
        .bind(flow.slug)
        .bind(&flow.shape)
        .bind(allow_data_loss)
        .bind(queue_mode)
        .bind(routes)
        .fetch_one(pool)
        .await
        .map_err(|e| routing_or_database(flow.slug, "compiling the flow", e))?;
    let differences: Vec<String> = result["differences"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|d| d.as_str().map_or_else(|| d.to_string(), str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    match result["status"].as_str() {
        Some("compiled") => Ok(CompileStatus::Compiled),
        Some("verified") => Ok(CompileStatus::Verified),
        Some("recompiled") => {
            tracing::warn!(
                flow = flow.slug,
                differences = ?differences,
                "flow recompiled: its previous definition and every run of it were deleted"
            );
            Ok(CompileStatus::Recompiled)
        }
        Some("mismatch") => Err(WorkerError::ShapeMismatch {
            flow_slug: flow.slug.to_owned(),
            differences,
        }),
        other => Err(WorkerError::UnexpectedResult {
            during: "compiling the flow",
            result: format!("ensure_flow_compiled status {other:?}"),
        }),
    }
}

/// Startup visibility of missing step workers: routes with queued work and no live worker.
pub(crate) async fn log_uncovered_routes(pool: &PgPool, flow_slug: &str) {
    let rows: Result<Vec<(String, String, i64)>, sqlx::Error> =
        sqlx::query_as(statements::UNCOVERED_ROUTES)
            .bind(flow_slug)
            .fetch_all(pool)
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
