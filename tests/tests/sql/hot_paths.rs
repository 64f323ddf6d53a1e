//! Hot paths stay O(batch): claiming and completing do not scan the history of finished work.

use crate::support::*;
use pgflow_tests::test_db;
use serde_json::{json, Value};
use sqlx::Row;

/// Relations read by a sequential scan anywhere in an `EXPLAIN (FORMAT JSON)` plan.
fn seq_scanned(plan: &Value, out: &mut Vec<String>) {
    match plan {
        Value::Object(map) => {
            if map.get("Node Type") == Some(&json!("Seq Scan")) {
                out.push(
                    map.get("Relation Name")
                        .and_then(Value::as_str)
                        .unwrap_or("?")
                        .to_string(),
                );
            }
            map.values().for_each(|v| seq_scanned(v, out));
        }
        Value::Array(items) => items.iter().for_each(|v| seq_scanned(v, out)),
        _ => {}
    }
}

async fn seq_scans(pool: &sqlx::PgPool) -> Vec<(String, i64)> {
    sqlx::query_as(
        "select relname::text, seq_scan from pg_stat_user_tables
          where schemaname = 'pgflow' and relname in ('runs', 'step_states', 'step_tasks') order by relname",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn flush_stats(conn: &mut sqlx::PgConnection) {
    sqlx::query("select pg_stat_force_next_flush()")
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query("select 1").execute(&mut *conn).await.unwrap();
}

/// The completions of claimed tasks of the diamond's root step `a`, each with output `{"n": 1}`.
fn finished_a(
    claimed: &[sqlx::postgres::PgRow],
) -> Vec<(uuid::Uuid, &'static str, i32, i32, Value)> {
    claimed
        .iter()
        .map(|r| {
            (
                r.get("run_id"),
                "a",
                0,
                r.get("attempts_count"),
                json!({"n": 1}),
            )
        })
        .collect()
}

/// Rows inserted into and updated in `pgflow.step_states` so far (call `flush_stats` first).
async fn step_state_writes(pool: &sqlx::PgPool) -> (i64, i64) {
    sqlx::query_as(
        "select n_tup_ins, n_tup_upd from pg_stat_user_tables where relid = 'pgflow.step_states'::regclass",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn claim_and_complete_use_indexes_after_100k_finished_tasks() {
    let db = test_db().await;
    let pool = db.pool();
    exec(
        pool,
        "select pgflow.create_flow('hot');
         select pgflow.add_step('hot', 'a');
         select pgflow.add_step('hot', 'b', array['a']);
         insert into pgflow.runs (run_id, flow_slug, status, input, remaining_steps, started_at, completed_at)
           select md5('r' || i)::uuid, 'hot', 'completed', '{}', 0, now() - interval '1 day', now() - interval '1 day'
           from generate_series(1, 100000) i;
         insert into pgflow.step_states (flow_slug, run_id, step_slug, status, initial_tasks, remaining_tasks, remaining_deps,
                                         created_at, started_at, completed_at)
           select 'hot', md5('r' || i)::uuid, 'a', 'completed', 1, 0, 0,
                  now() - interval '1 day', now() - interval '1 day', now() - interval '1 day'
           from generate_series(1, 100000) i;
         insert into pgflow.step_tasks (flow_slug, run_id, step_slug, task_index, message_id, queue_name, status,
                                        attempts_count, output, queued_at, started_at, completed_at)
           select 'hot', md5('r' || i)::uuid, 'a', 0, -i, 'hot', 'completed', 1, '1',
                  now() - interval '1 day', now() - interval '1 day', now() - interval '1 day'
           from generate_series(1, 100000) i;
         analyze pgflow.runs; analyze pgflow.step_states; analyze pgflow.step_tasks;",
    )
    .await;

    let run = start(pool, "hot", json!({})).await;
    register_worker(pool).await;
    let ids = read(pool, "hot", 10).await;

    // The claim statement of start_tasks, as the function runs it.
    let plan: Value = sqlx::query_scalar(
        "explain (format json)
         with candidates as (
           select t.run_id, t.step_slug, t.task_index from pgflow.step_tasks t
            where t.queue_name = 'hot' and t.message_id = any ($1) and t.flow_slug = 'hot' and t.status = 'queued'
            order by t.message_id
            for update
         )
         update pgflow.step_tasks t
            set status = 'started', attempts_count = t.attempts_count + 1, started_at = now(), last_worker_id = $2
           from candidates c, pgflow.runs r, pgflow.step_states ss
          where t.run_id = c.run_id and t.step_slug = c.step_slug and t.task_index = c.task_index
            and t.status = 'queued'
            and r.run_id = t.run_id and r.status = 'started'
            and ss.run_id = t.run_id and ss.step_slug = t.step_slug and ss.status = 'started'",
    )
    .bind(&ids)
    .bind(WORKER)
    .fetch_one(pool)
    .await
    .unwrap();
    let mut scanned = Vec::new();
    seq_scanned(&plan, &mut scanned);
    assert!(scanned.is_empty(), "claim plan scans {scanned:?}: {plan}");

    // The completion statements, as complete_task runs them.
    for sql in [
        "explain (format json) update pgflow.step_tasks t set status = 'completed', completed_at = now(), output = '1'
          where t.run_id = $1 and t.step_slug = 'a' and t.task_index = 0 and t.status = 'started'",
        "explain (format json) select jsonb_agg(t.output order by t.task_index) from pgflow.step_tasks t
          where t.run_id = $1 and t.step_slug = 'a'",
        "explain (format json) select t.run_id, t.step_slug, t.task_index from pgflow.step_tasks t
          where t.run_id = $1 and t.status in ('queued', 'started')
          order by t.queue_name, t.message_id for update",
        // requeue_stalled_tasks' search (the run id parameter is unused there).
        "explain (format json) select t.run_id from pgflow.step_tasks t
           join pgflow.runs r on r.run_id = t.run_id
           join pgflow.step_states ss on ss.run_id = t.run_id and ss.step_slug = t.step_slug
           join pgflow.steps s on s.flow_slug = t.flow_slug and s.step_slug = t.step_slug
           join pgflow.flows f on f.flow_slug = t.flow_slug
          where t.status = 'started' and t.permanently_stalled_at is null
            and r.status = 'started' and ss.status = 'started' and $1::uuid is not null
            and t.started_at < now() - make_interval(secs => coalesce(s.opt_timeout, f.opt_timeout) + 30)
          for update of t skip locked",
    ] {
        let plan: Value = sqlx::query_scalar(sql).bind(run).fetch_one(pool).await.unwrap();
        let mut scanned = Vec::new();
        seq_scanned(&plan, &mut scanned);
        scanned.retain(|relation| relation != "steps" && relation != "flows");
        assert!(scanned.is_empty(), "{sql} scans {scanned:?}");
    }

    // And the real functions: no sequential scan of runs, step_states or step_tasks while a run goes
    // through claim, complete, claim, complete.
    let mut conn = pool.acquire().await.unwrap();
    flush_stats(&mut conn).await;
    let before = seq_scans(pool).await;
    let claimed: Vec<(String,)> =
        sqlx::query_as("select step_slug from pgflow.start_tasks('hot', $1, $2)")
            .bind(&ids)
            .bind(WORKER)
            .fetch_all(&mut *conn)
            .await
            .unwrap();
    assert_eq!(claimed.len(), 1);
    sqlx::query("select pgflow.complete_task($1, 'a', 0, '{\"x\": 1}')")
        .bind(run)
        .execute(&mut *conn)
        .await
        .unwrap();
    let b_ids: Vec<i64> = sqlx::query_scalar("select msg_id from pgmq.read('hot', 30, 10)")
        .fetch_all(&mut *conn)
        .await
        .unwrap();
    sqlx::query("select * from pgflow.start_tasks('hot', $1, $2)")
        .bind(&b_ids)
        .bind(WORKER)
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query("select pgflow.complete_task($1, 'b', 0, '2')")
        .bind(run)
        .execute(&mut *conn)
        .await
        .unwrap();
    flush_stats(&mut conn).await;
    let after = seq_scans(pool).await;
    assert_eq!(before, after, "sequential scans during claim/complete");
    assert_eq!(run_status(pool, run).await, "completed");
}

/// Inserts `n` finished runs of the `dia` diamond (an hour old), with their step states and tasks, in one
/// transaction.
async fn insert_finished_diamond_runs(pool: &sqlx::PgPool, n: i32) {
    let mut conn = pool.acquire().await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    for sql in [
        "insert into pgflow.runs (run_id, flow_slug, status, input, remaining_steps, started_at, completed_at)
           select md5('r' || i)::uuid, 'dia', 'completed', '{}', 0, now() - interval '1 hour', now() - interval '1 hour'
           from generate_series(1, $1) i",
        "insert into pgflow.step_states (flow_slug, run_id, step_slug, status, initial_tasks, remaining_tasks, remaining_deps,
                                         created_at, started_at, completed_at)
           select 'dia', md5('r' || i)::uuid, s, 'completed', 1, 0, 0,
                  now() - interval '1 hour', now() - interval '1 hour', now() - interval '1 hour'
           from generate_series(1, $1) i, unnest(array['a', 'b', 'c', 'd']) s",
        "insert into pgflow.step_tasks (flow_slug, run_id, step_slug, task_index, message_id, queue_name, status,
                                        attempts_count, output, queued_at, started_at, completed_at)
           select 'dia', md5('r' || i)::uuid, s, 0, -(i * 4 + o), 'dia', 'completed', 1, '1',
                  now() - interval '1 hour', now() - interval '1 hour', now() - interval '1 hour'
           from generate_series(1, $1) i, unnest(array['a', 'b', 'c', 'd']) with ordinality as x(s, o)",
    ] {
        sqlx::query(sql).bind(n).execute(&mut *tx).await.unwrap();
    }
    tx.commit().await.unwrap();
    // The foreign-key checks of these inserts read about 36,000 index entries. An idle session may hold its
    // statistics for seconds: flush them now, or they land inside the caller's measurement.
    flush_stats(&mut conn).await;
}

/// Small tables too. A generic plan costs `run_id = any($1)` as ten keys, and on a table of a few hundred rows
/// one pass over the table looks cheaper than ten index probes; the hot-path functions turn sequential scans
/// off, so a diamond run driven through `start_flow` and `pgflow.exchange` on a small
/// installation reads runs, step states and tasks by index only.
#[tokio::test]
async fn a_diamond_through_exchange_probes_indexes_on_small_tables() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = crate::exchange::setup(pool).await;
    insert_finished_diamond_runs(pool, 300).await;
    exec(
        pool,
        "analyze pgflow.runs; analyze pgflow.step_states; analyze pgflow.step_tasks;",
    )
    .await;

    let mut conn = pool.acquire().await.unwrap();
    flush_stats(&mut conn).await;
    let before = seq_scans(pool).await;
    let (run, hops) = diamond_through_exchange(&mut conn, worker).await;
    flush_stats(&mut conn).await;
    let after = seq_scans(pool).await;
    assert_eq!(hops, 3, "a, then b and c together, then d");
    assert_eq!(run_status(pool, run).await, "completed");
    assert_eq!(before, after, "sequential scans while a diamond ran");
}

