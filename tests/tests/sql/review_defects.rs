//! Defects an outside review found in failure handling, recovery and retention: a late failure of a
//! permanently stalled task, a started task whose message is gone, maintenance against a completion, a final
//! failure against a claim by explicit ids, and the watcher rows of pruned runs.
//!
//! The deadlock tests are deterministic: one session holds a lock, the next is started and the test waits
//! until `pg_stat_activity` shows it waiting for a lock before it lets the interleaving go on.

use std::time::Duration;

use crate::step_support::*;
use crate::support::*;
use pgflow_tests::{test_db, wait_until, TestDb};
use serde_json::{json, Value};
use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

/// Waits until another session of this database waits for a lock while running a query that contains `what`.
async fn wait_for_lock_wait(pool: &PgPool, what: &str) {
    let like = format!("%{what}%");
    wait_until(
        Duration::from_secs(10),
        &format!("{what} waiting on a lock"),
        || {
            let like = like.clone();
            async move {
                sqlx::query_scalar::<_, bool>(
                    "select exists (select 1 from pg_stat_activity
                 where datname = current_database() and wait_event_type = 'Lock' and query like $1
                   and pid <> pg_backend_pid())",
                )
                .bind(like)
                .fetch_one(pool)
                .await
                .unwrap()
            }
        },
    )
    .await;
}

async fn connect(db: &TestDb) -> PgConnection {
    PgConnection::connect_with(&db.options()).await.unwrap()
}

async fn begin(conn: &mut PgConnection) {
    sqlx::query("begin").execute(&mut *conn).await.unwrap();
}

async fn commit(conn: &mut PgConnection) {
    sqlx::query("commit").execute(&mut *conn).await.unwrap();
}

/// Makes every started task of the flow look like it started an hour ago (past its recovery boundary).
async fn age_started_tasks(pool: &PgPool, flow: &str) {
    exec(
        pool,
        &format!(
            "update pgflow.step_tasks set queued_at = least(queued_at, now() - interval '2 hours'),
                    started_at = now() - interval '1 hour'
              where flow_slug = '{flow}' and status = 'started'"
        ),
    )
    .await;
}

