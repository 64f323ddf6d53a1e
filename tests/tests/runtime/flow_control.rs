//! Flow control across worker processes: two `schedule_worker limited` processes (8 handler slots each) run
//! `limitedWork` under limits set in the database. What ran when is read back from the outputs: each
//! handler call reports when it began and ended by the worker's clock (both processes run on this host).
//! A call runs inside its task's slot, which is taken when the claim commits and freed when the output is
//! recorded, so calls can overlap no more than slots. The task rows' own times cannot show this:
//! `started_at` is the claim transaction's start, which may come before a slot freed by another commit.

use std::process::Stdio;
use std::time::Duration;

use chrono::{DateTime, Utc};
use pgflow_runtime::flow_control;
use serde_json::json;
use sqlx::PgPool;
use tokio::process::{Child, Command};

use crate::support::LIMIT;

fn spawn(url: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_schedule_worker"))
        .arg("limited")
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

async fn stop(child: Child) {
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id().unwrap()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let output = tokio::time::timeout(LIMIT, child.wait_with_output())
        .await
        .expect("the worker stops in time after SIGTERM")
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Starts both workers and waits until they compiled the flow and registered.
async fn workers(db: &pgflow_tests::TestDb) -> (Child, Child, String) {
    let a = spawn(db.url());
    let b = spawn(db.url());
    let pool = db.pool();
    pgflow_tests::wait_until(LIMIT, "two registered workers", || async {
        sqlx::query_scalar::<_, i64>(
            "select count(*) from pgflow.workers w join pgflow.steps s on s.queue_name = w.queue_name
             where s.flow_slug = 'limitedWork' and w.stopped_at is null",
        )
        .fetch_one(pool)
        .await
        .unwrap()
            == 2
    })
    .await;
    let queue: String =
        sqlx::query_scalar("select queue_name from pgflow.steps where flow_slug = 'limitedWork'")
            .fetch_one(pool)
            .await
            .unwrap();
    (a, b, queue)
}

async fn start(pool: &PgPool, tenants: &[&str]) {
    let inputs: Vec<serde_json::Value> = tenants.iter().map(|t| json!({"tenant": t})).collect();
    sqlx::query("select pgflow.start_flows('limitedWork', $1)")
        .bind(&inputs)
        .execute(pool)
        .await
        .unwrap();
}

async fn wait_all_completed(pool: &PgPool, n: i64, limit: Duration) {
    pgflow_tests::wait_until(limit, "every run completed", || async {
        sqlx::query_scalar::<_, i64>(
            "select count(*) from pgflow.runs where flow_slug = 'limitedWork' and status = 'completed'",
        )
        .fetch_one(pool)
        .await
        .unwrap()
            == n
    })
    .await;
}

/// (tenant, began, ended) of every recorded handler call, by start.
async fn calls(pool: &PgPool) -> Vec<(String, DateTime<Utc>, DateTime<Utc>)> {
    sqlx::query_as(
        "select t.output ->> 'tenant', (t.output ->> 'began')::timestamptz, (t.output ->> 'ended')::timestamptz
         from pgflow.step_tasks t
         where t.flow_slug = 'limitedWork' and t.status = 'completed' order by 2",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// The most calls running at once (of `tenant`, or of all).
fn most_at_once(calls: &[(String, DateTime<Utc>, DateTime<Utc>)], tenant: Option<&str>) -> usize {
    let mine: Vec<_> = calls
        .iter()
        .filter(|c| tenant.is_none_or(|t| c.0 == t))
        .collect();
    mine.iter()
        .map(|c| mine.iter().filter(|o| o.1 <= c.1 && c.1 < o.2).count())
        .max()
        .unwrap_or(0)
}

#[tokio::test]
async fn queue_and_key_limits_hold_across_two_worker_processes() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let (a, b, queue) = workers(&db).await;
    flow_control::set_queue_limit(pool, &queue, Some(3), None)
        .await
        .unwrap();
    flow_control::set_key_limit(pool, "limitedWork", "work", &["tenant"], 2)
        .await
        .unwrap();

    let mut tenants = vec!["a"; 30];
    tenants.extend(["b"; 6]);
    tenants.extend(["c"; 6]);
    start(pool, &tenants).await;
    wait_all_completed(pool, 42, LIMIT * 4).await;
    stop(a).await;
    stop(b).await;

    let calls = calls(pool).await;
    assert_eq!(calls.len(), 42);
    let overall = most_at_once(&calls, None);
    assert!(
        overall <= 3,
        "{overall} tasks of the queue ran at once (limit 3)"
    );
    assert!(
        overall >= 2,
        "the limit admits more than one at once ({overall})"
    );
    for t in ["a", "b", "c"] {
        let n = most_at_once(&calls, Some(t));
        assert!(n <= 2, "{n} tasks of tenant {t} ran at once (limit 2)");
    }
    // No attempt was spent on a held task: every task ran once.
    let retried: i64 = sqlx::query_scalar(
        "select count(*) from pgflow.step_tasks where flow_slug = 'limitedWork' and attempts_count <> 1",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(retried, 0);
}

/// A rate of 5 starts per 10 s across both processes, for 35 tasks: the k-th start comes no earlier than the
/// bucket allows (5 at once, then one every 2 s), over a minute.
#[tokio::test]
async fn a_rate_limit_holds_for_a_minute_across_two_worker_processes() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let (a, b, queue) = workers(&db).await;
    flow_control::set_queue_limit(pool, &queue, None, Some((5, Duration::from_secs(10))))
        .await
        .unwrap();
    start(pool, &["r"; 35]).await;
    wait_all_completed(pool, 35, Duration::from_secs(150)).await;
    stop(a).await;
    stop(b).await;

    let calls = calls(pool).await;
    let first = calls[0].1;
    for (k, c) in calls.iter().enumerate() {
        let earliest = chrono::Duration::milliseconds(2000 * (k as i64 + 1 - 5).max(0));
        assert!(
            c.1 - first >= earliest - chrono::Duration::milliseconds(250),
            "start {k} came {:?} after the first; the bucket allows it at {earliest:?}",
            c.1 - first
        );
    }
    assert!(calls[34].1 - first >= chrono::Duration::seconds(59));
}
