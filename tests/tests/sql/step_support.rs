//! Helpers for the per-step queue tests: shapes, compilation with a queue mode, database error fields,
//! worker registration and the classifying claim.

use pgflow_sql::SqlState;
use serde_json::{json, Value};
use sqlx::postgres::PgDatabaseError;
use sqlx::PgPool;
use uuid::Uuid;

/// A step of a shape JSON: single, no conditions.
pub(crate) fn step(slug: &str, deps: &[&str]) -> Value {
    json!({
        "slug": slug, "stepType": "single", "dependencies": deps,
        "whenUnmet": "skip", "whenExhausted": "fail",
        "requiredInputPattern": {"defined": false}, "forbiddenInputPattern": {"defined": false}
    })
}

/// A shape JSON with the given steps (flow timeout 30 s).
pub(crate) fn shape(steps: Vec<Value>) -> Value {
    json!({"options": {"timeout": 30}, "steps": steps})
}

/// A shape of independent root steps.
pub(crate) fn roots(slugs: &[&str]) -> Value {
    shape(slugs.iter().map(|s| step(s, &[])).collect())
}

/// ensure_flow_compiled with a queue mode; the database error on failure.
pub(crate) async fn try_compile(
    pool: &PgPool,
    flow: &str,
    shape: &Value,
    mode: &str,
    allow_data_loss: bool,
) -> Result<Value, sqlx::Error> {
    sqlx::query_scalar(
        "select pgflow.ensure_flow_compiled(flow_slug => $1, shape => $2, allow_data_loss => $3, queue_mode => $4)",
    )
    .bind(flow)
    .bind(shape)
    .bind(allow_data_loss)
    .bind(mode)
    .fetch_one(pool)
    .await
}

/// ensure_flow_compiled with a queue mode that must succeed; returns its status.
pub(crate) async fn compile(pool: &PgPool, flow: &str, shape: &Value, mode: &str) -> String {
    let result = try_compile(pool, flow, shape, mode, false)
        .await
        .unwrap_or_else(|e| panic!("ensure_flow_compiled({flow}, {mode}): {e}"));
    result["status"].as_str().unwrap().to_string()
}

/// SQLSTATE, MESSAGE, DETAIL and HINT of a database error.
#[derive(Debug)]
pub(crate) struct DbError {
    pub(crate) code: SqlState,
    pub(crate) message: String,
    pub(crate) detail: Option<String>,
    pub(crate) hint: Option<String>,
}

pub(crate) fn db_error(e: sqlx::Error) -> DbError {
    let pg = e
        .as_database_error()
        .and_then(|d| d.try_downcast_ref::<PgDatabaseError>())
        .unwrap_or_else(|| panic!("not a database error: {e}"));
    DbError {
        code: SqlState::from_code(pg.code()),
        message: pg.message().to_string(),
        detail: pg.detail().map(str::to_string),
        hint: pg.hint().map(str::to_string),
    }
}

/// The route map a flow persisted: (step_slug, queue_name) in step order.
pub(crate) async fn routes(pool: &PgPool, flow: &str) -> Vec<(String, String)> {
    sqlx::query_as("select step_slug, queue_name from pgflow.flow_routes($1) order by step_index")
        .bind(flow)
        .fetch_all(pool)
        .await
        .expect("flow_routes")
}

/// PGMQ queue names (pgmq.meta spelling), sorted.
pub(crate) async fn pgmq_queues(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar("select queue_name::text from pgmq.meta order by 1")
        .fetch_all(pool)
        .await
        .expect("pgmq.meta")
}

/// register_worker; returns its JSON.
/// The (flow, step) pairs of a subscription: one step, or every step of the flow (a plain worker); a flow
/// that does not exist gives one pair with an empty step (registration then names the missing flow).
pub(crate) async fn pairs(
    pool: &PgPool,
    flow: &str,
    step: Option<&str>,
) -> (Vec<String>, Vec<String>) {
    let steps: Vec<String> = match step {
        Some(step) => vec![step.to_owned()],
        None => sqlx::query_scalar(
            "select step_slug from pgflow.steps where flow_slug = $1 order by step_index",
        )
        .bind(flow)
        .fetch_all(pool)
        .await
        .expect("steps"),
    };
    let steps = if steps.is_empty() {
        vec![String::new()]
    } else {
        steps
    };
    (vec![flow.to_owned(); steps.len()], steps)
}