/// Index entries read from runs, step states and tasks so far (call `flush_stats` first).
async fn index_reads(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar(
        "select coalesce(sum(idx_tup_read), 0)::int8 from pg_stat_user_indexes
          where schemaname = 'pgflow' and relname in ('runs', 'step_states', 'step_tasks')",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A session keeps its generic plans, and the planner sizes a table by its pages at planning
/// time. A session that planned while the tables were empty took them for a few rows and, with sequential
/// scans off, looped over whole indexes once they had grown: one diamond run read over 100,000 index entries
/// (up to 320,000) after 3,000 runs had arrived. `pgflow.exchange` now replans a session once the tables have
/// more than doubled since it planned, and task creation finds runs by key whatever their statistics
///: the run reads about 150.
#[tokio::test]
async fn a_session_that_planned_on_empty_tables_replans_once_they_have_grown() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = crate::exchange::setup(pool).await;
    empty_tables_without_autovacuum(pool).await;

    // The session plans on the empty tables.
    let mut conn = pool.acquire().await.unwrap();
    let (run, hops) = diamond_through_exchange(&mut conn, worker).await;
    assert_eq!(
        (hops, run_status(pool, run).await.as_str()),
        (3, "completed")
    );

    // 3,000 finished runs arrive through other sessions.
    insert_finished_diamond_runs(pool, 3000).await;

    flush_stats(&mut conn).await;
    let before = index_reads(pool).await;
    let (run, hops) = diamond_through_exchange(&mut conn, worker).await;
    flush_stats(&mut conn).await;
    let read = index_reads(pool).await - before;
    assert_eq!(
        (hops, run_status(pool, run).await.as_str()),
        (3, "completed")
    );
    assert!(
        read < 1_000,
        "one diamond run on the session read {read} index entries of runs, step states and tasks"
    );
}

/// A fresh installation's table sizes (empty and vacuumed), and no autovacuum to analyse the tables while a
/// test runs (an analysis rebuilds every session's plans too).
async fn empty_tables_without_autovacuum(pool: &sqlx::PgPool) {
    exec(
        pool,
        "alter table pgflow.runs set (autovacuum_enabled = false);
         alter table pgflow.step_states set (autovacuum_enabled = false);
         alter table pgflow.step_tasks set (autovacuum_enabled = false);",
    )
    .await;
    exec(
        pool,
        "vacuum pgflow.runs, pgflow.step_states, pgflow.step_tasks",
    )
    .await;
}

/// Starts a run of the `dia` diamond on `conn` and drives it to its end the way upstream's worker does, on the
/// same connection: `pgmq.read`, `start_tasks`, then `complete_task` per task.
async fn diamond_upstream_style(conn: &mut sqlx::PgConnection) -> uuid::Uuid {
    let run: uuid::Uuid = sqlx::query_scalar("select (pgflow.start_flow('dia', '{}')).run_id")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    for _ in 0..3 {
        let ids: Vec<i64> = sqlx::query_scalar("select msg_id from pgmq.read('dia', 30, 10)")
            .fetch_all(&mut *conn)
            .await
            .unwrap();
        let tasks: Vec<(String, i32)> =
            sqlx::query_as("select step_slug, task_index from pgflow.start_tasks('dia', $1, $2)")
                .bind(&ids)
                .bind(WORKER)
                .fetch_all(&mut *conn)
                .await
                .unwrap();
        assert!(!tasks.is_empty(), "a hop of the diamond claimed nothing");
        for (step, index) in tasks {
            sqlx::query("select pgflow.complete_task($1, $2, $3, '1')")
                .bind(run)
                .bind(step)
                .bind(index)
                .execute(&mut *conn)
                .await
                .unwrap();
        }
    }
    run
}

/// The same through upstream's entry points (`start_tasks`, `complete_task`), which replan the same way: one
/// diamond run on such a session read over 100,000 index entries after 3,000 runs had arrived.
#[tokio::test]
async fn an_upstream_style_session_that_planned_on_empty_tables_replans_once_they_have_grown() {
    let db = test_db().await;
    let pool = db.pool();
    crate::exchange::setup(pool).await;
    register_worker(pool).await;
    empty_tables_without_autovacuum(pool).await;

    let mut conn = pool.acquire().await.unwrap();
    let run = diamond_upstream_style(&mut conn).await;
    assert_eq!(run_status(pool, run).await, "completed");

    insert_finished_diamond_runs(pool, 3000).await;

    flush_stats(&mut conn).await;
    let before = index_reads(pool).await;
    let run = diamond_upstream_style(&mut conn).await;
    flush_stats(&mut conn).await;
    let read = index_reads(pool).await - before;
    assert_eq!(run_status(pool, run).await, "completed");
    assert!(
        read < 1_000,
        "one diamond run on the session read {read} index entries of runs, step states and tasks"
    );
}

/// Starts a run of the `dia` diamond on `conn` and drives it to its end through `pgflow.exchange` on the same
/// connection; returns the run and the number of exchanges that claimed something.
async fn diamond_through_exchange(
    conn: &mut sqlx::PgConnection,
    worker: uuid::Uuid,
) -> (uuid::Uuid, usize) {
    let run: uuid::Uuid = sqlx::query_scalar("select (pgflow.start_flow('dia', '{}')).run_id")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    let mut claimed: Vec<(uuid::Uuid, String, i32, i32)> = Vec::new();
    let mut hops = 0;
    loop {
        let done: Vec<_> = claimed
            .iter()
            .map(|(run, step, index, attempt)| (*run, step.as_str(), *index, *attempt, json!(1)))
            .collect();
        let rows = crate::exchange::exchange(&mut *conn, worker, &done, 4).await;
        let applied = rows
            .iter()
            .filter(|r| r.get::<String, _>("outcome") == "applied")
            .count();
        assert_eq!(applied, done.len(), "every output recorded");
        claimed = rows
            .iter()
            .filter(|r| r.get::<String, _>("outcome") == "claimed")
            .map(|r| {
                (
                    r.get("run_id"),
                    r.get("step_slug"),
                    r.get("task_index"),
                    r.get("attempts_count"),
                )
            })
            .collect();
        if claimed.is_empty() {
            break;
        }
        hops += 1;
    }
    (run, hops)
}

/// Updates of the `dia` queue's messages so far.
async fn queue_updates(conn: &mut sqlx::PgConnection) -> i64 {
    flush_stats(conn).await;
    sqlx::query_scalar(
        "select n_tup_upd from pg_stat_user_tables where schemaname = 'pgmq' and relname = 'q_dia'",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap()
}

/// The step timeout an exchange returned with its first claimed task.
fn claimed_timeout(rows: &[sqlx::postgres::PgRow]) -> i32 {
    rows.iter()
        .find(|r| r.get::<String, _>("outcome") == "claimed")
        .map(|r| r.get("timeout"))
        .expect("a claimed task")
}

/// A claim writes each message once. The exchange's read locks the messages without
/// touching them and the claim then sets visibility, `read_ct` and `last_read_at` in one update, where
/// `pgmq.read` followed by the claim updated every claimed message twice.
#[tokio::test]
async fn an_exchange_claim_writes_each_message_once() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = crate::exchange::setup(pool).await;
    for _ in 0..3 {
        exec(pool, "select pgflow.start_flow('dia', '{}')").await;
    }
    let mut conn = pool.acquire().await.unwrap();
    let before = queue_updates(&mut conn).await;
    let rows = crate::exchange::exchange(&mut *conn, worker, &[], 10).await;
    let after = queue_updates(&mut conn).await;
    let claimed: Vec<i64> = rows
        .iter()
        .filter(|r| r.get::<String, _>("outcome") == "claimed")
        .map(|r| r.get("msg_id"))
        .collect();
    assert_eq!(claimed.len(), 3, "the three root tasks");
    assert_eq!(after - before, 3, "one update per claimed message");

    // What pgmq.read and the claim together left before: read once, hidden for the step timeout plus the
    // claim buffer (not for the read's 30 s).
    let timeout = claimed_timeout(&rows);
    let messages: Vec<(i32, bool)> = sqlx::query_as(
        "select read_ct,
                abs(extract(epoch from vt - last_read_at) - ($2 + pgflow._claim_visibility_buffer_seconds())) < 1
           from pgmq.q_dia where msg_id = any ($1) order by msg_id",
    )
    .bind(&claimed)
    .bind(timeout)
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(messages, vec![(1, true); 3]);
}

/// A message the exchange reads but cannot claim yet (its task is queued, its run not running) is left as
/// `pgmq.read` leaves it: read once and hidden for the read's visibility, beside a claimed one that is
/// hidden for the step timeout plus the claim buffer. Both values come from the claim's one visibility
/// update.
#[tokio::test]
async fn an_exchange_hides_a_message_it_cannot_claim_for_the_read_visibility() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = crate::exchange::setup(pool).await;
    let claimable: uuid::Uuid =
        sqlx::query_scalar("select (pgflow.start_flow('dia', '{}')).run_id")
            .fetch_one(pool)
            .await
            .unwrap();
    let held: uuid::Uuid = sqlx::query_scalar("select (pgflow.start_flow('dia', '{}')).run_id")
        .fetch_one(pool)
        .await
        .unwrap();
    // The second run is no longer running while its root task is still queued with a live message.
    sqlx::query("update pgflow.runs set status = 'failed', failed_at = now() where run_id = $1")
        .bind(held)
        .execute(pool)
        .await
        .unwrap();
    let rows = crate::exchange::exchange(pool, worker, &[], 10).await;
    let outcome_of = |run: Option<uuid::Uuid>, outcome: &str| {
        rows.iter()
            .filter(|r| r.get::<String, _>("outcome") == outcome)
            .filter(|r| run.is_none() || r.get::<Option<uuid::Uuid>, _>("run_id") == run)
            .map(|r| r.get::<i64, _>("msg_id"))
            .collect::<Vec<_>>()
    };
    let claimed = outcome_of(Some(claimable), "claimed");
    let waiting = outcome_of(None, "waiting");
    assert_eq!(claimed.len(), 1, "the running run's root task is claimed");
    assert_eq!(waiting.len(), 1, "the other run's root message waits");
    let timeout = claimed_timeout(&rows);
    // (read_ct, seconds hidden after the read) for the claimed and the waiting message.
    let hidden: Vec<(i32, f64)> = sqlx::query_as(
        "select read_ct, extract(epoch from vt - last_read_at)::float8
           from pgmq.q_dia where msg_id = any ($1) order by array_position($1, msg_id)",
    )
    .bind(vec![claimed[0], waiting[0]])
    .fetch_all(pool)
    .await
    .unwrap();
    let buffer: f64 =
        sqlx::query_scalar("select pgflow._claim_visibility_buffer_seconds()::float8")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(hidden[0].0, 1);
    assert!(
        (hidden[0].1 - (f64::from(timeout) + buffer)).abs() < 1.0,
        "claimed: {hidden:?}"
    );
    assert_eq!(hidden[1].0, 1);
    assert!((hidden[1].1 - 30.0).abs() < 1.0, "waiting: {hidden:?}");
    let status: String = sqlx::query_scalar(
        "select status from pgflow.step_tasks where run_id = $1 and step_slug = 'a'",
    )
    .bind(held)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(status, "queued", "a waiting task is not started");
}

