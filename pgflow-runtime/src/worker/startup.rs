//! Startup: schema check, compilation, queue resolution, worker-function fence, registration.

use std::time::Duration;

use serde_json::{json, Value};
use sqlx::PgPool;
use uuid::Uuid;

use super::error::{routing_or_database, Context, WorkerError};
use super::Mode;
use crate::config::{Compilation, WorkerConfig};
use crate::flow::{Flow, FlowStep};
use crate::statements as sql;

/// What startup learned from the database.
pub(crate) struct Prepared {
    pub(crate) queue: String,
    pub(crate) function_name: String,
    /// Effective timeout per step index.
    pub(crate) timeouts: Vec<Duration>,
    pub(crate) compile_status: String,
}

pub(crate) async fn prepare<F: Flow>(
    pool: &PgPool,
    mode: Mode<F::Step>,
    config: &WorkerConfig,
    worker_id: Uuid,
) -> Result<Prepared, WorkerError> {
    check_schema(pool, config.auto_install).await?;
    let compile_status = compile::<F>(pool, mode, config.compilation).await?;

    let rows: Vec<(String, String, i32)> = sqlx::query_as(sql::FLOW_STEPS)
        .bind(F::SLUG)
        .fetch_all(pool)
        .await
        .during("reading the flow's steps")?;
    if rows.is_empty() {
        return Err(WorkerError::FlowMissing {
            flow_slug: F::SLUG.to_owned(),
        });
    }
    let mut timeouts = Vec::with_capacity(F::Step::ALL.len());
    for step in F::Step::ALL {
        let Some((_, _, secs)) = rows.iter().find(|(slug, _, _)| slug == step.slug()) else {
            return Err(WorkerError::StepMissing {
                flow_slug: F::SLUG.to_owned(),
                step_slug: step.slug().to_owned(),
            });
        };
        timeouts.push(Duration::from_secs(
            u64::try_from(*secs).unwrap_or(1).max(1),
        ));
    }

    let queue = match mode {
        Mode::Plain => {
            let mut queues: Vec<String> = rows.iter().map(|(_, q, _)| q.clone()).collect();
            queues.sort();
            queues.dedup();
            if queues.len() != 1 {
                return Err(WorkerError::SeveralQueues {
                    flow_slug: F::SLUG.to_owned(),
                    queues,
                });
            }
            queues.remove(0)
        }
        Mode::Step { step, routes } => {
            let route = routes[step.index()].1;
            let persisted = rows
                .iter()
                .find(|(slug, _, _)| slug == step.slug())
                .map(|(_, q, _)| q.clone())
                .unwrap_or_default();
            if persisted != route {
                return Err(WorkerError::QueueMismatch {
                    flow_slug: F::SLUG.to_owned(),
                    step_slug: step.slug().to_owned(),
                    expected_queue: route.to_owned(),
                    persisted_queue: persisted,
                });
            }
            persisted
        }
    };

    let function_name = config.worker_name.clone().unwrap_or_else(|| queue.clone());
    let step_slug = match mode {
        Mode::Plain => None,
        Mode::Step { step, .. } => Some(step.slug()),
    };
    let state: Value = sqlx::query_scalar(sql::REGISTER_WORKER)
        .bind(worker_id)
        .bind(&function_name)
        .bind(&queue)
        .bind(F::SLUG)
        .bind(step_slug)
        .fetch_one(pool)
        .await
        .map_err(|e| routing_or_database(F::SLUG, "registering the worker", e))?;
    if state["enabled"] == Value::Bool(false) {
        // Registered but fenced: record it as stopped at once, so monitoring does not count it.
        sqlx::query(sql::MARK_WORKER_STOPPED)
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
        queue,
        function_name,
        timeouts,
        compile_status,
    })
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

async fn compile<F: Flow>(
    pool: &PgPool,
    mode: Mode<F::Step>,
    compilation: Compilation,
) -> Result<String, WorkerError> {
    let allow_data_loss = match compilation {
        Compilation::Skip => return Ok("skipped".to_owned()),
        Compilation::Verify => false,
        Compilation::AllowDataLoss => true,
    };
    let (queue_mode, routes) = match mode {
        Mode::Plain => ("flow", None),
        Mode::Step { routes, .. } => (
            "step",
            Some(Value::Array(
                routes
                    .iter()
                    .map(|(step, queue)| json!({"step_slug": step.slug(), "queue_name": queue}))
                    .collect(),
            )),
        ),
    };
    let result: Value = sqlx::query_scalar(sql::ENSURE_FLOW_COMPILED)
        .bind(F::SLUG)
        .bind(F::shape())
        .bind(allow_data_loss)
        .bind(queue_mode)
        .bind(routes)
        .fetch_one(pool)
        .await
        .map_err(|e| routing_or_database(F::SLUG, "compiling the flow", e))?;
    let status = result["status"].as_str().unwrap_or_default().to_owned();
    let differences: Vec<String> = result["differences"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|d| d.as_str().map_or_else(|| d.to_string(), str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    match status.as_str() {
        "mismatch" => Err(WorkerError::ShapeMismatch {
            flow_slug: F::SLUG.to_owned(),
            differences,
        }),
        "recompiled" => {
            tracing::warn!(
                flow = F::SLUG,
                differences = ?differences,
                "flow recompiled: its previous definition and every run of it were deleted"
            );
            Ok(status)
        }
        _ => Ok(status),
    }
}