/// register_worker for a subscription (one step, or every step of the flow); returns its JSON.
pub(crate) async fn try_register(
    pool: &PgPool,
    worker: Uuid,
    function: &str,
    queue: &str,
    flow: &str,
    step: Option<&str>,
) -> Result<Value, sqlx::Error> {
    let (flows, steps) = pairs(pool, flow, step).await;
    sqlx::query_scalar(
        "select pgflow.register_worker(worker_id => $1, function_name => $2, queue_name => $3, flow_slugs => $4, step_slugs => $5)",
    )
    .bind(worker)
    .bind(function)
    .bind(queue)
    .bind(&flows)
    .bind(&steps)
    .fetch_one(pool)
    .await
}

pub(crate) async fn register(
    pool: &PgPool,
    worker: Uuid,
    function: &str,
    queue: &str,
    flow: &str,
    step: Option<&str>,
) -> Value {
    try_register(pool, worker, function, queue, flow, step)
        .await
        .unwrap_or_else(|e| panic!("register_worker({queue}): {e}"))
}

/// The rows of pgflow.claim_tasks / read_and_claim_tasks, gathered into one JSON object:
/// {"outcome", "tasks": [...], "deferred": [ids], "archived": [ids], "waiting": [ids], "unsupported", "disabled"}.
pub(crate) fn claim_json(rows: Vec<sqlx::postgres::PgRow>) -> Value {
    use sqlx::Row;
    let mut out = serde_json::json!({"outcome": "claimed", "tasks": [], "deferred": [], "archived": [],
        "waiting": [], "unsupported": null, "disabled": null});
    for row in rows {
        let outcome: String = row.get("outcome");
        let msg_id: Option<i64> = row.get("msg_id");
        match outcome.as_str() {
            "claimed" => out["tasks"]
                .as_array_mut()
                .unwrap()
                .push(serde_json::json!({
                    "flow_slug": row.get::<String, _>("flow_slug"),
                    "run_id": row.get::<Uuid, _>("run_id"),
                    "step_slug": row.get::<String, _>("step_slug"),
                    "input": row.get::<Option<Value>, _>("input"),
                    "msg_id": msg_id,
                    "task_index": row.get::<i32, _>("task_index"),
                    "flow_input": row.get::<Option<Value>, _>("flow_input"),
                    "attempts_count": row.get::<i32, _>("attempts_count"),
                    "timeout": row.get::<i32, _>("timeout"),
                })),
            "deferred" | "archived" | "waiting" => out[outcome.as_str()]
                .as_array_mut()
                .unwrap()
                .push(serde_json::json!(msg_id)),
            "unsupported" | "disabled" => {
                out["outcome"] = Value::from(outcome.clone());
                out[outcome.as_str()] = row.get::<Value, _>("report");
            }
            other => panic!("unknown claim outcome {other}"),
        }
    }
    out
}

/// claim_tasks for a subscription (one step, or every step of the flow); returns its rows as JSON.
pub(crate) async fn claim_tasks(
    pool: &PgPool,
    queue: &str,
    flow: &str,
    step: Option<&str>,
    ids: &[i64],
    worker: Uuid,
) -> Value {
    let (flows, steps) = pairs(pool, flow, step).await;
    let rows = sqlx::query(
        "select * from pgflow.claim_tasks(queue_name => $1, msg_ids => $2, worker_id => $3, flow_slugs => $4, step_slugs => $5)",
    )
    .bind(queue)
    .bind(ids)
    .bind(worker)
    .bind(&flows)
    .bind(&steps)
    .fetch_all(pool)
    .await
    .unwrap_or_else(|e| panic!("claim_tasks({queue}): {e}"));
    claim_json(rows)
}

/// The msg_ids of a JSON array (claimed tasks' "msg_id" or a plain id list).
pub(crate) fn ids(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.get("msg_id").unwrap_or(x).as_i64().unwrap())
        .collect()
}

/// (status, attempts_count) of a task.
pub(crate) async fn task_state(pool: &PgPool, run: Uuid, step: &str, index: i32) -> (String, i32) {
    let (status, attempts, _error) = pgflow_tests::state::task(pool, run, step, index).await;
    (status, attempts)
}

/// The message id of a task.
pub(crate) async fn task_msg(pool: &PgPool, run: Uuid, step: &str) -> i64 {
    sqlx::query_scalar(
        "select message_id from pgflow.step_tasks where run_id = $1 and step_slug = $2 and task_index = 0",
    )
    .bind(run)
    .bind(step)
    .fetch_one(pool)
    .await
    .expect("task message")
}

/// Number of archived messages of a queue.
pub(crate) async fn archived_messages(pool: &PgPool, queue: &str) -> i64 {
    sqlx::query_scalar(&format!("select count(*) from pgmq.a_{queue}"))
        .fetch_one(pool)
        .await
        .expect("archived messages")
}
