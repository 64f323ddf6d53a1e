//! The operator's read layer (`pgflow_runtime::admin`) over runs a real worker ran: filters, keyset pages,
//! counts, a failed run in detail, the fleet views and the operator record.
#![allow(unreachable_pub)] // flow input types appear in the generated (public) flow items

use std::collections::HashSet;
use std::time::Duration;

use chrono::Utc;
use pgflow_runtime::admin::{
    ActionKind, Admin, AttemptEnd, AttemptOutcome, NewAction, RunFilter, TaskStatus,
};
use pgflow_runtime::client::{RunStatus, StepStatus};
use pgflow_runtime::{flow, Client, StepContext, StepError};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::support::{self, LIMIT};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Job {
    pub label: String,
    pub n: u32,
    pub fail: bool,
}

#[flow(slug = "adminFlow", input = Job, max_attempts = 1, base_delay = 0)]
mod admin_flow {
    use super::*;

    /// `0..n`, with its last element 999 when the job asks to fail.
    #[step]
    async fn split(job: Job) -> Result<Vec<u32>, StepError> {
        let mut elements: Vec<u32> = (0..job.n).collect();
        if job.fail {
            *elements.last_mut().expect("n > 0") = 999;
        }
        Ok(elements)
    }

    /// `x * 10` per element.
    #[step(map = split)]
    async fn each(x: u32) -> Result<u32, StepError> {
        Ok(x * 10)
    }

    /// The sum, or a terminal error for an element 999.
    #[step(depends_on = [each])]
    async fn total(each: Vec<u32>) -> Result<u32, StepError> {
        if each.contains(&9990) {
            return Err(StepError::terminal("total refused element 999 <script>"));
        }
        Ok(each.iter().sum())
    }
}

use admin_flow::AdminFlow;