/// A new run writes each of its step states once: when no root step needs the cascade, start_flow inserts
/// the root steps started instead of inserting them created and updating them. The run
/// is started as before: each root step started with its task queued and its message sent.
#[tokio::test]
async fn starting_a_run_writes_each_step_state_once() {
    let db = test_db().await;
    let pool = db.pool();
    crate::exchange::setup(pool).await;
    let mut conn = pool.acquire().await.unwrap();
    flush_stats(&mut conn).await;
    let before = step_state_writes(pool).await;
    sqlx::query("select count(*) from (select pgflow.start_flow('dia', '{}') from generate_series(1, 10)) x")
        .execute(&mut *conn)
        .await
        .unwrap();
    flush_stats(&mut conn).await;
    let after = step_state_writes(pool).await;
    assert_eq!(
        (after.0 - before.0, after.1 - before.1),
        (40, 0),
        "ten diamond runs insert forty step states and update none"
    );
    let started: (i64, i64, i64) = sqlx::query_as(
        "select (select count(*) from pgflow.step_states
                  where step_slug = 'a' and status = 'started' and started_at = created_at
                    and remaining_tasks = 1 and initial_tasks = 1),
                (select count(*) from pgflow.step_states where step_slug <> 'a' and status = 'created'
                    and started_at is null and remaining_tasks is null),
                (select count(*) from pgflow.step_tasks where step_slug = 'a' and status = 'queued')",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(started, (10, 30, 10));
    assert_eq!(live_messages(pool, "dia").await, 10);
}

