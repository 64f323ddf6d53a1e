//! A community-support pipeline, the workload per-step queues are for: threads go through a slow,
//! variable `classify` step, then a fast `deliverSlack` that runs only for threads classified as
//! `help`.
//!
//! The same flow is deployed twice under two concrete slugs, because queue mode belongs to a
//! concrete flow: [`community_plain`] (one queue, one plain worker) and
//! [`community_step_queued`] (one private queue and one worker pool per step). [`run_mode`] runs
//! a burst of threads through one of them and measures how long `deliverSlack` waits while
//! `classify` has a backlog.

use std::time::{Duration, Instant};

use pgflow_runtime::{StepError, StepQueued, Worker};
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// A community thread to triage.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Thread {
    /// The thread's id.
    pub id: i64,
    /// Its text.
    pub text: String,
}

/// What `classify` decided.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Classification {
    /// `help` (delivered to Slack) or `chat`.
    pub route: String,
}

/// How long classifying thread `id` takes: 20 to 80 ms, spread deterministically.
pub fn classify_cost(id: i64) -> Duration {
    let spread = (id as u64).wrapping_mul(2_654_435_761) % 61;
    Duration::from_millis(20 + spread)
}

/// The slow, variable step (a stand-in for a model call).
async fn classify(thread: Thread) -> Result<Classification, StepError> {
    tokio::time::sleep(classify_cost(thread.id)).await;
    let route = if thread.text.contains('?') {
        "help"
    } else {
        "chat"
    };
    Ok(Classification {
        route: route.into(),
    })
}

/// The fast step (a stand-in for a Slack webhook call).
async fn deliver_slack(classify: Classification) -> Result<String, StepError> {
    tokio::time::sleep(Duration::from_millis(2)).await;
    Ok(format!("posted to #{}", classify.route))
}

/// The pipeline on the flow's single queue, run by a plain [`Worker`].
#[pgflow_runtime::flow(slug = "communityThreadsPlain", input = Thread)]
pub mod community_plain {
    use super::{Classification, StepError, Thread};

    /// Slow and variable.
    #[step]
    async fn classify(thread: Thread) -> Result<Classification, StepError> {
        super::classify(thread).await
    }

    /// Fast; only for help threads.
    #[step(depends_on = [classify], slug = "deliverSlack", if = { classify: { route: "help" } })]
    async fn deliver_slack(classify: Classification) -> Result<String, StepError> {
        super::deliver_slack(classify).await
    }
}

/// The same pipeline deployed with one private queue per step ([`StepQueued`]): `step_queues`
/// opts in, and the macro resolves each step's queue while it expands.
#[pgflow_runtime::flow(slug = "communityThreadsStepQueued", input = Thread, step_queues)]
pub mod community_step_queued {
    use super::{Classification, StepError, Thread};

    /// Slow and variable.
    #[step]
    async fn classify(thread: Thread) -> Result<Classification, StepError> {
        super::classify(thread).await
    }

    /// Fast; only for help threads.
    #[step(depends_on = [classify], slug = "deliverSlack", if = { classify: { route: "help" } })]
    async fn deliver_slack(classify: Classification) -> Result<String, StepError> {
        super::deliver_slack(classify).await
    }
}

/// How a mode deploys its workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// One plain worker with `max_concurrent` 4 on the flow's queue.
    Plain,
    /// A `classify` worker with `max_concurrent` 3 and a `deliverSlack` worker with 1.
    StepQueued,
}

impl Mode {
    /// The concrete flow slug this mode runs.
    pub fn flow_slug(self) -> &'static str {
        match self {
            Mode::Plain => "communityThreadsPlain",
            Mode::StepQueued => "communityThreadsStepQueued",
        }
    }

    /// A human label with the worker layout.
    pub fn label(self) -> &'static str {
        match self {
            Mode::Plain => "plain: one worker, max_concurrent 4, one queue",
            Mode::StepQueued => "step-queued: classify ×3 + deliverSlack ×1, a queue per step",
        }
    }
}

/// What one mode measured.
#[derive(Debug, Clone)]
pub struct ModeReport {
    /// The mode.
    pub mode: Mode,
    /// Runs started.
    pub runs: i64,
    /// Runs completed.
    pub completed: i64,
    /// `deliverSlack` steps that ran (help threads).
    pub delivered: i64,
    /// Of those, the ones that became ready while `classify` still had queued work.
    pub delivered_during_backlog: i64,
    /// p50 of `deliverSlack` ready → done (ms), while `classify` had a backlog.
    pub deliver_p50_ms: f64,
    /// p99 of the same.
    pub deliver_p99_ms: f64,
    /// First run started → last run completed.
    pub makespan: Duration,
}