#[tokio::test]
async fn the_read_layer_filters_pages_counts_and_details_the_runs_a_worker_ran() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn::<AdminFlow>(pool).await;
    let client = Client::new(pool.clone());
    let mut ids = Vec::new();
    for i in 0..7u32 {
        let job = Job {
            label: format!("job{i}"),
            n: 3,
            fail: i >= 5,
        };
        ids.push(client.start::<AdminFlow>(&job).await.unwrap().run_id());
    }
    for id in &ids {
        let _ = client.wait_json(*id, LIMIT).await;
    }
    let admin = Admin::new(pool.clone());

    // Every run, newest first; by status; counts per status.
    let all = admin.runs(&RunFilter::new()).await.unwrap();
    assert_eq!(all.items.len(), 7);
    assert!(all.next.is_none());
    let newest_first: Vec<_> = all.items.iter().map(|r| r.run_id).collect();
    let mut expected = ids.clone();
    expected.sort_by_key(|id| {
        let r = all.items.iter().find(|r| r.run_id == *id).unwrap();
        std::cmp::Reverse((r.started_at, r.run_id))
    });
    assert_eq!(newest_first, expected);
    let failed = admin
        .runs(&RunFilter::new().status(RunStatus::Failed))
        .await
        .unwrap();
    assert_eq!(failed.items.len(), 2);
    assert!(failed.items.iter().all(|r| r.status == RunStatus::Failed
        && r.finished_at.is_some()
        && r.input.as_ref().unwrap()["fail"] == json!(true)));
    let counts = admin.run_counts(&RunFilter::new()).await.unwrap();
    let count = |s: RunStatus| counts.iter().find(|c| c.status == s).unwrap().count;
    assert_eq!(count(RunStatus::Completed), 5);
    assert_eq!(count(RunStatus::Failed), 2);
    assert_eq!(count(RunStatus::Started), 0);
    assert!(counts.iter().all(|c| !c.capped));

    // Keyset pages of 3: 3, 3, 1, no run twice, the same order as one page.
    let mut seen = Vec::new();
    let mut filter = RunFilter::new().limit(3);
    let mut pages = 0;
    loop {
        let page = admin.runs(&filter).await.unwrap();
        pages += 1;
        seen.extend(page.items.iter().map(|r| r.run_id));
        match page.next {
            Some(cursor) => {
                // The cursor survives its text form (as in a URL).
                filter = RunFilter::new()
                    .limit(3)
                    .after(cursor.to_string().parse().unwrap());
            }
            None => break,
        }
    }
    assert_eq!(pages, 3);
    assert_eq!(seen, newest_first);
    assert_eq!(seen.iter().collect::<HashSet<_>>().len(), 7);

    // Input at a JSON path, alias and version, time range.
    let by_label = admin
        .runs(&RunFilter::new().input_equals(["label"], json!("job3")))
        .await
        .unwrap();
    assert_eq!(by_label.items.len(), 1);
    assert_eq!(by_label.items[0].run_id, ids[3]);
    sqlx::query("select pgflow.activate_alias('adminAlias', 'adminFlow')")
        .execute(pool)
        .await
        .unwrap();
    for (filter, n) in [
        (RunFilter::new().flow("adminAlias"), 7),
        (RunFilter::new().flow("adminFlow"), 7),
        (RunFilter::new().flow("otherAlias"), 0),
        (RunFilter::new().version("adminFlow"), 7),
        (RunFilter::new().version("adminAlias"), 0),
        (
            RunFilter::new().started_after(Utc::now() + chrono::Duration::hours(1)),
            0,
        ),
        (
            RunFilter::new().started_before(Utc::now() + chrono::Duration::hours(1)),
            7,
        ),
    ] {
        let page = admin.runs(&filter).await.unwrap();
        assert_eq!(page.items.len(), n, "{filter:?}");
    }

    // A failed run in detail: the DAG's steps, map progress, the failed task's error and its worker.
    let detail = admin.run(ids[6]).await.unwrap().expect("the run exists");
    let queue_name = detail.steps[0].queue_name.clone();
    assert_eq!(detail.run.status, RunStatus::Failed);
    assert_eq!(detail.run.aliases, vec!["adminAlias".to_owned()]);
    let slugs: Vec<_> = detail.steps.iter().map(|s| s.step_slug.as_str()).collect();
    assert_eq!(slugs, ["split", "each", "total"]);
    let each = detail.step("each").unwrap();
    assert!(each.is_map());
    assert_eq!(each.deps, vec!["split".to_owned()]);
    assert_eq!(each.progress(), Some((3, 3)));
    assert_eq!(detail.step("total").unwrap().status, StepStatus::Failed);
    assert_eq!(detail.step("total").unwrap().progress(), Some((0, 1)));
    assert_eq!(detail.tasks_of("each").count(), 3);
    let failed_tasks: Vec<_> = detail.failed_tasks().collect();
    assert_eq!(failed_tasks.len(), 1);
    let task = failed_tasks[0];
    assert_eq!(task.step_slug, "total");
    assert!(
        task.error_message
            .as_deref()
            .unwrap()
            .contains("total refused element 999"),
        "{task:?}"
    );
    assert_eq!(task.worker_id, Some(worker.id()));
    assert!(task.started_at.is_some() && task.failed_at.is_some());
    assert!(detail
        .tasks
        .iter()
        .filter(|t| t.step_slug != "total")
        .all(|t| t.status == TaskStatus::Completed && t.output.is_some()));
    let kinds: Vec<_> = detail.events.iter().map(|e| e.kind.as_str()).collect();
    assert!(
        kinds.contains(&"run_failed") && kinds.contains(&"task_failed"),
        "{kinds:?}"
    );
    assert!(admin.run(uuid::Uuid::new_v4()).await.unwrap().is_none());

    // Hidden payloads never leave the database.
    let hidden = admin.clone().hide_payloads(true);
    let page = hidden.runs(&RunFilter::new()).await.unwrap();
    assert!(page.items.iter().all(|r| r.input.is_none()));
    let detail = hidden.run(ids[0]).await.unwrap().unwrap();
    assert!(detail.run.input.is_none() && detail.run.output.is_none());
    assert!(detail.steps.iter().all(|s| s.output.is_none()));
    assert!(detail.tasks.iter().all(|t| t.output.is_none()));

    // The fleet: the queue, the live worker and its routes, the version behind the alias, rates.
    let queues = admin.queues().await.unwrap();
    let queue = queues
        .iter()
        .find(|q| q.queue_name == queue_name)
        .expect("the flow's queue");
    assert_eq!(queue.depth, Some(0), "{queues:?}");
    assert_eq!(queue.live_workers, 1);
    let workers = admin.workers(Duration::from_secs(3600)).await.unwrap();
    let w = workers.iter().find(|w| w.worker_id == worker.id()).unwrap();
    assert!(w.live && w.enabled);
    assert_eq!(w.versions(), vec!["adminFlow"]);
    let flows = admin.flows().await.unwrap();
    let f = flows.iter().find(|f| f.flow_slug == "adminFlow").unwrap();
    assert_eq!(f.steps, 3);
    assert_eq!(f.aliases, vec!["adminAlias".to_owned()]);
    let aliases = admin.aliases().await.unwrap();
    let alias = aliases.iter().find(|a| a.alias == "adminAlias").unwrap();
    assert_eq!(alias.flow_slug, "adminFlow");
    assert_eq!(alias.versions.len(), 1);
    assert!(alias.versions[0].active);
    let rates = admin.queue_rates(5).await.unwrap();
    let rate = rates.iter().find(|r| r.queue_name == queue_name).unwrap();
    assert_eq!(rate.minutes.len(), 5);
    let claimed: i64 = rate.minutes.iter().map(|m| m.claimed).sum();
    let completed: i64 = rate.minutes.iter().map(|m| m.completed).sum();
    let failed: i64 = rate.minutes.iter().map(|m| m.failed).sum();
    // 7 runs × (split + 3 × each + total) claims; the 2 failing totals fail.
    assert_eq!((claimed, completed, failed), (35, 33, 2));
    assert!(admin.uncovered_routes().await.unwrap().is_empty());
    assert!(admin.worker_functions().await.is_ok());

    // With the worker gone, queued work is uncovered.
    worker.stop().await;
    let stranded = client
        .start::<AdminFlow>(&Job {
            label: "stranded".into(),
            n: 1,
            fail: false,
        })
        .await
        .unwrap()
        .run_id();
    let uncovered = admin.uncovered_routes().await.unwrap();
    assert!(
        uncovered
            .iter()
            .any(|u| u.flow_slug == "adminFlow" && u.step_slug == "split" && u.queued_tasks == 1),
        "{uncovered:?}"
    );
    let counts = admin.run_counts(&RunFilter::new()).await.unwrap();
    assert_eq!(
        counts
            .iter()
            .find(|c| c.status == RunStatus::Started)
            .unwrap()
            .count,
        1
    );

    // The operator record: what was done, by whom, and a refusal with its error.
    let first = admin
        .record_action(
            &NewAction::on_run("alice", "dashboard", ActionKind::Cancel, stranded)
                .detail(json!({"reason": "stuck"})),
        )
        .await
        .unwrap();
    let second = admin
        .record_action(
            &NewAction::on_run("alice", "dashboard", ActionKind::Retry, ids[0])
                .outcome(Err("the run is completed".into())),
        )
        .await
        .unwrap();
    assert!(second > first);
    let on_run = admin.actions(Some(stranded), 10).await.unwrap();
    assert_eq!(on_run.len(), 1);
    assert_eq!(on_run[0].actor, "alice");
    assert_eq!(on_run[0].action, ActionKind::Cancel);
    assert!(on_run[0].succeeded);
    assert_eq!(on_run[0].detail, json!({"reason": "stuck"}));
    let all = admin.actions(None, 10).await.unwrap();
    assert_eq!(all.len(), 2);
    assert_eq!(all[0].action_id, second, "newest first");
    assert!(!all[0].succeeded);
    assert_eq!(all[0].error.as_deref(), Some("the run is completed"));
    let detail = admin.run(ids[0]).await.unwrap().unwrap();
    assert_eq!(detail.actions.len(), 1);
}