/// A completion writes each dependent step state once: when the steps it makes ready take the plain start,
/// the update that releases them also starts them, instead of a second update from
/// _advance_runs. They start as before: started with their tasks queued and their messages sent, step:started
/// in step order; a dependent still waiting for another dependency is only released.
#[tokio::test]
async fn completing_a_step_writes_each_dependent_step_state_once() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = crate::exchange::setup(pool).await;
    exec(pool, "select count(*) from (select pgflow.start_flow('dia', '{}') from generate_series(1, 10)) x").await;
    let mut conn = pool.acquire().await.unwrap();
    let claimed = crate::exchange::exchange(&mut *conn, worker, &[], 10).await;
    let done = finished_a(&claimed);
    assert_eq!(done.len(), 10);
    flush_stats(&mut conn).await;
    let before = step_state_writes(pool).await;
    let rows = crate::exchange::exchange(&mut *conn, worker, &done, 0).await;
    assert!(rows
        .iter()
        .all(|r| r.get::<String, _>("outcome") == "applied"));
    flush_stats(&mut conn).await;
    let after = step_state_writes(pool).await;
    assert_eq!(
        (after.0 - before.0, after.1 - before.1),
        (0, 30),
        "ten completions of `a` update `a` once and `b` and `c` once each (released and started together)"
    );
    let states: Vec<(String, String, i32, Option<i32>, bool)> = sqlx::query_as(
        "select step_slug, status, remaining_deps, remaining_tasks, started_at is not distinct from
                (select s.completed_at from pgflow.step_states s where s.run_id = ss.run_id and s.step_slug = 'a')
         from pgflow.step_states ss where step_slug <> 'a'
         group by 1, 2, 3, 4, 5 order by 1",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        states,
        [
            ("b".into(), "started".into(), 0, Some(1), true),
            ("c".into(), "started".into(), 0, Some(1), true),
            ("d".into(), "created".into(), 2, None, false),
        ],
        "b and c start in the completing transaction; d waits for both"
    );
    let queued: i64 = sqlx::query_scalar(
        "select count(*) from pgflow.step_tasks where step_slug in ('b', 'c') and status = 'queued'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(queued, 20);
    assert_eq!(live_messages(pool, "dia").await, 20);
}