async fn requeue_stalled(pool: &PgPool) -> i32 {
    sqlx::query_scalar("select pgflow.requeue_stalled_tasks()")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A run of a one-step flow (5 attempts) whose task stalled four times: requeued three times, then marked
/// permanently stalled with its message archived, still `started` by the test worker in attempt 4.
async fn permanently_stalled_with_attempts_left(pool: &PgPool, flow: &str) -> Uuid {
    exec(
        pool,
        &format!(
            "select pgflow.create_flow('{flow}', max_attempts => 5, timeout => 1);
             select pgflow.add_step('{flow}', 'a');"
        ),
    )
    .await;
    let run = start(pool, flow, json!({})).await;
    for round in 0..3 {
        assert_eq!(claim(pool, flow, flow, 1).await.len(), 1, "round {round}");
        age_started_tasks(pool, flow).await;
        assert_eq!(requeue_stalled(pool).await, 1, "round {round}");
    }
    assert_eq!(claim(pool, flow, flow, 1).await.len(), 1);
    age_started_tasks(pool, flow).await;
    assert_eq!(requeue_stalled(pool).await, 0, "the fourth stall is final");
    let (status, stalled, attempts): (String, bool, i32) = sqlx::query_as(
        "select status, permanently_stalled_at is not null, attempts_count from pgflow.step_tasks
          where run_id = $1",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((status.as_str(), stalled, attempts), ("started", true, 4));
    assert_eq!(live_messages(pool, flow).await, 0);
    run
}

/// The task of a one-task run can be claimed again and its completion finishes the run.
async fn claimable_and_finishes(pool: &PgPool, flow: &str, run: Uuid) {
    assert_eq!(
        live_messages(pool, flow).await,
        1,
        "the queued task must have a live message"
    );
    make_visible(pool, flow).await;
    let tasks = claim(pool, flow, flow, 1).await;
    assert_eq!(tasks.len(), 1, "the queued task must be claimable");
    assert_eq!(tasks[0].run_id, run);
    assert_eq!(
        complete(pool, run, "a", 0, json!("done")).await,
        "completed"
    );
    assert_eq!(run_status(pool, run).await, "completed");
    assert_eq!(live_messages(pool, flow).await, 0);
}

#[tokio::test]
async fn a_late_failure_of_a_permanently_stalled_task_with_attempts_left_requeues_it_with_a_message(
) {
    let db = test_db().await;
    let pool = db.pool();
    let run = permanently_stalled_with_attempts_left(pool, "late4").await;

    // The hung worker finally reports a failure (the upstream four-argument form).
    assert_eq!(fail(pool, run, "a", 0, "late boom").await, "queued");
    assert_eq!(
        live_messages(pool, "late4").await,
        1,
        "the queued task must have a live message"
    );
    let stalled: bool = sqlx::query_scalar(
        "select permanently_stalled_at is not null from pgflow.step_tasks where run_id = $1",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(!stalled, "a queued task is no longer permanently stalled");
    claimable_and_finishes(pool, "late4", run).await;
}

#[tokio::test]
async fn a_late_fenced_failure_of_a_permanently_stalled_task_with_attempts_left_requeues_it_with_a_message(
) {
    let db = test_db().await;
    let pool = db.pool();
    let run = permanently_stalled_with_attempts_left(pool, "late8").await;

    let (outcome, status): (String, String) = sqlx::query_as(
        "select outcome, status from pgflow.fail_task(run_id => $1, step_slug => 'a', task_index => 0,
           error_message => 'late boom', attempt => 4, worker_id => $2)",
    )
    .bind(run)
    .bind(WORKER)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((outcome.as_str(), status.as_str()), ("applied", "queued"));
    claimable_and_finishes(pool, "late8", run).await;
}

#[tokio::test]
async fn a_started_task_whose_message_was_purged_is_requeued_with_a_fresh_message() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('purged', timeout => 1); select pgflow.add_step('purged', 'a');",
    )
    .await;
    let run = start(pool, "purged", json!({})).await;
    let old = claim(pool, "purged", "purged", 1).await.remove(0).msg_id;
    exec(pool, "select pgmq.purge_queue('purged')").await;
    assert_eq!(live_messages(pool, "purged").await, 0);

    // Not yet past its recovery boundary: left alone.
    assert_eq!(requeue_stalled(pool).await, 0);
    age_started_tasks(pool, "purged").await;
    assert_eq!(requeue_stalled(pool).await, 1);
    let (status, requeued, msg): (String, i32, i64) = sqlx::query_as(
        "select status, requeued_count, message_id from pgflow.step_tasks where run_id = $1",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((status.as_str(), requeued), ("queued", 1));
    assert_ne!(msg, old, "a fresh message replaces the purged one");
    claimable_and_finishes(pool, "purged", run).await;
}

#[tokio::test]
async fn a_started_task_whose_message_is_gone_after_three_requeues_is_marked_permanently_stalled() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('gone', timeout => 1); select pgflow.add_step('gone', 'a');",
    )
    .await;
    let run = start(pool, "gone", json!({})).await;
    for round in 0..3 {
        assert_eq!(
            claim(pool, "gone", "gone", 1).await.len(),
            1,
            "round {round}"
        );
        exec(pool, "select pgmq.purge_queue('gone')").await;
        age_started_tasks(pool, "gone").await;
        assert_eq!(requeue_stalled(pool).await, 1, "round {round}");
    }
    assert_eq!(claim(pool, "gone", "gone", 1).await.len(), 1);
    exec(pool, "select pgmq.purge_queue('gone')").await;
    age_started_tasks(pool, "gone").await;
    assert_eq!(requeue_stalled(pool).await, 0);
    let (status, stalled): (String, bool) = sqlx::query_as(
        "select status, permanently_stalled_at is not null from pgflow.step_tasks where run_id = $1",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((status.as_str(), stalled), ("started", true));
    // The operator's retry still works.
    exec(
        pool,
        &format!("select pgflow.resolve_stalled_task('{run}', 'a', 0, 'retry')"),
    )
    .await;
    claimable_and_finishes(pool, "gone", run).await;
}