#[flow(slug = "historyFlow", input = u32, max_attempts = 3, base_delay = 0)]
mod history_flow {
    use super::*;

    /// Fails on its first two attempts (naming the attempt), then returns its input.
    #[step]
    async fn flaky(n: u32, ctx: &StepContext<HistoryFlow>) -> Result<u32, StepError> {
        if ctx.attempt() < 3 {
            return Err(StepError::msg(format!("attempt {} failed", ctx.attempt())));
        }
        Ok(n)
    }
}

#[tokio::test]
async fn a_task_that_failed_twice_then_succeeded_shows_its_three_attempts_in_order() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn::<history_flow::HistoryFlow>(pool).await;
    let client = Client::new(pool.clone());
    let run = client.start::<history_flow::HistoryFlow>(&7).await.unwrap();
    assert_eq!(run.wait(LIMIT).await.unwrap().flaky, 7);

    let detail = Admin::new(pool.clone())
        .run(run.run_id())
        .await
        .unwrap()
        .unwrap();
    let task = &detail.tasks[0];
    assert_eq!((task.status, task.attempts), (TaskStatus::Completed, 3));
    let earlier: Vec<_> = detail.attempts_of("flaky", 0).collect();
    assert_eq!(earlier.len(), 2);
    assert!(earlier.iter().all(|a| a.outcome == AttemptOutcome::Failed));

    let attempts = detail.attempt_list(task);
    let seen: Vec<_> = attempts
        .iter()
        .map(|a| (a.number, a.end, a.worker_id, a.error_message))
        .collect();
    assert_eq!(
        seen,
        [
            (
                1,
                AttemptEnd::Earlier(AttemptOutcome::Failed),
                Some(worker.id()),
                Some("attempt 1 failed")
            ),
            (
                2,
                AttemptEnd::Earlier(AttemptOutcome::Failed),
                Some(worker.id()),
                Some("attempt 2 failed")
            ),
            (
                3,
                AttemptEnd::Current(TaskStatus::Completed),
                Some(worker.id()),
                None
            ),
        ]
    );
    assert!(attempts.iter().all(|a| a.worker_function.is_some()));
    // Each attempt waits, runs and ends in turn.
    for pair in attempts.windows(2) {
        assert!(pair[0].ended_at.unwrap() <= pair[1].queued_at, "{pair:?}");
    }
    for a in &attempts {
        assert!(
            a.queued_at <= a.started_at.unwrap() && a.started_at <= a.ended_at,
            "{a:?}"
        );
    }
    worker.stop().await;
}
