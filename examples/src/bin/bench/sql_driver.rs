//! The in-run baseline: pgflow's SQL core driven the way upstream's worker drives it, one task at a time
//! per client: `pgmq.read`, then `pgflow.start_tasks`, then `pgflow.complete_task`.

use std::time::Duration;

use serde_json::Value;
use sqlx::PgConnection;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::db::BenchFlow;

/// One client: one connection, one task at a time, until `stop` fires.
pub(crate) async fn client(
    mut conn: PgConnection,
    slug: String,
    worker_id: Uuid,
    stop: CancellationToken,
) -> Result<(), sqlx::Error> {
    let queue = slug.to_lowercase();
    while !stop.is_cancelled() {
        let ids: Vec<i64> = sqlx::query_scalar("select msg_id from pgmq.read($1, 30, 1)")
            .bind(&queue)
            .fetch_all(&mut conn)
            .await?;
        if ids.is_empty() {
            // Client-side wait: never sleep inside the claiming statement.
            tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep(Duration::from_millis(10)) => continue,
            }
        }
        let tasks: Vec<(Uuid, String, i32, Value)> = sqlx::query_as(
            "select run_id, step_slug, task_index, coalesce(flow_input, input) \
             from pgflow.start_tasks(flow_slug => $1, msg_ids => $2, worker_id => $3)",
        )
        .bind(&slug)
        .bind(&ids)
        .bind(worker_id)
        .fetch_all(&mut conn)
        .await?;
        for (run_id, step_slug, task_index, input) in tasks {
            let output = BenchFlow::handle(&step_slug, &input);
            sqlx::query(
                "select 1 from pgflow.complete_task(run_id => $1, step_slug => $2, task_index => $3, output => $4)",
            )
            .bind(run_id)
            .bind(&step_slug)
            .bind(task_index)
            .bind(&output)
            .execute(&mut conn)
            .await?;
        }
    }
    Ok(())
}