#[tokio::test]
async fn maintenance_and_a_late_completion_in_the_same_run_do_not_deadlock() {
    let db = test_db().await;
    let pool = db.pool();
    // Two root steps with one attempt each: "a" stalls under a live worker, "b" belongs to a dead worker.
    let mut flow = roots(&["a", "b"]);
    flow["options"]["maxAttempts"] = json!(1);
    compile(pool, "mt", &flow, "flow").await;
    let live = Uuid::new_v4();
    let dead = Uuid::new_v4();
    register(pool, live, "mt-live", "mt", "mt", None).await;
    register(pool, dead, "mt-dead", "mt", "mt", None).await;
    let run = start(pool, "mt", json!({})).await;
    let ma = task_msg(pool, run, "a").await;
    let mb = task_msg(pool, run, "b").await;
    assert_eq!(
        claim_tasks(pool, "mt", "mt", None, &[ma], live).await["tasks"][0]["attempts_count"],
        1
    );
    assert_eq!(
        claim_tasks(pool, "mt", "mt", None, &[mb], dead).await["tasks"][0]["attempts_count"],
        1
    );
    exec(
        pool,
        &format!(
            "update pgflow.step_tasks set queued_at = now() - interval '2 hours',
                    started_at = now() - interval '1 hour'
              where run_id = '{run}' and step_slug = 'a';
             update pgflow.workers set last_heartbeat_at = now() - interval '1 hour' where worker_id = '{dead}';"
        ),
    )
    .await;

    // Session L holds the dead worker's row, so that maintenance stops right after its stalled-task pass.
    let mut l = connect(&db).await;
    begin(&mut l).await;
    sqlx::query("select 1 from pgflow.workers where worker_id = $1 for update")
        .bind(dead)
        .execute(&mut l)
        .await
        .unwrap();

    // Session M: maintenance.
    let m_pool = pool.clone();
    let m = tokio::spawn(async move {
        sqlx::query_scalar::<_, Value>(
            "select pgflow.run_maintenance(dead_after => interval '10 seconds') /* session M */",
        )
        .fetch_one(&m_pool)
        .await
    });
    wait_for_lock_wait(pool, "session M").await;

    // Session C: the live worker's late completion of "a" takes the run row and waits for its message.
    let c_pool = pool.clone();
    let c = tokio::spawn(async move {
        sqlx::query_scalar::<_, String>(
            "select outcome from pgflow.complete_task($1, 'a', 0, '\"late\"'::jsonb, 1, $2) /* session C */",
        )
        .bind(run)
        .bind(live)
        .fetch_one(&c_pool)
        .await
    });
    // C waits either for the message maintenance holds, or (once fixed, when maintenance takes the message
    // later) for nothing at all.
    wait_until(
        Duration::from_secs(10),
        "the completion to wait or finish",
        || async {
            c.is_finished()
                || sqlx::query_scalar::<_, bool>(
                    "select exists (select 1 from pg_stat_activity where datname = current_database()
                       and wait_event_type = 'Lock' and query like '%session C%')",
                )
                .fetch_one(pool)
                .await
                .unwrap()
        },
    )
    .await;
    commit(&mut l).await;

    let m = tokio::time::timeout(Duration::from_secs(20), m)
        .await
        .expect("maintenance must finish")
        .unwrap();
    let c = tokio::time::timeout(Duration::from_secs(20), c)
        .await
        .expect("the completion must finish")
        .unwrap();
    let m = m.expect("maintenance must not fail (no deadlock)");
    c.expect("the completion must not fail (no deadlock)");
    assert_eq!(m["skipped"], false, "{m}");

    // Nothing is stranded: another sweep finishes whatever the first one left, and the run is decided.
    exec(
        pool,
        "select pgflow.run_maintenance(dead_after => interval '10 seconds')",
    )
    .await;
    let (b_status, _) = task_state(pool, run, "b", 0).await;
    assert_eq!(
        b_status, "failed",
        "the dead worker's last attempt is failed"
    );
    assert_eq!(run_status(pool, run).await, "failed");
    assert_eq!(live_messages(pool, "mt").await, 0);
}

