//! Rollouts: `activate` (`pgflow.activate_alias`), `fence` / `unfence` (`pgflow.disable_worker_function` /
//! `enable_worker_function`) and `retirable` (`pgflow.version_retirable`). Each is one call of the SQL
//! core's function, which holds the rule; these commands only call it and print its answer.

use pgflow_runtime::admin::Admin;
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::types::Json;
use sqlx::PgPool;

use crate::db::{explain, explain_admin, About};
use crate::output::{self, Out};

/// `pgflow.activate_alias`'s answer (a missing field is a decode error).
#[derive(Debug, Deserialize, Serialize)]
struct Activation {
    alias: String,
    flow_slug: String,
    previous_flow_slug: Option<String>,
    activated_at: String,
    /// `false`: the alias already pointed at the version.
    activated: bool,
}

/// A worker function's fence, as `pgflow.disable_worker_function` and `enable_worker_function` answer.
#[derive(Debug, Deserialize, Serialize)]
struct FunctionState {
    function_name: String,
    enabled: bool,
    disabled_reason: Option<String>,
    disabled_at: Option<String>,
}

/// `activate ALIAS VERSION`.
pub(crate) async fn activate(
    pool: &PgPool,
    out: Out,
    alias: &str,
    version: &str,
) -> anyhow::Result<()> {
    let Json(result): Json<Activation> = sqlx::query_scalar("select pgflow.activate_alias($1, $2)")
        .bind(alias)
        .bind(version)
        .fetch_one(pool)
        .await
        .map_err(|e| explain(e, About::Nothing))?;
    if out.json {
        return out.json(&result);
    }
    output::line(&match (result.activated, result.previous_flow_slug.as_deref()) {
        (false, _) => format!("alias `{alias}` already points at `{version}` (nothing changed)"),
        (_, Some(previous)) => format!(
            "alias `{alias}` now points at `{version}` (was `{previous}`; roll back with `pgflow activate {alias} {previous}`)"
        ),
        _ => format!("alias `{alias}` now points at `{version}`"),
    })
}

/// Whether a worker function was ever tracked (a worker registered with it, or it was fenced before), as the
/// read layer lists them.
async fn known_function(pool: &PgPool, function: &str) -> anyhow::Result<bool> {
    let functions = Admin::new(pool.clone())
        .worker_functions()
        .await
        .map_err(|e| explain_admin(e, About::Nothing))?;
    Ok(functions.iter().any(|f| f.function_name == function))
}

/// `fence FUNCTION --reason ..`.
pub(crate) async fn fence(
    pool: &PgPool,
    out: Out,
    function: &str,
    reason: &str,
) -> anyhow::Result<()> {
    let known = known_function(pool, function).await?;
    let Json(state): Json<FunctionState> =
        sqlx::query_scalar("select pgflow.disable_worker_function($1, $2)")
            .bind(function)
            .bind(reason)
            .fetch_one(pool)
            .await
            .map_err(|e| explain(e, About::Nothing))?;
    if out.json {
        return out.json(&state);
    }
    // The first reason stays when the function was fenced already.
    let kept = state.disabled_reason.as_deref().unwrap_or(reason);
    output::line(&format!(
        "worker function `{function}` is fenced ({kept}): its workers claim nothing and stop at their next \
         heartbeat; lift it with `pgflow unfence {function}`"
    ))?;
    if !known {
        output::line(&format!(
            "note: no worker has registered as `{function}` yet; check the name if you meant a running deployment"
        ))?;
    }
    Ok(())
}

/// `unfence FUNCTION`.
pub(crate) async fn unfence(pool: &PgPool, out: Out, function: &str) -> anyhow::Result<()> {
    if !known_function(pool, function).await? {
        anyhow::bail!(
            "no worker function is named `{function}`; `pgflow status` lists the fenced ones"
        );
    }
    let Json(state): Json<FunctionState> =
        sqlx::query_scalar("select pgflow.enable_worker_function($1)")
            .bind(function)
            .fetch_one(pool)
            .await
            .map_err(|e| explain(e, About::Nothing))?;
    if out.json {
        return out.json(&state);
    }
    output::line(&format!(
        "worker function `{function}` is enabled: start (or restart) its workers"
    ))
}

/// `retirable VERSION [--queue Q]`: `pgflow.version_retirable` for each queue the version uses.
pub(crate) async fn retirable(
    pool: &PgPool,
    out: Out,
    version: &str,
    queue: Option<&str>,
) -> anyhow::Result<()> {
    let answers = Admin::new(pool.clone())
        .version_retirable(version, queue)
        .await
        .map_err(|e| explain_admin(e, About::Nothing))?;
    let all = answers.iter().all(|a| a.retirable);
    if out.json {
        return out.json(&json!({ "flow_slug": version, "retirable": all, "queues": answers }));
    }
    let mut table = output::table(["QUEUE", "RETIRABLE", "BLOCKERS"]);
    for a in &answers {
        let blockers: Vec<String> = a.blockers.iter().map(ToString::to_string).collect();
        table.add_row([
            a.queue_name.clone(),
            if a.retirable { "yes" } else { "no" }.to_owned(),
            if blockers.is_empty() {
                "-".to_owned()
            } else {
                blockers.join("; ")
            },
        ]);
    }
    output::print_table(&table, "no queues")?;
    output::line(&if all {
        format!("`{version}` is retirable on every queue: deploy the workers without it (fence, drain, deploy, unfence)")
    } else {
        format!("`{version}` is not retirable yet: keep it in the workers of the queues marked no")
    })
}
