//! Reliability of the worker: stale results from an earlier attempt are ignored, outputs PostgreSQL cannot
//! store fail only their own task, claiming pauses while results cannot be recorded, shutdown is bounded and
//! hands back a claim that was in flight, one maintenance sweep prunes as many retention batches as are due,
//! and real roles with the documented grants run a flow.

use std::sync::LazyLock;
use std::time::Duration;

use pgflow_runtime::{client::WaitError, flow, Client, StepContext, StepError};
use serde_json::json;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor, PgPool};
use tokio::sync::Notify;
use uuid::Uuid;

use crate::support::{self, LIMIT};

/// Makes the run's started task look stalled and lets recovery requeue it (as if its worker had been cut
/// off for longer than the step timeout plus the stall buffer). The worker's own maintenance sweep (every
/// 5 s, one caller at a time) may requeue it first, or hold its message while this call runs (recovery
/// skips what it cannot lock at once); so recovery is called until the task's stalled attempt is recorded,
/// and exactly one is.
async fn requeue_as_stalled(pool: &PgPool, run: Uuid) {
    pool.execute(
        format!(
            "update pgflow.step_tasks set queued_at = now() - interval '2 hours',
               started_at = now() - interval '1 hour' where run_id = '{run}' and status = 'started'"
        )
        .as_str(),
    )
    .await
    .unwrap();
    let stalled = || async {
        sqlx::query_scalar::<_, i64>(
            "select count(*) from pgflow.task_attempts where run_id = $1 and outcome = 'stalled'",
        )
        .bind(run)
        .fetch_one(pool)
        .await
        .unwrap()
    };
    pgflow_tests::wait_until(LIMIT, "recovery to requeue the stalled task", || async {
        sqlx::query_scalar::<_, i32>("select pgflow.requeue_stalled_tasks()")
            .fetch_one(pool)
            .await
            .unwrap();
        stalled().await > 0
    })
    .await;
    assert_eq!(stalled().await, 1);
}

static LATE_OUTPUT_GATE: LazyLock<Notify> = LazyLock::new(Notify::new);

#[flow(slug = "lateOutputFlow", input = i64, max_attempts = 3, timeout = 60)]
mod late_output {
    use super::*;

    /// Attempt 1 waits for the test, then returns; later attempts return at once.
    #[step]
    async fn work(_n: i64, ctx: &StepContext<LateOutput>) -> Result<String, StepError> {
        if ctx.attempt() == 1 {
            LATE_OUTPUT_GATE.notified().await;
        }
        Ok(format!("attempt {}", ctx.attempt()))
    }
}

#[tokio::test]
async fn a_late_output_of_an_earlier_attempt_is_ignored_as_stale() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn::<late_output::LateOutput>(pool).await;
    let run = Client::new(pool.clone())
        .start::<late_output::LateOutput>(&1)
        .await
        .unwrap();
    pgflow_tests::wait_until(LIMIT, "attempt 1 to start", || async {
        support::task(pool, run.run_id(), "work", 0).await.0 == "started"
    })
    .await;
    requeue_as_stalled(pool, run.run_id()).await;
    // Attempt 2 runs and completes the run while attempt 1 still holds its handler.
    let out = run.wait(LIMIT).await.unwrap();
    assert_eq!(out.work, "attempt 2");

    LATE_OUTPUT_GATE.notify_one();
    let report = worker.stop().await;
    assert_eq!((report.completed, report.stale), (1, 1));
    assert_eq!(
        support::run_output(pool, run.run_id()).await,
        Some(json!({"work": "attempt 2"}))
    );
    assert_eq!(support::task(pool, run.run_id(), "work", 0).await.1, 2);
}

static LATE_FAILURE_GATE: LazyLock<Notify> = LazyLock::new(Notify::new);

#[flow(slug = "lateFailureFlow", input = i64, max_attempts = 2, timeout = 60)]
mod late_failure {
    use super::*;