/// A plain flow "fx": a map "each" with one attempt, so one failure exhausts it and fails the run.
async fn one_attempt_map(pool: &PgPool) -> Uuid {
    let mut flow = shape(vec![json!({
        "slug": "each", "stepType": "map", "dependencies": [],
        "whenUnmet": "skip", "whenExhausted": "fail",
        "requiredInputPattern": {"defined": false}, "forbiddenInputPattern": {"defined": false},
        "options": {"maxAttempts": 1}
    })]);
    flow["options"]["maxAttempts"] = json!(1);
    compile(pool, "fx", &flow, "flow").await;
    let worker = Uuid::new_v4();
    register(pool, worker, "fx-worker", "fx", "fx", None).await;
    worker
}

/// Session B claims `ids` by explicit ids in its open transaction, as the flow's plain worker.
async fn claim_in(
    pool: &PgPool,
    b: &mut PgConnection,
    flow: &str,
    ids: &[i64],
    worker: Uuid,
) -> Value {
    let (flows, steps) = pairs(pool, flow, None).await;
    claim_json(
        tokio::time::timeout(
            Duration::from_secs(20),
            sqlx::query(
                "select * from pgflow.claim_tasks(queue_name => $1, msg_ids => $2, worker_id => $3,
                   flow_slugs => $4, step_slugs => $5) /* session B */",
            )
            .bind(flow)
            .bind(ids)
            .bind(worker)
            .bind(&flows)
            .bind(&steps)
            .fetch_all(&mut *b),
        )
        .await
        .expect("the claim must finish")
        .expect("the claim must not fail (no deadlock)"),
    )
}

#[tokio::test]
async fn a_final_failure_and_a_claim_by_explicit_ids_of_a_lower_sibling_do_not_deadlock() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = one_attempt_map(pool).await;
    let run = start(pool, "fx", json!([1, 2, 3])).await;
    let msgs: Vec<i64> = sqlx::query_scalar(
        "select message_id from pgflow.step_tasks where run_id = $1 order by task_index",
    )
    .bind(run)
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(msgs[0] < msgs[2]);
    // Element 2 (the highest message) is running.
    let claimed = claim_tasks(pool, "fx", "fx", None, &[msgs[2]], worker).await;
    assert_eq!(claimed["tasks"][0]["task_index"], 2);

    // Session B reads element 0's message (the lowest) in an open transaction.
    let mut b = connect(&db).await;
    begin(&mut b).await;
    let read: Vec<i64> = sqlx::query_scalar("select msg_id from pgmq.read('fx', 30, 1)")
        .fetch_all(&mut b)
        .await
        .unwrap();
    assert_eq!(read, [msgs[0]]);

    // Session A: element 2 fails for good, which fails the run and cancels its siblings; it waits for B.
    let a_pool = pool.clone();
    let a = tokio::spawn(async move {
        sqlx::query_scalar::<_, String>(
            "select status from pgflow.fail_task($1, 'each', 2, 'boom') /* session A */",
        )
        .bind(run)
        .fetch_one(&a_pool)
        .await
    });
    wait_for_lock_wait(pool, "session A").await;

    // Session B claims what it read together with element 2's message (a duplicate delivery).
    let result = claim_in(pool, &mut b, "fx", &[msgs[0], msgs[2]], worker).await;
    assert_eq!(result["outcome"], "claimed", "{result}");
    commit(&mut b).await;
    let status = tokio::time::timeout(Duration::from_secs(20), a)
        .await
        .expect("the failure must finish")
        .unwrap()
        .expect("the failure must not fail (no deadlock)");
    assert_eq!(status, "failed");
    assert_eq!(run_status(pool, run).await, "failed");
    assert_eq!(
        task_statuses(pool, run, "each").await,
        ["cancelled", "cancelled", "failed"]
    );
    assert_eq!(live_messages(pool, "fx").await, 0);
}