/// Calls of `schema.name` (all overloads) this connection has made, flushed to the statistics views.
async fn function_calls(conn: &mut sqlx::PgConnection, schema: &str, name: &str) -> i64 {
    flush_stats(conn).await;
    sqlx::query_scalar(
        "select coalesce(sum(calls), 0)::int8 from pg_stat_user_functions where schemaname = $1 and funcname = $2",
    )
    .bind(schema)
    .bind(name)
    .fetch_one(&mut *conn)
    .await
    .unwrap()
}

/// Claims, completions and the messages they send go through the queue's own statements function, whose plans
/// are cached for the session, and never through PGMQ's text-built statements, which are planned on every call.
#[tokio::test]
async fn exchanges_use_the_queues_own_statements_not_pgmqs_text_built_ones() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = crate::exchange::setup(pool).await;
    exec(
        pool,
        "select count(*) from (select pgflow.start_flow('dia', '{}') from generate_series(1, 5)) x",
    )
    .await;
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("set track_functions = 'pl'")
        .execute(&mut *conn)
        .await
        .unwrap();
    let claimed = crate::exchange::exchange(&mut *conn, worker, &[], 5).await;
    let done = finished_a(&claimed);
    assert_eq!(done.len(), 5);
    // Completes `a`, sends `b` and `c`, and claims them.
    let rows = crate::exchange::exchange(&mut *conn, worker, &done, 10).await;
    assert_eq!(
        rows.iter()
            .filter(|r| r.get::<String, _>("outcome") == "claimed")
            .count(),
        10
    );
    for name in ["archive", "send_batch", "_send_batch", "read"] {
        assert_eq!(
            function_calls(&mut conn, "pgmq", name).await,
            0,
            "pgmq.{name} is not on the exchange's path"
        );
    }
    assert!(function_calls(&mut conn, "pgflow", "_queue_ops_dia").await >= 4);
    let archived: i64 = sqlx::query_scalar("select count(*) from pgmq.a_dia where read_ct = 1")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(
        archived, 5,
        "the completed messages are archived as PGMQ would, read once"
    );
    assert_eq!(
        live_messages(pool, "dia").await,
        10,
        "b and c's messages are live and claimed"
    );
}