/// Why a mode could not be measured.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Runs `threads` threads through `mode` on the database at `options` and measures it.
///
/// Starts the mode's workers (they compile the flow), starts every run in one transaction (a
/// burst, so `classify` has a backlog), waits until every run has finished, stops the workers and
/// reads the latencies from the database's own step timestamps: `deliverSlack`'s
/// `step_states.started_at` (the step became ready and its task was queued) to `completed_at`.
///
/// # Errors
/// A database or worker error, or runs that did not all complete within `timeout`.
pub async fn run_mode(
    options: &PgConnectOptions,
    mode: Mode,
    threads: i64,
    timeout: Duration,
) -> Result<ModeReport, BoxError> {
    let pool = |n| {
        PgPoolOptions::new()
            .max_connections(n)
            .connect_with(options.clone())
    };
    let control = pool(2).await?;
    let stop = CancellationToken::new();
    let mut workers = Vec::new();
    let mut pools = Vec::new();
    match mode {
        Mode::Plain => {
            let p = pool(6).await?;
            workers.push(
                Worker::<community_plain::CommunityPlain>::builder(p.clone())
                    .max_concurrent(4)
                    .build()?
                    .spawn(stop.clone())
                    .await?,
            );
            pools.push(p);
        }
        Mode::StepQueued => {
            use community_step_queued::{CommunityStepQueued, Step};
            for (step, max_concurrent) in [(Step::Classify, 3), (Step::DeliverSlack, 1)] {
                let p = pool(6).await?;
                workers.push(
                    StepQueued::<CommunityStepQueued>::worker(step)
                        .builder(p.clone())
                        .max_concurrent(max_concurrent)
                        .build()?
                        .spawn(stop.clone())
                        .await?,
                );
                pools.push(p);
            }
        }
    }

    let slug = mode.flow_slug();
    // One transaction: every thread arrives at once. Every other thread asks a question.
    sqlx::query(
        "select count(*) from (select pgflow.start_flow($1, jsonb_build_object('id', g, 'text', \
         case when g % 2 = 0 then 'how do I retry a step?' else 'shipped it' end)) \
         from generate_series(1, $2) g) r",
    )
    .bind(slug)
    .bind(threads)
    .execute(&control)
    .await?;

    let started = Instant::now();
    let outcome = wait_finished(&control, slug, timeout).await;
    for worker in workers {
        worker.stop().await?;
    }
    for p in pools {
        p.close().await;
    }
    outcome?;
    let makespan = started.elapsed();
    let report = measure(&control, mode).await?;
    control.close().await;
    Ok(ModeReport { makespan, ..report })
}

async fn wait_finished(pool: &PgPool, slug: &str, timeout: Duration) -> Result<(), BoxError> {
    let deadline = Instant::now() + timeout;
    loop {
        let open: i64 = sqlx::query_scalar(
            "select count(*) from pgflow.runs where flow_slug = $1 and status = 'started'",
        )
        .bind(slug)
        .fetch_one(pool)
        .await?;
        if open == 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("{slug}: {open} runs still open after {timeout:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn measure(pool: &PgPool, mode: Mode) -> Result<ModeReport, BoxError> {
    let slug = mode.flow_slug();
    let (runs, completed): (i64, i64) = sqlx::query_as(
        "select count(*), count(*) filter (where status = 'completed') from pgflow.runs where flow_slug = $1",
    )
    .bind(slug)
    .fetch_one(pool)
    .await?;
    // A delivery "during the backlog" became ready before the last classify task was claimed.
    let (delivered, during, p50, p99): (i64, i64, Option<f64>, Option<f64>) = sqlx::query_as(
        "with backlog_end as ( \
           select max(t.started_at) as at from pgflow.step_tasks t \
           where t.flow_slug = $1 and t.step_slug = 'classify'), \
         d as ( \
           select extract(epoch from ss.completed_at - ss.started_at) * 1000 as ms, \
                  ss.started_at < (select at from backlog_end) as during \
           from pgflow.step_states ss \
           where ss.flow_slug = $1 and ss.step_slug = 'deliverSlack' and ss.status = 'completed') \
         select count(*), count(*) filter (where during), \
                percentile_cont(0.5) within group (order by ms) filter (where during), \
                percentile_cont(0.99) within group (order by ms) filter (where during) \
         from d",
    )
    .bind(slug)
    .fetch_one(pool)
    .await?;
    Ok(ModeReport {
        mode,
        runs,
        completed,
        delivered,
        delivered_during_backlog: during,
        deliver_p50_ms: p50.unwrap_or(f64::NAN),
        deliver_p99_ms: p99.unwrap_or(f64::NAN),
        makespan: Duration::ZERO,
    })
}

/// The comparison as a markdown table.
pub fn table(reports: &[ModeReport]) -> String {
    let mut out = String::from(
        "| mode | runs completed | deliverSlack during classify backlog | deliverSlack p50 (ready → done) | p99 | all runs done in |\n\
         |---|---:|---:|---:|---:|---:|\n",
    );
    for r in reports {
        out.push_str(&format!(
            "| {} | {} / {} | {} of {} | {:.0} ms | {:.0} ms | {:.2} s |\n",
            r.mode.label(),
            r.completed,
            r.runs,
            r.delivered_during_backlog,
            r.delivered,
            r.deliver_p50_ms,
            r.deliver_p99_ms,
            r.makespan.as_secs_f64()
        ));
    }
    out
}