    /// Attempt 1 waits for the test, then fails; later attempts succeed.
    #[step]
    async fn work(_n: i64, ctx: &StepContext<LateFailure>) -> Result<String, StepError> {
        if ctx.attempt() == 1 {
            LATE_FAILURE_GATE.notified().await;
            return Err(StepError::terminal("attempt 1 gave up"));
        }
        Ok(format!("attempt {}", ctx.attempt()))
    }
}

#[tokio::test]
async fn a_late_failure_of_an_earlier_attempt_does_not_fail_the_run() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = support::spawn::<late_failure::LateFailure>(pool).await;
    let run = Client::new(pool.clone())
        .start::<late_failure::LateFailure>(&1)
        .await
        .unwrap();
    pgflow_tests::wait_until(LIMIT, "attempt 1 to start", || async {
        support::task(pool, run.run_id(), "work", 0).await.0 == "started"
    })
    .await;
    requeue_as_stalled(pool, run.run_id()).await;
    assert_eq!(run.wait(LIMIT).await.unwrap().work, "attempt 2");

    LATE_FAILURE_GATE.notify_one();
    let report = worker.stop().await;
    assert_eq!((report.completed, report.failed, report.stale), (1, 0, 1));
    assert_eq!(support::run_status(pool, run.run_id()).await, "completed");
}

#[flow(slug = "echoFlow", input = String)]
mod echo {
    use super::*;

    /// Returns its input; `nul` returns a string with a NUL character, `err` fails with one.
    #[step]
    async fn echo(s: String) -> Result<String, StepError> {
        match s.as_str() {
            "nul" => Ok("nul \0 here".to_owned()),
            "err" => Err(StepError::terminal("bad \0 message")),
            _ => Ok(s),
        }
    }
}

#[tokio::test]
async fn an_output_postgresql_cannot_store_fails_only_its_own_task_and_error_messages_are_storable()
{
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let client = Client::new(pool.clone());
    // Start everything first, so one claim batch (and one completion batch) carries all of it.
    support::compile::<echo::Echo>(pool).await;
    let bad = client.start::<echo::Echo>(&"nul".into()).await.unwrap();
    let mut good = Vec::new();
    for i in 0..5 {
        good.push(
            client
                .start::<echo::Echo>(&format!("fine {i}"))
                .await
                .unwrap(),
        );
    }
    let failing = client.start::<echo::Echo>(&"err".into()).await.unwrap();
    let worker = support::spawn::<echo::Echo>(pool).await;

    // The good outputs are recorded on their first attempt: the bad one neither holds them back
    // until a timeout nor sends them round again.
    for (i, run) in good.iter().enumerate() {
        assert_eq!(run.wait(LIMIT).await.unwrap().echo, format!("fine {i}"));
        assert_eq!(
            support::task(pool, run.run_id(), "echo", 0).await,
            ("completed".to_owned(), 1, None),
            "good output {i}: completed on its first attempt"
        );
    }
    let Err(WaitError::Failed {
        failed_step,
        error_message,
        ..
    }) = bad.wait(LIMIT).await
    else {
        panic!("the run with the unstorable output fails");
    };
    assert_eq!(failed_step.as_deref(), Some("echo"));
    let message = error_message.unwrap();
    assert!(
        message.contains("step `echo` of flow `echoFlow`") && message.contains("NUL"),
        "{message}"
    );
    assert_eq!(
        support::task(pool, bad.run_id(), "echo", 0).await.1,
        1,
        "terminal: no retry"
    );
    let Err(WaitError::Failed { error_message, .. }) = failing.wait(LIMIT).await else {
        panic!("the failing run fails");
    };
    assert_eq!(error_message.as_deref(), Some("bad \\u0000 message"));
    let report = worker.stop().await;
    assert_eq!((report.completed, report.failed, report.stale), (5, 2, 0));
}