/// A queue's statements function is created with the queue, on first use for a queue created outside pgflow,
/// and dropped with the queue.
#[tokio::test]
async fn a_queues_statements_live_and_die_with_the_queue() {
    let db = test_db().await;
    let pool = db.pool();
    let exists = |name: &'static str| async move {
        sqlx::query_scalar::<_, bool>("select to_regproc($1) is not null")
            .bind(format!("pgflow._queue_ops_{name}"))
            .fetch_one(pool)
            .await
            .unwrap()
    };
    crate::exchange::setup(pool).await;
    assert!(
        exists("dia").await,
        "compiling the flow creates its queue's statements"
    );

    exec(
        pool,
        "select pgmq.create('outside'); select pgmq.send('outside', '{}')",
    )
    .await;
    assert!(!exists("outside").await);
    let locked: Vec<i64> =
        sqlx::query_scalar("select unnest(pgflow._lock_messages('outside', array[1, 2]::int8[]))")
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(locked, [1], "only the live message is locked");
    assert!(exists("outside").await, "first use creates them");

    exec(pool, "select pgflow.delete_flow_and_data('dia')").await;
    assert!(
        !exists("dia").await,
        "dropping the queue drops its statements"
    );
    assert!(exists("outside").await, "other queues keep theirs");
}

