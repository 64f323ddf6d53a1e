//! pgflow.queue_coverage: every persisted route with its queued and started work and its live workers.

use crate::step_support::*;
use crate::support::*;
use pgflow_tests::test_db;
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

#[derive(Debug, sqlx::FromRow)]
struct Coverage {
    flow_slug: String,
    step_slug: String,
    queue_mode: String,
    queue_name: String,
    queued_tasks: i64,
    started_tasks: i64,
    oldest_queued_age_secs: Option<f64>,
    live_workers: i64,
    uncovered: bool,
}

async fn coverage(pool: &PgPool) -> Vec<Coverage> {
    sqlx::query_as(
        "select flow_slug, step_slug, queue_mode, queue_name, queued_tasks, started_tasks,
                extract(epoch from oldest_queued_age)::float8 as oldest_queued_age_secs, live_workers, uncovered
         from pgflow.queue_coverage order by flow_slug, step_index",
    )
    .fetch_all(pool)
    .await
    .expect("queue_coverage")
}

#[tokio::test]
async fn a_step_without_a_live_worker_shows_its_waiting_work_as_uncovered() {
    let db = test_db().await;
    let pool = db.pool();
    let shape = shape(vec![step("classify", &[]), step("deliver", &["classify"])]);
    compile(pool, "comm", &shape, "step").await;
    compile(pool, "plain", &roots(&["only"]), "flow").await;
    let classify = Uuid::new_v4();
    register(
        pool,
        classify,
        "comm-classify",
        "comm__classify",
        "comm",
        Some("classify"),
    )
    .await;

    // Two runs: one classify task claimed and completed (its deliver task now waits), one still queued.
    let first = start(pool, "comm", json!({})).await;
    let msgs = read(pool, "comm__classify", 1).await;
    claim_tasks(
        pool,
        "comm__classify",
        "comm",
        Some("classify"),
        &msgs,
        classify,
    )
    .await;
    complete(pool, first, "classify", 0, json!({})).await;
    let second = start(pool, "comm", json!({})).await;
    let msgs = read(pool, "comm__classify", 1).await;
    claim_tasks(
        pool,
        "comm__classify",
        "comm",
        Some("classify"),
        &msgs,
        classify,
    )
    .await;
    start(pool, "comm", json!({})).await;
    exec(
        pool,
        "update pgflow.step_tasks set queued_at = queued_at - interval '5 minutes' where step_slug = 'deliver'",
    )
    .await;

    let rows = coverage(pool).await;
    assert_eq!(rows.len(), 3, "{rows:?}");
    let (c, d, p) = (&rows[0], &rows[1], &rows[2]);
    assert_eq!(
        (
            c.flow_slug.as_str(),
            c.step_slug.as_str(),
            c.queue_mode.as_str(),
            c.queue_name.as_str()
        ),
        ("comm", "classify", "step", "comm__classify")
    );
    assert_eq!(
        (c.queued_tasks, c.started_tasks, c.live_workers, c.uncovered),
        (1, 1, 1, false)
    );
    assert_eq!(d.queue_name, "comm__deliver");
    assert_eq!(
        (d.queued_tasks, d.started_tasks, d.live_workers, d.uncovered),
        (1, 0, 0, true)
    );
    assert!(d.oldest_queued_age_secs.unwrap() >= 300.0);
    assert_eq!(
        (
            p.queue_mode.as_str(),
            p.queue_name.as_str(),
            p.queued_tasks,
            p.uncovered
        ),
        ("flow", "plain", 0, false)
    );
    assert_eq!(
        task_state(pool, second, "classify", 0).await,
        ("started".into(), 1)
    );

    // The deliver worker arrives: covered.
    let deliver = Uuid::new_v4();
    register(
        pool,
        deliver,
        "comm-deliver",
        "comm__deliver",
        "comm",
        Some("deliver"),
    )
    .await;
    let rows = coverage(pool).await;
    assert_eq!((rows[1].live_workers, rows[1].uncovered), (1, false));

    // A silent worker, a stopped one, and one of a fenced function do not count.
    exec(
        pool,
        &format!("update pgflow.workers set last_heartbeat_at = now() - interval '31 seconds' where worker_id = '{deliver}'"),
    )
    .await;
    assert!(coverage(pool).await[1].uncovered);
    sqlx::query("select pgflow.worker_heartbeat($1)")
        .bind(deliver)
        .execute(pool)
        .await
        .unwrap();
    assert!(!coverage(pool).await[1].uncovered);
    exec(
        pool,
        "select pgflow.disable_worker_function('comm-deliver', 'replacing the deployment')",
    )
    .await;
    assert!(coverage(pool).await[1].uncovered);
    exec(pool, "select pgflow.enable_worker_function('comm-deliver')").await;
    sqlx::query("select pgflow.mark_worker_stopped($1)")
        .bind(deliver)
        .execute(pool)
        .await
        .unwrap();
    assert!(coverage(pool).await[1].uncovered);
}

#[tokio::test]
async fn a_plain_flow_worker_covers_every_step_of_its_flow() {
    let db = test_db().await;
    let pool = db.pool();
    compile(pool, "plain", &roots(&["a", "b"]), "flow").await;
    start(pool, "plain", json!({})).await;
    let rows = coverage(pool).await;
    assert!(rows.iter().all(|r| r.uncovered && r.queued_tasks == 1));
    register(pool, Uuid::new_v4(), "plain-fn", "plain", "plain", None).await;
    let rows = coverage(pool).await;
    assert!(rows.iter().all(|r| !r.uncovered && r.live_workers == 1));
}