/// A batch of outputs the database refuses as a whole, for a reason retrying cannot fix and the worker cannot
/// see beforehand (here a trigger refusing one output), is recorded one output at a time: only the refused
/// output's task fails, with the database's message, and the others complete on their first attempt.
#[tokio::test]
async fn a_batch_of_outputs_refused_as_a_whole_is_recorded_one_by_one_and_fails_only_the_refused_task(
) {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let client = Client::new(pool.clone());
    support::compile::<echo::Echo>(pool).await;
    sqlx::raw_sql(
        "create function public.refuse_poison() returns trigger language plpgsql as $$
         begin
           if new.output = '\"poison\"'::jsonb then
             raise exception 'this database refuses poison';
           end if;
           return new;
         end $$;
         create trigger refuse_poison before update on pgflow.step_tasks
           for each row execute function public.refuse_poison();",
    )
    .execute(pool)
    .await
    .unwrap();
    // Start everything first, so one claim batch (and one exchange) carries all of it.
    let bad = client.start::<echo::Echo>(&"poison".into()).await.unwrap();
    let mut good = Vec::new();
    for i in 0..4 {
        good.push(
            client
                .start::<echo::Echo>(&format!("fine {i}"))
                .await
                .unwrap(),
        );
    }
    let worker = support::spawn::<echo::Echo>(pool).await;

    for (i, run) in good.iter().enumerate() {
        assert_eq!(run.wait(LIMIT).await.unwrap().echo, format!("fine {i}"));
        assert_eq!(
            support::task(pool, run.run_id(), "echo", 0).await,
            ("completed".to_owned(), 1, None),
            "good output {i}: completed on its first attempt"
        );
    }
    let Err(WaitError::Failed { error_message, .. }) = bad.wait(LIMIT).await else {
        panic!("the run with the refused output fails");
    };
    let message = error_message.unwrap();
    assert!(
        message
            .contains("step `echo` of flow `echoFlow` returned an output PostgreSQL cannot store")
            && message.contains("this database refuses poison"),
        "{message}"
    );
    assert_eq!(
        support::task(pool, bad.run_id(), "echo", 0).await.1,
        1,
        "terminal: no retry"
    );
    let report = worker.stop().await;
    assert_eq!((report.completed, report.failed, report.stale), (4, 1, 0));
}

#[flow(slug = "quickFlow", input = i64)]
mod quick {
    use super::*;

    #[step]
    async fn quick(n: i64) -> Result<i64, StepError> {
        Ok(n)
    }
}