/// Rows of `pgflow.step_tasks` the current transaction has fetched so far.
async fn task_rows_fetched(conn: &mut sqlx::PgConnection) -> i64 {
    sqlx::query_scalar(
        "select idx_tup_fetch + seq_tup_read from pg_stat_xact_user_tables
          where schemaname = 'pgflow' and relname = 'step_tasks'",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap()
}

/// A new installation: 2,000 queued tasks on the `dia` queue, its tables vacuumed while they were empty and
/// never analysed since (no autovacuum while the test runs).
async fn queue_without_statistics(pool: &sqlx::PgPool) -> uuid::Uuid {
    let worker = crate::exchange::setup(pool).await;
    empty_tables_without_autovacuum(pool).await;
    exec(
        pool,
        "select count(*) from pgflow.start_flows('dia', array_fill('{}'::jsonb, array[2000]))",
    )
    .await;
    worker
}

/// A claim finds each task by its message's key. With `queue_name = q and message_id = any (ids)`, the plan
/// made on tables without statistics scanned the queue's tasks by name alone and filtered them by id: one
/// claim of three messages read all 2,000 tasks of the queue.
#[tokio::test]
async fn a_claim_on_tables_without_statistics_reads_only_its_own_tasks() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = queue_without_statistics(pool).await;

    let mut conn = pool.acquire().await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    let rows = crate::exchange::exchange(&mut *tx, worker, &[], 3).await;
    let fetched = task_rows_fetched(&mut tx).await;
    tx.commit().await.unwrap();
    let claimed = finished_a(&rows);
    assert_eq!(claimed.len(), 3);
    assert!(
        fetched <= 30,
        "claiming 3 of the queue's 2,000 tasks fetched {fetched} task rows"
    );

    // Their outputs, recorded with the next claim: the completion and the claim of the dependents.
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    let rows = crate::exchange::exchange(&mut *tx, worker, &claimed, 6).await;
    let fetched = task_rows_fetched(&mut tx).await;
    tx.commit().await.unwrap();
    let outcomes: Vec<String> = rows.iter().map(|r| r.get("outcome")).collect();
    assert_eq!(
        outcomes.iter().filter(|o| *o == "applied").count(),
        3,
        "{outcomes:?}"
    );
    assert_eq!(
        outcomes.iter().filter(|o| *o == "claimed").count(),
        6,
        "{outcomes:?}"
    );
    assert!(
        fetched <= 100,
        "recording 3 outputs and claiming 6 dependents fetched {fetched} task rows"
    );
}
