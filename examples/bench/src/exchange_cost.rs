//! What one `pgflow.exchange` costs by its size (`--only exchange`; runs only when named).
//!
//! One client on one connection drives the diamond flow by hand, one exchange at a time, with nothing else
//! running: it starts `k` runs, claims their `k` root tasks, and then times the exchange that records those
//! `k` outputs and claims the `2k` dependents they make ready (one hop of the diamond for `k` runs at once).
//! The runs are then finished. The sizes take turns, repetition by repetition, so a drift of the host's speed
//! reaches every size alike.
//!
//! The medians give a straight line: the cost of an exchange that carries nothing much (its fixed part) and
//! the cost of each further output with its two claims. Under load the worker runs one exchange at a time,
//! and the outputs that finish during an exchange ride in the next one; so an exchange lasts about
//! `fixed / (1 - arrivals × per_output)`, and each hop of a run waits for up to two of them.

use std::time::Instant;

use serde_json::Value;
use sqlx::{PgConnection, Row as _};
use uuid::Uuid;

use crate::control::{percentile, Figure};
use crate::db::{BenchDb, BenchFlow};
use crate::BenchError;

/// Tasks claimed by one exchange: what the next exchange records.
#[derive(Default)]
struct Claimed {
    run_ids: Vec<Uuid>,
    step_slugs: Vec<String>,
    task_indexes: Vec<i32>,
    attempts: Vec<i32>,
}

impl Claimed {
    fn len(&self) -> usize {
        self.run_ids.len()
    }
}

/// The time of an exchange of each of `sizes` (runs whose root outputs it records), from `reps` repetitions
/// of each; with two sizes or more, the fixed cost and the cost per output.
pub(crate) async fn run(
    db: &BenchDb,
    sizes: &[usize],
    reps: usize,
) -> Result<Vec<Figure>, BenchError> {
    if sizes.is_empty() || sizes.contains(&0) || reps == 0 {
        return Err(BenchError::Invalid(
            "exchange cost: give sizes of 1 or more and at least one repetition".into(),
        ));
    }
    let (mut conn, pairs) = prepare(db).await?;
    let mut times: Vec<Vec<f64>> = vec![Vec::with_capacity(reps); sizes.len()];
    // One untimed round first: plans and caches warm up.
    for rep in 0..=reps {
        for (i, &k) in sizes.iter().enumerate() {
            let ms = hop(db, &mut conn, &pairs, k, false).await?;
            if rep > 0 {
                times[i].push(ms);
            }
        }
    }
    crate::db::stop_worker(&mut conn, pairs.worker).await?;

    let medians: Vec<f64> = times
        .iter_mut()
        .map(|t| {
            t.sort_by(f64::total_cmp);
            percentile(t, 0.5)
        })
        .collect();
    let mut figures: Vec<Figure> = sizes
        .iter()
        .zip(&times)
        .zip(&medians)
        .map(|((&k, t), &median)| Figure {
            what: format!(
                "one exchange recording {k} outputs and claiming {} tasks",
                2 * k
            ),
            value: median,
            unit: "ms p50",
            extra: format!(
                "{} exchanges, one at a time on one connection; p90 {:.2} ms; {:.3} ms per output",
                t.len(),
                percentile(t, 0.9),
                median / k as f64
            ),
        })
        .collect();
    let mut distinct = sizes.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() < 2 {
        return Ok(figures);
    }
    let xs: Vec<f64> = sizes.iter().map(|&k| k as f64).collect();
    let (fixed, per_output) = fit(&xs, &medians);
    figures.push(Figure {
        what: "an exchange's fixed cost (the line through those medians at zero outputs)".into(),
        value: fixed,
        unit: "ms",
        extra: format!(
            "plus {per_output:.3} ms per output with its two claims; round trip and commit included"
        ),
    });
    Ok(figures)
}

