//! The failure hook: `observability::failures` yields each failure of a run once, task then run.

use futures::StreamExt;
use pgflow_runtime::observability::{self, FailureKind};
use pgflow_runtime::{flow, Client, StepError, Worker};

use crate::{spawn, stop, LIMIT};

#[flow(slug = "hookedFlow", input = String, max_attempts = 2, base_delay = 0)]
mod hooked {
    use super::*;

    #[step]
    async fn always_fails(s: String) -> Result<String, StepError> {
        Err(StepError::msg(format!("cannot reach {s}")))
    }
}

#[tokio::test]
async fn a_failed_run_is_announced_once_for_its_exhausted_task_and_once_for_the_run() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let failures = observability::failures(pool).await.unwrap();
    let mut failures = std::pin::pin!(failures);
    let worker = spawn(Worker::<hooked::Hooked>::builder(pool.clone())).await;
    let run = Client::new(pool.clone())
        .start::<hooked::Hooked>(&"x".to_owned())
        .await
        .unwrap();
    let task = tokio::time::timeout(LIMIT, failures.next())
        .await
        .unwrap()
        .unwrap();
    let failed_run = tokio::time::timeout(LIMIT, failures.next())
        .await
        .unwrap()
        .unwrap();
    stop(worker).await;
    assert_eq!(task.kind, FailureKind::TaskFailed);
    assert_eq!(
        (task.run_id, task.attempt, task.task_index),
        (run.run_id(), Some(2), Some(0))
    );
    assert_eq!(task.step_slug.as_deref(), Some("always_fails"));
    assert_eq!(task.error, "cannot reach x");
    assert_eq!(failed_run.kind, FailureKind::RunFailed);
    assert_eq!(
        (failed_run.run_id, failed_run.flow_slug.as_str()),
        (run.run_id(), "hookedFlow")
    );
    assert_eq!(failed_run.error, "cannot reach x");
    // The log holds the same two, once each.
    let logged: i64 = sqlx::query_scalar(
        "select count(*) from pgflow.events where run_id = $1 and kind in ('task_failed', 'run_failed')",
    )
    .bind(run.run_id())
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(logged, 2);
}
