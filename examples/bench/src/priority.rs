//! Priorities and the cost of flow control (`--only priority`); the figures go in BENCHMARKS.md.
//!
//! - the wait (queued → started, p50 and p99) of low-priority runs (priority 0, one every 100 ms) under a
//!   steady high-priority load (priority 10, a backlog of about 200 kept queued) on a queue with priorities
//!   and an aging of 100 ms (so a head start of 1 s), one worker of 16 handlers, for `--priority-seconds`;
//! - the cost of each control: `--priority-runs` runs (four tasks each) of a keyed diamond flow drained by
//!   one worker of 16 handlers, with no control, a queue limit, a key limit on every step (100 active keys),
//!   a queue rate, a key rate on every step and priorities (random 0..9); limits and rates high enough never
//!   to hold a task, so what is measured is what enforcing them costs. `--priority-rounds` rounds each drain
//!   every control once, in an order that rotates from round to round; each control's cost in a round is
//!   its rate against that round's drain with no control, and the median over the rounds counts (this
//!   host's speed drifts within minutes, so drains far apart in time compare badly). Each drain starts
//!   from a vacuumed and checkpointed database. With `--profile`,
//!   each drain prints its function profile.

use std::time::{Duration, Instant};

use pgflow_runtime::{flow_control, Worker};
use tokio_util::sync::CancellationToken;

use crate::control::{percentile, Figure};
use crate::db::BenchDb;
use crate::flows::keyed_diamond::KeyedDiamond;
use crate::flows::tenant::Tenant;
use crate::BenchError;

fn invalid(e: impl std::fmt::Display) -> BenchError {
    BenchError::Invalid(e.to_string())
}

/// The queue of a flow's step (its one queue).
async fn queue_of(db: &BenchDb, flow: &str) -> Result<String, BenchError> {
    Ok(
        sqlx::query_scalar("select queue_name from pgflow.steps where flow_slug = $1 limit 1")
            .bind(flow)
            .fetch_one(&db.pool)
            .await?,
    )
}

/// Starts one run of `flow` per tenant name, at the matching priority.
async fn start(
    db: &BenchDb,
    flow: &str,
    tenants: &[String],
    priorities: &[i32],
) -> Result<(), BenchError> {
    let inputs: Vec<serde_json::Value> = tenants
        .iter()
        .map(|t| serde_json::json!({ "tenant": t }))
        .collect();
    sqlx::query("select pgflow.start_flows($1, $2, null, $3)")
        .bind(flow)
        .bind(&inputs)
        .bind(priorities)
        .execute(&db.pool)
        .await?;
    Ok(())
}