/// The worker's last heartbeat, as the database recorded it.
async fn heartbeat(pool: &PgPool, worker_id: Uuid) -> chrono::DateTime<chrono::Utc> {
    sqlx::query_scalar("select last_heartbeat_at from pgflow.workers where worker_id = $1")
        .bind(worker_id)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Statuses of the quick runs' tasks: (started, queued, completed).
async fn quick_counts(pool: &PgPool) -> (i64, i64, i64) {
    sqlx::query_as(
        "select count(*) filter (where status = 'started'), count(*) filter (where status = 'queued'),
                count(*) filter (where status = 'completed')
         from pgflow.step_tasks where flow_slug = 'quickFlow'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn claiming_pauses_while_results_wait_to_be_recorded_and_shutdown_stays_bounded() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let client = Client::new(pool.clone());
    support::compile::<quick::Quick>(pool).await;
    let mut runs = Vec::new();
    for i in 0..10 {
        runs.push(client.start::<quick::Quick>(&i).await.unwrap());
    }
    // A slow database for results: every run row is locked, so no completion can be recorded.
    let mut blocker = pool.begin().await.unwrap();
    sqlx::query("select 1 from pgflow.runs for update")
        .execute(&mut *blocker)
        .await
        .unwrap();

    let worker = support::spawn_with(
        support::fast(pgflow_runtime::Worker::<quick::Quick>::builder(
            pool.clone(),
        ))
        .max_concurrent(10)
        .max_unrecorded(3)
        .shutdown_grace(Duration::from_secs(1))
        .cancel_grace(Duration::from_millis(200)),
    )
    .await;
    pgflow_tests::wait_until(LIMIT, "three tasks to be claimed", || async {
        quick_counts(pool).await.0 == 3
    })
    .await;
    // The worker's recording of those three results waits on the locked run rows.
    pgflow_tests::wait_until(
        LIMIT,
        "the recording to wait on the run rows' lock",
        || async {
            sqlx::query_scalar::<_, i64>(
                "select count(*) from pg_stat_activity \
             where datname = current_database() and wait_event_type = 'Lock'",
            )
            .fetch_one(pool)
            .await
            .unwrap()
                > 0
        },
    )
    .await;
    // With three results unrecorded, the worker claims nothing more, while it polls (every 10 to 50 ms)
    // and heartbeats (every 100 ms): it stays at three across three of its heartbeats.
    let worker_id = worker.id();
    for beat in 0..3 {
        let seen = heartbeat(pool, worker_id).await;
        pgflow_tests::wait_until(LIMIT, "the worker's next heartbeat", || async {
            heartbeat(pool, worker_id).await > seen
        })
        .await;
        assert_eq!(
            quick_counts(pool).await,
            (3, 7, 0),
            "after heartbeat {beat}"
        );
    }

    // Shutdown does not wait for the database without limit (`stop` is bounded by LIMIT): past the grace it
    // returns while the run rows are still locked, and the results are left to recovery.
    let report = worker.stop().await;
    assert_eq!(report.completed, 0);
    let still_locked: i64 = sqlx::query_scalar("select count(*) from pgflow.runs")
        .fetch_one(&mut *blocker)
        .await
        .unwrap();
    assert_eq!(still_locked, 10, "the blocker's transaction is still open");
    blocker.rollback().await.unwrap();

    // Another worker finishes every run.
    let rescuer = support::spawn::<quick::Quick>(pool).await;
    for (i, run) in runs.iter().enumerate() {
        assert_eq!(run.wait(LIMIT).await.unwrap().quick, i as i64);
    }
    rescuer.stop().await;
}

#[tokio::test]
async fn a_claim_in_flight_during_shutdown_is_handed_back() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let client = Client::new(pool.clone());
    support::compile::<quick::Quick>(pool).await;
    let run = client.start::<quick::Quick>(&7).await.unwrap();
    // The claim will wait on the task row.
    let mut blocker = pool.begin().await.unwrap();
    sqlx::query("select 1 from pgflow.step_tasks for update")
        .execute(&mut *blocker)
        .await
        .unwrap();
    let worker = support::spawn::<quick::Quick>(pool).await;
    pgflow_tests::wait_until(LIMIT, "the claim to wait for the task row", || async {
        sqlx::query_scalar::<_, bool>(
            "select exists (select 1 from pg_stat_activity where datname = current_database()
               and wait_event_type = 'Lock' and query like '%pgflow.exchange%')",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    })
    .await;
    let stopping = tokio::spawn(worker.stop());
    blocker.commit().await.unwrap();
    let report = stopping.await.unwrap();
    assert_eq!(
        report.released, 1,
        "the task claimed while stopping is handed back"
    );
    assert_eq!(
        support::task(pool, run.run_id(), "quick", 0).await,
        ("queued".into(), 0, None)
    );
    let rescuer = support::spawn::<quick::Quick>(pool).await;
    assert_eq!(run.wait(LIMIT).await.unwrap().quick, 7);
    rescuer.stop().await;
}

/// A login role of its own (roles are cluster-wide, so the name is random), dropped at the end.
async fn role(pool: &PgPool, what: &str) -> String {
    let name = format!("pgflow_rt_{what}_{:08x}", Uuid::new_v4().as_u128() as u32);
    pool.execute(format!("create role {name} login password '{name}'").as_str())
        .await
        .unwrap();
    name
}

async fn pool_as(db: &pgflow_tests::TestDb, role: &str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(8)
        .connect_with(db.options().username(role).password(role))
        .await
        .unwrap()
}

#[tokio::test]
async fn a_worker_role_and_a_client_role_with_the_documented_grants_run_a_flow_end_to_end() {
    let db = pgflow_tests::test_db().await;
    let owner = db.pool();
    let worker_role = role(owner, "worker").await;
    let client_role = role(owner, "client").await;
    let nobody_role = role(owner, "nobody").await;
    sqlx::query("select pgflow.grant_worker_privileges($1)")
        .bind(&worker_role)
        .execute(owner)
        .await
        .unwrap();
    sqlx::query("select pgflow.grant_client_privileges($1)")
        .bind(&client_role)
        .execute(owner)
        .await
        .unwrap();
    owner
        .execute(format!("grant usage on schema pgflow to {nobody_role}").as_str())
        .await
        .unwrap();

    let worker_pool = pool_as(&db, &worker_role).await;
    let client_pool = pool_as(&db, &client_role).await;
    let nobody_pool = pool_as(&db, &nobody_role).await;
    let worker = support::spawn::<quick::Quick>(&worker_pool).await;
    let run = Client::new(client_pool.clone())
        .start::<quick::Quick>(&41)
        .await
        .unwrap();
    assert_eq!(run.wait(LIMIT).await.unwrap().quick, 41);
    let state = Client::new(client_pool.clone())
        .run(run.run_id())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(state.steps.len(), 1);
    let refused = Client::new(nobody_pool.clone())
        .start::<quick::Quick>(&1)
        .await
        .unwrap_err();
    let code = match &refused {
        pgflow_runtime::client::ClientError::Database(e) => e
            .as_database_error()
            .and_then(|d| d.code())
            .map(|c| c.into_owned()),
        _ => None,
    };
    assert_eq!(code.as_deref(), Some("42501"), "{refused}");
    worker.stop().await;

    for pool in [worker_pool, client_pool, nobody_pool] {
        pool.close().await;
    }
    for name in [worker_role, client_role, nobody_role] {
        owner
            .execute(format!("drop owned by {name}; drop role {name}").as_str())
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn one_maintenance_sweep_prunes_finished_history_in_as_many_batches_as_it_needs() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    // 250 runs of the quick flow finished two days ago: five batches of 50.
    support::compile::<quick::Quick>(pool).await;
    pool.execute(
        "select count(*) from pgflow.start_flows('quickFlow',
           (select array_agg(to_jsonb(g)) from generate_series(1, 250) g));
         insert into pgflow.workers (worker_id, queue_name, function_name)
           values ('00000000-0000-0000-0000-0000000000aa', 'quickFlow', 'history');
         select count(*) from pgflow.start_tasks('quickFlow',
           (select array_agg(msg_id) from pgmq.read('quickFlow', 60, 250)),
           '00000000-0000-0000-0000-0000000000aa');
         select count(*) from pgflow.complete_tasks(
           (select array_agg(run_id order by run_id) from pgflow.step_tasks),
           (select array_agg(step_slug order by run_id) from pgflow.step_tasks),
           (select array_agg(task_index order by run_id) from pgflow.step_tasks),
           (select array_agg('1'::jsonb) from pgflow.step_tasks),
           (select array_agg(attempts_count order by run_id) from pgflow.step_tasks), null);
         update pgflow.runs set started_at = now() - interval '3 days', completed_at = now() - interval '2 days';",
    )
    .await
    .unwrap();
    let finished: i64 =
        sqlx::query_scalar("select count(*) from pgflow.runs where status = 'completed'")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(finished, 250);

    // The first sweep runs at startup; the next one would come a minute later, after the wait below gives up.
    let worker = support::spawn_with(
        support::fast(pgflow_runtime::Worker::<quick::Quick>::builder(
            pool.clone(),
        ))
        .maintenance_interval(Some(Duration::from_secs(60)))
        .retention(Some(Duration::from_secs(3600)))
        .retention_batch(50),
    )
    .await;
    pgflow_tests::wait_until(LIMIT, "the startup sweep to prune all 250 runs", || async {
        sqlx::query_scalar::<_, i64>("select count(*) from pgflow.runs")
            .fetch_one(pool)
            .await
            .unwrap()
            == 0
    })
    .await;
    worker.stop().await;
}

#[flow(slug = "signalFlow", input = String)]
mod signalled {
    use super::*;

    /// Returns its input.
    #[step]
    async fn work(what: String) -> Result<String, StepError> {
        Ok(what)
    }
}

/// A worker that polls only every ten minutes: within the test, only a queue signal or an output makes it
/// claim.
fn deaf<K>(
    b: pgflow_runtime::worker::WorkerBuilder<K>,
) -> pgflow_runtime::worker::WorkerBuilder<K> {
    support::fast(b)
        .poll_interval(Duration::from_secs(600))
        .max_poll_wait(Duration::from_secs(600))
        .max_concurrent(4)
}

#[tokio::test]
async fn a_signal_that_arrives_while_an_empty_claim_is_in_flight_makes_the_worker_claim_again() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    // The exchange that records the `hold` run's output (and claims, finding nothing) stops at its commit,
    // after its claim read the queue, until the test lets go of advisory lock 4242: a deferred trigger.
    pool.execute(
        r#"create function public.hold_commit() returns trigger language plpgsql as $$
           begin
             if (select r.input from pgflow.runs r where r.run_id = new.run_id) = '"hold"' then
               perform pg_advisory_xact_lock_shared(4242);
             end if;
             return null;
           end $$;
           create constraint trigger hold_commit after update of status on pgflow.step_tasks
           deferrable initially deferred
           for each row when (new.status = 'completed') execute function public.hold_commit();"#,
    )
    .await
    .unwrap();
    let mut gate = pool.acquire().await.unwrap();
    sqlx::query("select pg_advisory_lock(4242)")
        .execute(&mut *gate)
        .await
        .unwrap();
    let worker = support::spawn_with(deaf(
        pgflow_runtime::Worker::<signalled::Signalled>::builder(pool.clone()),
    ))
    .await;
    let client = Client::new(pool.clone());
    let held = client
        .start::<signalled::Signalled>(&"hold".to_owned())
        .await
        .unwrap();
    pgflow_tests::wait_until(LIMIT, "the exchange to wait at its commit", || async {
        sqlx::query_scalar::<_, bool>(
            "select exists (select 1 from pg_locks where locktype = 'advisory' and objid = 4242 \
             and not granted)",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    })
    .await;
    // This run's task is committed after the exchange in flight read the queue; its signal reaches the
    // worker while that exchange is still open. Nothing in the database shows when the worker has taken the
    // signal: the pause gives it ample time (a shorter one could only let a worker that loses it pass).
    let next = client
        .start::<signalled::Signalled>(&"go".to_owned())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    sqlx::query("select pg_advisory_unlock(4242)")
        .execute(&mut *gate)
        .await
        .unwrap();
    // The exchange comes back with the output recorded and nothing claimed; the signal that came meanwhile
    // makes the worker claim again instead of sleeping until its poll.
    assert_eq!(held.wait(LIMIT).await.unwrap().work, "hold");
    assert_eq!(
        next.wait(LIMIT)
            .await
            .expect("claimed after the signal")
            .work,
        "go"
    );
    worker.stop().await;
}

#[tokio::test]
async fn a_run_started_through_the_workers_own_pool_wakes_it() {
    let db = pgflow_tests::test_db().await;
    // One connection: the client's start runs on the very server process of the worker's last exchange.
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(db.options())
        .await
        .unwrap();
    let worker = support::spawn_with(deaf(
        pgflow_runtime::Worker::<signalled::Signalled>::builder(pool.clone()),
    ))
    .await;
    // The runs are started with the pool's one connection and watched on another pool.
    for what in ["first", "second"] {
        let run = pgflow_tests::state::start(&pool, "signalFlow", json!(what)).await;
        assert_eq!(support::wait_finished(db.pool(), run).await, "completed");
        assert_eq!(
            support::run_output(db.pool(), run).await,
            Some(json!({"work": what}))
        );
    }
    worker.stop().await;
}