#[tokio::test]
async fn a_completion_that_fails_its_run_and_a_claim_by_explicit_ids_of_a_lower_sibling_do_not_deadlock(
) {
    let db = test_db().await;
    let pool = db.pool();
    // Two roots "x" and "y", each feeding a map: a non-array output of either fails the run. The one with
    // the higher message fails; the other is the lower sibling that session B claims.
    let map_of = |slug: &str, dep: &str| {
        json!({
            "slug": slug, "stepType": "map", "dependencies": [dep],
            "whenUnmet": "skip", "whenExhausted": "fail",
            "requiredInputPattern": {"defined": false}, "forbiddenInputPattern": {"defined": false}
        })
    };
    let flow = shape(vec![
        step("x", &[]),
        step("y", &[]),
        map_of("mx", "x"),
        map_of("my", "y"),
    ]);
    compile(pool, "tv", &flow, "flow").await;
    let worker = Uuid::new_v4();
    register(pool, worker, "tv-worker", "tv", "tv", None).await;
    let run = start(pool, "tv", json!({})).await;
    let (mx, my) = (
        task_msg(pool, run, "x").await,
        task_msg(pool, run, "y").await,
    );
    let (failing, ma, mb) = if mx > my {
        ("x", mx, my)
    } else {
        ("y", my, mx)
    };
    let claimed = claim_tasks(pool, "tv", "tv", None, &[ma], worker).await;
    assert_eq!(claimed["tasks"][0]["step_slug"], failing);

    let mut b = connect(&db).await;
    begin(&mut b).await;
    let read: Vec<i64> = sqlx::query_scalar("select msg_id from pgmq.read('tv', 30, 1)")
        .fetch_all(&mut b)
        .await
        .unwrap();
    assert_eq!(read, [mb]);

    // Session A: the failing root completes with an object where its map needs an array: the run fails.
    let a_pool = pool.clone();
    let a = tokio::spawn(async move {
        sqlx::query_scalar::<_, String>(
            "select status from pgflow.complete_task($1, $2, 0, '{\"not\": \"an array\"}'::jsonb) /* session A */",
        )
        .bind(run)
        .bind(failing)
        .fetch_one(&a_pool)
        .await
    });
    wait_for_lock_wait(pool, "session A").await;

    let result = claim_in(pool, &mut b, "tv", &[mb, ma], worker).await;
    assert_eq!(result["outcome"], "claimed", "{result}");
    commit(&mut b).await;
    let status = tokio::time::timeout(Duration::from_secs(20), a)
        .await
        .expect("the completion must finish")
        .unwrap()
        .expect("the completion must not fail (no deadlock)");
    assert_eq!(status, "failed");
    assert_eq!(run_status(pool, run).await, "failed");
    assert_eq!(live_messages(pool, "tv").await, 0);
}

#[tokio::test]
async fn retention_deletes_the_watcher_rows_of_pruned_runs_while_the_watching_session_lives() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('watched'); select pgflow.add_step('watched', 'a');",
    )
    .await;
    let run = start(pool, "watched", json!({})).await;
    let mut watcher = connect(&db).await;
    sqlx::query("select pgflow.watch_run($1)")
        .bind(run)
        .execute(&mut watcher)
        .await
        .unwrap();
    claim(pool, "watched", "watched", 1).await;
    complete(pool, run, "a", 0, json!(1)).await;
    exec(
        pool,
        &format!(
            "update pgflow.runs set started_at = now() - interval '3 days', completed_at = now() - interval '2 days'
              where run_id = '{run}'"
        ),
    )
    .await;

    let result: Value = sqlx::query_scalar(
        "select pgflow.run_maintenance(retain_for => interval '1 day', prune_batch => 10)",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(result["pruned"]["runs"], 1, "{result}");
    let watchers: i64 =
        sqlx::query_scalar("select count(*) from pgflow.run_watchers where run_id = $1")
            .bind(run)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(
        watchers, 0,
        "the pruned run's watcher row must go with the run"
    );
    // The watching session is still there.
    sqlx::query("select 1").execute(&mut watcher).await.unwrap();
}