/// Waits (at most `limit`) until no run of `flow` is started.
async fn drained(db: &BenchDb, flow: &str, limit: Duration) -> Result<(), BenchError> {
    let deadline = Instant::now() + limit;
    loop {
        let left: i64 = sqlx::query_scalar(
            "select count(*) from pgflow.runs where flow_slug = $1 and status = 'started'",
        )
        .bind(flow)
        .fetch_one(&db.pool)
        .await?;
        if left == 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(invalid(format!("{flow}: {left} runs did not complete")));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs both scenarios.
pub(crate) async fn run(
    db: &BenchDb,
    seconds: u64,
    runs: usize,
    rounds: usize,
) -> Result<Vec<Figure>, BenchError> {
    let mut figures = waits(db, seconds).await?;
    figures.extend(overhead(db, runs, rounds).await?);
    Ok(figures)
}

/// Low- against high-priority waits under a steady high-priority load.
async fn waits(db: &BenchDb, seconds: u64) -> Result<Vec<Figure>, BenchError> {
    let stop = CancellationToken::new();
    let worker = Worker::<Tenant>::builder(db.pool.clone())
        .max_concurrent(16)
        .build()
        .map_err(invalid)?
        .spawn(stop.clone())
        .await
        .map_err(invalid)?;
    let queue = queue_of(db, "benchTenant").await?;
    flow_control::set_queue_priority(&db.pool, &queue, Duration::from_millis(100)).await?;
    let high: Vec<String> = vec!["high".to_owned(); 100];
    let end = Instant::now() + Duration::from_secs(seconds.max(1));
    let mut next_low = Instant::now();
    while Instant::now() < end {
        let queued: i64 = sqlx::query_scalar(
            "select count(*) from pgflow.step_tasks where flow_slug = 'benchTenant' and status = 'queued'",
        )
        .fetch_one(&db.pool)
        .await?;
        if queued < 200 {
            start(db, "benchTenant", &high, &[10; 100]).await?;
        }
        if Instant::now() >= next_low {
            start(db, "benchTenant", &["low".to_owned()], &[0]).await?;
            next_low += Duration::from_millis(100);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let drain = drained(db, "benchTenant", Duration::from_secs(600)).await;
    stop.cancel();
    worker.join().await.map_err(invalid)?;
    drain?;
    flow_control::clear_queue_priority(&db.pool, &queue).await?;
    let mut figures = Vec::new();
    for (tenant, priority) in [("low", 0), ("high", 10)] {
        let mut w: Vec<f64> = sqlx::query_scalar(
            "select extract(epoch from t.started_at - t.queued_at)::float8 * 1000 \
             from pgflow.step_tasks t join pgflow.runs r using (run_id) \
             where t.flow_slug = 'benchTenant' and r.input ->> 'tenant' = $1",
        )
        .bind(tenant)
        .fetch_all(&db.pool)
        .await?;
        w.sort_by(f64::total_cmp);
        figures.push(Figure {
            what: format!(
                "wait of priority-{priority} runs under a steady priority-10 load (aging 100 ms)"
            ),
            value: percentile(&w, 0.99),
            unit: "ms p99",
            extra: format!("p50 {:.0} ms over {} runs", percentile(&w, 0.5), w.len()),
        });
    }
    Ok(figures)
}

/// One control of the overhead scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Control {
    None,
    QueueLimit,
    KeyLimit,
    QueueRate,
    KeyRate,
    Priority,
}

impl Control {
    const ALL: [Control; 6] = [
        Control::None,
        Control::QueueLimit,
        Control::KeyLimit,
        Control::QueueRate,
        Control::KeyRate,
        Control::Priority,
    ];

    fn name(self) -> &'static str {
        match self {
            Control::None => "no control",
            Control::QueueLimit => "queue limit",
            Control::KeyLimit => "key limit on every step, 100 active keys",
            Control::QueueRate => "queue rate",
            Control::KeyRate => "key rate on every step, 100 active keys",
            Control::Priority => "priorities (random 0..9)",
        }
    }

    /// Sets the control (`on`) or clears it.
    async fn apply(self, db: &BenchDb, queue: &str, on: bool) -> Result<(), BenchError> {
        let pool = &db.pool;
        let per_second = Some((1_000_000, Duration::from_secs(1)));
        match (self, on) {
            (Control::None, _) => {}
            (Control::QueueLimit, true) => {
                flow_control::set_queue_limit(pool, queue, Some(100_000), None).await?
            }
            (Control::QueueRate, true) => {
                flow_control::set_queue_limit(pool, queue, None, per_second).await?
            }
            (Control::QueueLimit | Control::QueueRate, false) => {
                flow_control::clear_queue_limit(pool, queue)
                    .await
                    .map(drop)?
            }
            (Control::KeyLimit | Control::KeyRate, _) => {
                for step in ["a", "b", "c", "d"] {
                    match (self, on) {
                        (Control::KeyLimit, true) => {
                            flow_control::set_key_limits(
                                pool,
                                "benchKeyed",
                                step,
                                &["tenant"],
                                Some(100_000),
                                None,
                            )
                            .await?
                        }
                        (_, true) => {
                            flow_control::set_key_limits(
                                pool,
                                "benchKeyed",
                                step,
                                &["tenant"],
                                None,
                                per_second,
                            )
                            .await?
                        }
                        _ => flow_control::clear_key_limit(pool, "benchKeyed", step)
                            .await
                            .map(drop)?,
                    }
                }
            }
            (Control::Priority, true) => {
                flow_control::set_queue_priority(pool, queue, Duration::from_secs(1)).await?
            }
            (Control::Priority, false) => flow_control::clear_queue_priority(pool, queue)
                .await
                .map(drop)?,
        }
        Ok(())
    }
}

/// Drains `runs` runs of the keyed diamond under `control`; returns tasks per second (from the first task's
/// start to the last one's completion, from the task rows).
async fn drain_once(
    db: &BenchDb,
    queue: &str,
    control: Control,
    runs: usize,
) -> Result<f64, BenchError> {
    // Every drain starts from a vacuumed, checkpointed database, so that no drain pays for its
    // predecessors' dead rows (autovacuum on two cores moved single drains by a third).
    db.settle().await?;
    control.apply(db, queue, true).await?;
    if db.profile {
        sqlx::query("select pg_stat_reset()")
            .execute(&db.pool)
            .await?;
    }
    let since: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("select clock_timestamp()")
        .fetch_one(&db.pool)
        .await?;
    let tenants: Vec<String> = (0..runs).map(|i| format!("t{}", i % 100)).collect();
    let priorities: Vec<i32> = (0..runs)
        .map(|i| {
            if control == Control::Priority {
                (i * 7 % 10) as i32
            } else {
                0
            }
        })
        .collect();
    for (t, p) in tenants.chunks(500).zip(priorities.chunks(500)) {
        start(db, "benchKeyed", t, p).await?;
    }
    drained(db, "benchKeyed", Duration::from_secs(600)).await?;
    control.apply(db, queue, false).await?;
    let (tasks, secs): (i64, f64) = sqlx::query_as(
        "select count(*), extract(epoch from max(completed_at) - min(started_at))::float8 \
         from pgflow.step_tasks where flow_slug = 'benchKeyed' and started_at >= $1",
    )
    .bind(since)
    .fetch_one(&db.pool)
    .await?;
    if db.profile {
        let profile = db.function_profile(tasks as usize).await?;
        println!("\n#### profile: {}\n\n{profile}", control.name());
    }
    Ok(tasks as f64 / secs)
}

/// The cost of each control against none: per round, each control's rate over the same round's rate with no
/// control; the median round counts.
async fn overhead(db: &BenchDb, runs: usize, rounds: usize) -> Result<Vec<Figure>, BenchError> {
    let stop = CancellationToken::new();
    let worker = Worker::<KeyedDiamond>::builder(db.pool.clone())
        .max_concurrent(16)
        .build()
        .map_err(invalid)?
        .spawn(stop.clone())
        .await
        .map_err(invalid)?;
    let queue = queue_of(db, "benchKeyed").await?;
    let rounds = rounds.max(1);
    // rates[round][control]
    let mut rates = vec![[0.0_f64; Control::ALL.len()]; rounds];
    let mut result = Ok(());
    'rounds: for (round, rate) in rates.iter_mut().enumerate() {
        for k in 0..Control::ALL.len() {
            let i = (k + round) % Control::ALL.len();
            match drain_once(db, &queue, Control::ALL[i], runs).await {
                Ok(r) => rate[i] = r,
                Err(e) => {
                    result = Err(e);
                    break 'rounds;
                }
            }
        }
    }
    stop.cancel();
    worker.join().await.map_err(invalid)?;
    result?;
    Ok(Control::ALL
        .into_iter()
        .enumerate()
        .map(|(i, control)| {
            let mut rate: Vec<f64> = rates.iter().map(|r| r[i]).collect();
            rate.sort_by(f64::total_cmp);
            let mut cost: Vec<f64> = rates.iter().map(|r| (r[i] / r[0] - 1.0) * 100.0).collect();
            cost.sort_by(f64::total_cmp);
            let extra = if i == 0 {
                format!("median of {rounds} drains")
            } else {
                format!(
                    "{:+.1}% against no control (median of {rounds} rounds; {:+.1}% to {:+.1}%)",
                    percentile(&cost, 0.5),
                    cost[0],
                    cost[cost.len() - 1]
                )
            };
            Figure {
                what: format!(
                    "keyed diamond, one worker of 16 handlers: {}",
                    control.name()
                ),
                value: percentile(&rate, 0.5),
                unit: "tasks/s",
                extra,
            }
        })
        .collect())
}