/// Every statement one hop's exchange runs, nested ones included (`--only census`; runs only when named):
/// `reps` exchanges that each record `k` root outputs of the diamond and claim their `2k` dependents, as in
/// [`run`], with `pg_stat_statements` counting only while each of them runs. One figure per statement, the
/// heaviest first: its mean time per exchange (inclusive: a statement's time contains the statements it
/// calls), its executions per exchange and its longest execution (one slow execution moves a mean). The
/// first figure is the exchange itself. Before the statements, one figure per function of schema `pgflow`
/// the exchange calls (`track_functions`, counting only while the exchange runs): its own time and its time
/// with the functions it calls, per exchange. A function's own time holds what no statement's time does:
/// `pg_stat_statements` times a statement from the start of its run, so the executor start-up and end of
/// every statement the function runs count only there. Tracking costs time of its own, so the figures are
/// shares more than durations; the exchange's median untracked, from the same number of hops just before,
/// is given with them.
pub(crate) async fn census(db: &BenchDb, k: usize, reps: usize) -> Result<Vec<Figure>, BenchError> {
    if k == 0 || reps == 0 {
        return Err(BenchError::Invalid(
            "give a size of 1 or more and at least one repetition".into(),
        ));
    }
    let loaded: bool = sqlx::query_scalar(
        "select current_setting('shared_preload_libraries') ~ '(^|[ ,])pg_stat_statements([ ,]|$)'",
    )
    .fetch_one(&db.pool)
    .await?;
    if !loaded {
        return Err(BenchError::Invalid(
            "the server does not load pg_stat_statements. Leave DATABASE_URL unset (the bench's own \
             cluster loads it for --only census), or add pg_stat_statements to shared_preload_libraries of \
             the server and restart it"
                .into(),
        ));
    }
    sqlx::query("create extension if not exists pg_stat_statements")
        .execute(&db.pool)
        .await?;
    let (mut conn, pairs) = prepare(db).await?;
    // Untracked first: plans and caches warm up, and the exchange's own median.
    let mut plain = Vec::with_capacity(reps);
    for _ in 0..reps {
        plain.push(hop(db, &mut conn, &pairs, k, false).await?);
    }
    plain.sort_by(f64::total_cmp);
    sqlx::query(
        "select pg_stat_statements_reset(0, (select oid from pg_database where datname = current_database()), 0)",
    )
    .execute(&mut conn)
    .await?;
    let before = function_times(&mut conn).await?;
    let mut tracked = Vec::with_capacity(reps);
    for _ in 0..reps {
        tracked.push(hop(db, &mut conn, &pairs, k, true).await?);
    }
    tracked.sort_by(f64::total_cmp);
    let after = function_times(&mut conn).await?;
    crate::db::stop_worker(&mut conn, pairs.worker).await?;
    let rows: Vec<(i64, f64, f64, String)> = sqlx::query_as(
        "select s.calls, s.total_exec_time, s.max_exec_time, s.query from pg_stat_statements s \
         where s.dbid = (select oid from pg_database where datname = current_database()) \
           and s.query !~* '^set pg_stat_statements' \
         order by s.total_exec_time desc",
    )
    .fetch_all(&mut conn)
    .await?;
    let n = reps as f64;
    let mut figures = vec![Figure {
        what: format!("census of one exchange recording {k} outputs and claiming {} tasks", 2 * k),
        value: percentile(&plain, 0.5),
        unit: "ms p50",
        extra: format!(
            "{reps} exchanges untracked; then {reps} tracked, p50 {:.2} ms: the rows below, in µs per exchange",
            percentile(&tracked, 0.5)
        ),
    }];
    // The functions: a function's times hold what no statement's time does, the executor start-up and end
    // of every statement it runs (pg_stat_statements times a statement from its run on).
    let mut functions: Vec<(String, i64, f64, f64)> = after
        .into_iter()
        .filter_map(|(name, (calls, total, own))| {
            let (c0, t0, o0) = before.get(&name).copied().unwrap_or((0, 0.0, 0.0));
            (calls > c0).then(|| (name, calls - c0, total - t0, own - o0))
        })
        .collect();
    functions.sort_by(|a, b| b.3.total_cmp(&a.3));
    figures.extend(
        functions
            .into_iter()
            .map(|(name, calls, total_ms, own_ms)| Figure {
                what: format!("census, function: {name}"),
                value: own_ms * 1000.0 / n,
                unit: "µs own",
                extra: format!(
                    "{:.2} calls per exchange; {:.0} µs per exchange with the functions it calls",
                    calls as f64 / n,
                    total_ms * 1000.0 / n
                ),
            }),
    );
    figures.extend(
        rows.into_iter()
            .map(|(calls, total_ms, max_ms, query)| Figure {
                what: format!("census: {}", statement_label(&query)),
                value: total_ms * 1000.0 / n,
                unit: "µs",
                extra: format!(
                    "{:.2} executions per exchange, {:.0} µs each on average, the longest {:.0} µs",
                    calls as f64 / n,
                    total_ms * 1000.0 / calls.max(1) as f64,
                    max_ms * 1000.0
                ),
            }),
    );
    Ok(figures)
}

/// Every function of schema `pgflow` this database has timed so far: its calls and its total and own times
/// in ms, by name. This session's counts are flushed first, so that they are in.
async fn function_times(
    conn: &mut PgConnection,
) -> Result<std::collections::HashMap<String, (i64, f64, f64)>, BenchError> {
    sqlx::query("select pg_stat_force_next_flush()")
        .execute(&mut *conn)
        .await?;
    // The flush happens when the transaction that asked for it ends; this reads in a new one.
    let rows: Vec<(String, i64, f64, f64)> = sqlx::query_as(
        "select f.schemaname || '.' || f.funcname, f.calls, f.total_time, f.self_time \
         from pg_stat_user_functions f where f.schemaname = 'pgflow'",
    )
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(name, calls, total, own)| (name, (calls, total, own)))
        .collect())
}

