//! Durable schedules: bad input, exactly one run per (schedule, fire time) with concurrent firers, the
//! missed-fire and overlap policies, pause, resume and delete. Fire times are computed by the runtime's
//! `schedules::fire_due` at a fixed `now`, so nothing here depends on the clock.

use chrono::{DateTime, TimeZone, Utc};
use pgflow_runtime::schedules::{self, Missed, Schedule, ScheduleError};
use pgflow_sql::SqlState;
use pgflow_tests::test_db;
use sqlx::PgPool;

use crate::support::*;

fn at(h: u32, m: u32, s: u32) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2030, 1, 1, h, m, s).unwrap()
}

async fn flow(pool: &PgPool) {
    exec(
        pool,
        "select pgflow.create_flow('nightly'); select pgflow.add_step('nightly', 'a');",
    )
    .await;
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

async fn runs(pool: &PgPool) -> i64 {
    count(
        pool,
        "select count(*) from pgflow.runs where flow_slug = 'nightly'",
    )
    .await
}

/// Stores `name` on `cron` with its next fire at `next`.
async fn set(
    pool: &PgPool,
    name: &str,
    cron: &str,
    missed: &str,
    catch_up: i32,
    overlap: &str,
    next: DateTime<Utc>,
) {
    sqlx::query(
        "select 1 from pgflow.set_schedule($1, 'nightly', $2, 'UTC', '{\"n\": 1}', $3, $4, $5, $6)",
    )
    .bind(name)
    .bind(cron)
    .bind(missed)
    .bind(catch_up)
    .bind(overlap)
    .bind(next)
    .execute(pool)
    .await
    .unwrap();
}

async fn next_fire(pool: &PgPool, name: &str) -> Option<DateTime<Utc>> {
    sqlx::query_scalar("select next_fire_at from pgflow.schedules where schedule_name = $1")
        .bind(name)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn bad_schedules_get_a_clear_error_and_create_nothing() {
    let db = test_db().await;
    let pool = db.pool();
    flow(pool).await;

    for (sql, code, quoted) in [
        (
            "select pgflow.set_schedule('s', 'nightly', 'every day at noon')",
            SqlState::InvalidParameterValue,
            "invalid cron expression \"every day at noon\"",
        ),
        (
            "select pgflow.set_schedule('s', 'nightly', '0 3 * * *', 'Mars/Olympus')",
            SqlState::InvalidParameterValue,
            "unknown time zone \"Mars/Olympus\"",
        ),
        (
            "select pgflow.set_schedule('s', 'nightly', '0 3 * * *', catch_up_max => 0, missed => 'catch_up')",
            SqlState::InvalidParameterValue,
            "catch_up_max of schedule \"s\" must be 1 to 1000, got 0",
        ),
        (
            "select pgflow.set_schedule('s', 'nightly', '0 3 * * *', missed => 'sometimes')",
            SqlState::InvalidParameterValue,
            "missed-fire policy \"sometimes\"",
        ),
        (
            "select pgflow.set_schedule('s', 'nightly', '0 3 * * *', overlap => 'maybe')",
            SqlState::InvalidParameterValue,
            "overlap policy \"maybe\"",
        ),
        (
            "select pgflow.set_schedule('s', 'noSuchFlow', '0 3 * * *')",
            SqlState::UndefinedObject,
            "flow or alias \"noSuchFlow\", which is not compiled",
        ),
        (
            "select pgflow.set_schedule('bad name!', 'nightly', '0 3 * * *')",
            SqlState::InvalidParameterValue,
            "invalid schedule name \"bad name!\"",
        ),
    ] {
        let err = sqlx::query(sql).execute(pool).await.unwrap_err();
        let db_err = err.as_database_error().expect("a database error");
        assert_eq!(SqlState::of(&err), Some(code), "{sql}: {db_err}");
        assert!(db_err.message().contains(quoted), "{sql}: {}", db_err.message());
    }
    assert_eq!(
        count(pool, "select count(*) from pgflow.schedules").await,
        0
    );

    // The Rust API refuses what the cron parser refuses, quoting it, before the database is touched.
    let bad = Schedule::new("s", "nightly", "61 * * * *");
    let err = bad.set(pool).await.unwrap_err();
    assert!(matches!(err, ScheduleError::InvalidCron { .. }), "{err}");
    assert!(err.to_string().contains("\"61 * * * *\""), "{err}");
    let err = Schedule::new("s", "nightly", "0 3 * * *")
        .missed(Missed::CatchUp(0))
        .validate()
        .unwrap_err();
    assert!(
        matches!(err, ScheduleError::InvalidCatchUp { given: 0, .. }),
        "{err}"
    );
    let err = Schedule::new("s", "nightly", "0 3 * * *")
        .time_zone("Nowhere/Special")
        .set(pool)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("\"Nowhere/Special\""), "{err}");
    let err = Schedule::new("s", "noSuchFlow", "0 3 * * *")
        .set(pool)
        .await
        .unwrap_err();
    assert!(matches!(err, ScheduleError::Database { .. }), "{err}");
    assert!(err.to_string().contains("noSuchFlow"), "{err}");
    assert_eq!(
        count(pool, "select count(*) from pgflow.schedules").await,
        0
    );
}

#[tokio::test]
async fn a_schedule_set_in_rust_is_stored_with_its_next_fire_and_stays_put_when_declared_again() {
    let db = test_db().await;
    let pool = db.pool();
    flow(pool).await;
    exec(pool, "select pgflow.activate_alias('reports', 'nightly')").await;

    let s = Schedule::new("by-alias", "reports", "0 3 * * *").time_zone("Europe/Paris");
    s.set(pool).await.unwrap();
    let first = next_fire(pool, "by-alias").await.expect("a next fire time");
    assert_eq!(Some(first), s.next_fire_after(Utc::now()).unwrap());
    // 03:00 in Paris is 01:00 or 02:00 UTC, depending on daylight saving.
    assert!(
        matches!(
            first.format("%H:%M").to_string().as_str(),
            "01:00" | "02:00"
        ),
        "{first}"
    );

    exec(
        pool,
        "update pgflow.schedules set next_fire_at = '2030-01-01 02:00+00'",
    )
    .await;
    s.clone()
        .input(serde_json::json!({"x": 1}))
        .set(pool)
        .await
        .unwrap();
    assert_eq!(
        next_fire(pool, "by-alias").await,
        Some(at(2, 0, 0)),
        "same cron, same next fire"
    );

    // A fire through the alias starts a run of the flow it points at.
    let fired = schedules::fire_due(pool, at(2, 0, 1)).await.unwrap();
    assert_eq!(fired.len(), 1);
    assert_eq!(runs(pool).await, 1);
    let input: serde_json::Value = sqlx::query_scalar("select input from pgflow.runs")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(input, serde_json::json!({"x": 1}));
}

#[tokio::test]
async fn concurrent_firers_start_exactly_one_run_per_fire_time() {
    let db = test_db().await;
    let pool = db.pool();
    flow(pool).await;
    set(
        pool,
        "every-minute",
        "* * * * *",
        "skip",
        1,
        "allow",
        at(0, 1, 0),
    )
    .await;

    // Eight callers fire the same due schedule at once, three minutes in a row.
    for minute in 1..=3 {
        let now = at(0, minute, 5);
        let calls = (0..8).map(|_| schedules::fire_due(pool, now));
        let fired: usize = futures::future::join_all(calls)
            .await
            .into_iter()
            .map(|r| r.unwrap().len())
            .sum();
        assert_eq!(fired, 1, "minute {minute}");
    }
    assert_eq!(runs(pool).await, 3);
    assert_eq!(
        count(
            pool,
            "select count(distinct fire_at) from pgflow.schedule_fires where outcome = 'started'"
        )
        .await,
        3
    );
    assert_eq!(next_fire(pool, "every-minute").await, Some(at(0, 4, 0)));

    // A fire time already recorded never starts a second run, even when asked for again explicitly.
    let again: Vec<(DateTime<Utc>,)> = sqlx::query_as(
        "select fire_at from pgflow.fire_schedule('every-minute', $1, array[$2::timestamptz], $3)",
    )
    .bind(at(0, 4, 0))
    .bind(at(0, 3, 0))
    .bind(at(0, 5, 0))
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(again.is_empty(), "{again:?}");
    assert_eq!(runs(pool).await, 3);

    // A caller whose view is stale (the next fire moved on) does nothing.
    let stale: Vec<(DateTime<Utc>,)> = sqlx::query_as(
        "select fire_at from pgflow.fire_schedule('every-minute', $1, array[$1::timestamptz], $2)",
    )
    .bind(at(0, 3, 0))
    .bind(at(0, 6, 0))
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(stale.is_empty());
    assert_eq!(next_fire(pool, "every-minute").await, Some(at(0, 5, 0)));
}

#[tokio::test]
async fn a_restart_after_downtime_follows_the_missed_fire_policy() {
    let db = test_db().await;
    let pool = db.pool();
    flow(pool).await;
    // Hourly; the last fire before the downtime was due at 00:00, the workers come back at 05:30.
    set(
        pool,
        "skipper",
        "0 * * * *",
        "skip",
        1,
        "allow",
        at(0, 0, 0),
    )
    .await;
    set(
        pool,
        "catcher",
        "0 * * * *",
        "catch_up",
        3,
        "allow",
        at(0, 0, 0),
    )
    .await;

    let fired = schedules::fire_due(pool, at(5, 30, 0)).await.unwrap();
    let mut catcher: Vec<_> = fired
        .iter()
        .filter(|f| f.schedule == "catcher")
        .map(|f| f.fire_at)
        .collect();
    catcher.sort();
    assert_eq!(
        catcher,
        vec![at(3, 0, 0), at(4, 0, 0), at(5, 0, 0)],
        "the 3 most recent"
    );
    assert!(!fired.iter().any(|f| f.schedule == "skipper"), "{fired:?}");
    assert_eq!(runs(pool).await, 3);
    assert_eq!(next_fire(pool, "skipper").await, Some(at(6, 0, 0)));
    assert_eq!(next_fire(pool, "catcher").await, Some(at(6, 0, 0)));

    // A fire within the grace is not missed: skip still starts it.
    let fired = schedules::fire_due(pool, at(6, 0, 30)).await.unwrap();
    assert_eq!(fired.len(), 2, "{fired:?}");
    assert_eq!(runs(pool).await, 5);
}

#[tokio::test]
async fn overlap_skip_records_a_skipped_fire_while_the_previous_run_is_running() {
    let db = test_db().await;
    let pool = db.pool();
    flow(pool).await;
    set(
        pool,
        "no-overlap",
        "* * * * *",
        "skip",
        1,
        "skip",
        at(0, 1, 0),
    )
    .await;
    set(
        pool,
        "overlap",
        "* * * * *",
        "skip",
        1,
        "allow",
        at(0, 1, 0),
    )
    .await;

    schedules::fire_due(pool, at(0, 1, 1)).await.unwrap();
    // No worker runs: both first runs are still started.
    let second = schedules::fire_due(pool, at(0, 2, 1)).await.unwrap();
    let skipped: Vec<_> = second.iter().filter(|f| f.run_id.is_none()).collect();
    assert_eq!(skipped.len(), 1, "{second:?}");
    assert_eq!(skipped[0].schedule, "no-overlap");
    assert_eq!(
        count(
            pool,
            "select count(*) from pgflow.schedule_fires where outcome = 'skipped_overlap'"
        )
        .await,
        1
    );
    assert_eq!(runs(pool).await, 3);

    // Once the previous run is over, the next fire starts one again.
    exec(pool, "update pgflow.runs set status = 'completed', completed_at = now() where status = 'started'").await;
    let third = schedules::fire_due(pool, at(0, 3, 1)).await.unwrap();
    assert!(third.iter().all(|f| f.run_id.is_some()), "{third:?}");
    assert_eq!(runs(pool).await, 5);
}

#[tokio::test]
async fn paused_schedules_do_not_fire_and_resume_from_the_next_fire_after_resuming() {
    let db = test_db().await;
    let pool = db.pool();
    flow(pool).await;
    set(
        pool,
        "p",
        "*/5 * * * *",
        "catch_up",
        10,
        "allow",
        at(0, 5, 0),
    )
    .await;

    exec(pool, "select pgflow.pause_schedule('p')").await;
    assert!(schedules::fire_due(pool, at(1, 0, 0))
        .await
        .unwrap()
        .is_empty());
    assert_eq!(runs(pool).await, 0);

    exec(pool, "select pgflow.resume_schedule('p')").await;
    assert_eq!(
        next_fire(pool, "p").await,
        None,
        "computed afresh by the next tick"
    );
    // The first tick after resuming computes the next fire and starts nothing: no catch-up of the pause.
    assert!(schedules::fire_due(pool, at(1, 1, 0))
        .await
        .unwrap()
        .is_empty());
    assert_eq!(next_fire(pool, "p").await, Some(at(1, 5, 0)));
    assert_eq!(
        schedules::fire_due(pool, at(1, 5, 0)).await.unwrap().len(),
        1
    );

    let err = sqlx::query("select pgflow.pause_schedule('nope')")
        .execute(pool)
        .await
        .unwrap_err();
    assert_eq!(SqlState::of(&err), Some(SqlState::UndefinedObject));
    assert!(err.to_string().contains("no schedule \"nope\""), "{err}");

    assert!(schedules::delete(pool, "p").await.unwrap());
    assert!(!schedules::delete(pool, "p").await.unwrap());
    assert_eq!(
        count(pool, "select count(*) from pgflow.schedule_fires").await,
        0
    );
    assert_eq!(runs(pool).await, 1, "deleting a schedule keeps its runs");
}

#[tokio::test]
async fn a_stored_expression_the_parser_refuses_pauses_the_schedule_with_the_reason() {
    let db = test_db().await;
    let pool = db.pool();
    flow(pool).await;
    // Passes the SQL shape check, not the parser (minute 99).
    exec(
        pool,
        "select pgflow.set_schedule('odd', 'nightly', '99 * * * *')",
    )
    .await;
    assert!(schedules::fire_due(pool, Utc::now())
        .await
        .unwrap()
        .is_empty());
    let (paused, error): (bool, Option<String>) = sqlx::query_as(
        "select paused, last_error from pgflow.schedules where schedule_name = 'odd'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(paused);
    assert!(error.unwrap_or_default().contains("\"99 * * * *\""));
}