/// A statement's text on one line, short enough for a table cell, without the characters that would end it.
fn statement_label(query: &str) -> String {
    const LONGEST: usize = 110;
    let mut line = String::new();
    for word in query
        .lines()
        .map(|l| l.split("--").next().unwrap_or(""))
        .flat_map(str::split_whitespace)
    {
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    let mut label: String = line.chars().take(LONGEST).collect();
    if line.chars().count() > LONGEST {
        label.push('…');
    }
    label.replace('|', "\\|")
}

/// The diamond compiled, a worker registered, and a connection of its own: what every hop needs.
async fn prepare(db: &BenchDb) -> Result<(PgConnection, Pairs), BenchError> {
    let flow = BenchFlow::Diamond;
    db.compile(flow.slug(), &flow.shape()).await?;
    let queue = flow.slug().to_lowercase();
    let worker = db.register_worker(&queue).await?;
    db.settle().await?;
    let conn = db.connect().await?;
    let pairs = Pairs {
        queue,
        worker,
        flows: vec![flow.slug().to_string(); 4],
        steps: ["a", "b", "c", "d"].map(String::from).to_vec(),
    };
    Ok((conn, pairs))
}

/// The queue and the worker the exchanges claim for.
struct Pairs {
    queue: String,
    worker: Uuid,
    flows: Vec<String>,
    steps: Vec<String>,
}

/// One hop for `k` new runs: the time of the exchange that records the root outputs and claims the
/// dependents. The runs are finished before it returns. With `track`, `pg_stat_statements` counts the
/// statements of that exchange, and of nothing else this connection runs.
async fn hop(
    db: &BenchDb,
    conn: &mut PgConnection,
    pairs: &Pairs,
    k: usize,
    track: bool,
) -> Result<f64, BenchError> {
    let flow = BenchFlow::Diamond;
    let runs = db.start_runs(flow.slug(), &flow.input(), k).await?;
    let roots = exchange(conn, pairs, k, &Claimed::default()).await?;
    expect(&roots, k, "root tasks")?;
    if track {
        sqlx::raw_sql("set pg_stat_statements.track = 'all'; set track_functions = 'all'")
            .execute(&mut *conn)
            .await?;
    }
    let began = Instant::now();
    let dependents = exchange(conn, pairs, 2 * k, &roots).await;
    let ms = began.elapsed().as_secs_f64() * 1000.0;
    if track {
        sqlx::raw_sql("set pg_stat_statements.track = 'none'; set track_functions = 'none'")
            .execute(&mut *conn)
            .await?;
    }
    let dependents = dependents?;
    expect(&dependents, 2 * k, "dependents")?;
    let last = exchange(conn, pairs, k, &dependents).await?;
    expect(&last, k, "last steps")?;
    exchange(conn, pairs, 0, &last).await?;
    db.verify_completed(&runs).await?;
    Ok(ms)
}

fn expect(claimed: &Claimed, n: usize, what: &str) -> Result<(), BenchError> {
    if claimed.len() == n {
        Ok(())
    } else {
        Err(BenchError::Invalid(format!(
            "exchange cost: claimed {} {what}, expected {n} (is another client draining the queue?)",
            claimed.len()
        )))
    }
}

/// Records `done` (each output is `1`) and claims up to `qty` tasks, in one `pgflow.exchange`.
async fn exchange(
    conn: &mut PgConnection,
    pairs: &Pairs,
    qty: usize,
    done: &Claimed,
) -> Result<Claimed, BenchError> {
    let outputs = vec![Value::from(1); done.len()];
    let rows = sqlx::query(
        "select x.run_id, x.step_slug, x.task_index, x.attempts_count
         from pgflow.exchange($1, $2, $3, $4, $5, 30, $6, $7, $8, $9, $10) x
         where x.outcome = 'claimed'",
    )
    .bind(&pairs.queue)
    .bind(pairs.worker)
    .bind(&pairs.flows)
    .bind(&pairs.steps)
    .bind(qty as i32)
    .bind(&done.run_ids)
    .bind(&done.step_slugs)
    .bind(&done.task_indexes)
    .bind(&outputs)
    .bind(&done.attempts)
    .fetch_all(&mut *conn)
    .await?;
    let mut claimed = Claimed::default();
    for row in rows {
        claimed.run_ids.push(row.try_get("run_id")?);
        claimed.step_slugs.push(row.try_get("step_slug")?);
        claimed.task_indexes.push(row.try_get("task_index")?);
        claimed.attempts.push(row.try_get("attempts_count")?);
    }
    Ok(claimed)
}

/// Least squares line through `(x, y)`: (intercept, slope).
fn fit(x: &[f64], y: &[f64]) -> (f64, f64) {
    let n = x.len() as f64;
    let mean_x = x.iter().sum::<f64>() / n;
    let mean_y = y.iter().sum::<f64>() / n;
    let sxy: f64 = x
        .iter()
        .zip(y)
        .map(|(a, b)| (a - mean_x) * (b - mean_y))
        .sum();
    let sxx: f64 = x.iter().map(|a| (a - mean_x).powi(2)).sum();
    let slope = sxy / sxx;
    (mean_y - slope * mean_x, slope)
}

#[cfg(test)]
mod tests {
    use super::fit;

    #[test]
    fn the_line_through_points_on_a_line_is_that_line() {
        let (a, b) = fit(&[1.0, 4.0, 16.0, 32.0], &[3.5, 5.0, 11.0, 19.0]);
        assert!((a - 3.0).abs() < 1e-9, "{a}");
        assert!((b - 0.5).abs() < 1e-9, "{b}");
    }
}
