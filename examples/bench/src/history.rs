//! The history scenario: does the worker's per-task cost depend on how much finished history the database
//! holds?
//!
//! In one run: the pgflow-rs worker drains the same burst on an empty database ("early"); then the database
//! grows a large finished history, inserted set-based as the SQL core would have left it (completed runs,
//! step states and tasks, archived PGMQ messages, stopped workers); then the same drains again ("late").
//! Afterwards, on that history, one maintenance sweep, one `release_worker_tasks` of a worker with many
//! historic tasks and one retention batch are timed.

use std::time::{Duration, Instant};

use serde_json::Value;
use uuid::Uuid;

use crate::db::{BenchDb, BenchFlow};
use crate::{drain, AfterDrain, BenchError, Driver, Row};

/// Runs per stopped worker in the synthetic history (each worker served this many consecutive runs).
const RUNS_PER_WORKER: i64 = 1000;
/// The history's finished runs are spread over this many seconds (six days, inside the workers' default
/// seven-day retention, so their maintenance during the late drains finds nothing to prune).
const WINDOW_SECONDS: f64 = 6.0 * 86_400.0;
/// ...ending this long before the growth started.
const WINDOW_END_AGO_SECONDS: f64 = 600.0;
/// Tasks inserted per transaction while growing.
const TASKS_PER_CHUNK: i64 = 100_000;

/// What the scenario measures.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    /// Finished tasks to grow (half of them diamond runs, half map10 runs).
    pub(crate) tasks: u64,
    /// Worker concurrencies (`max_concurrent`) to drain at.
    pub(crate) ks: Vec<usize>,
    /// Tasks per drain.
    pub(crate) drain_tasks: usize,
    /// Drains per flow and K in each phase; the fastest counts (the least disturbed on a shared machine).
    pub(crate) repeat: usize,
    /// The flows to drain (the history always holds both).
    pub(crate) flows: Vec<BenchFlow>,
}

/// One flow and concurrency, drained before and after the growth.
#[derive(Debug, Clone)]
pub(crate) struct Pair {
    flow: BenchFlow,
    k: usize,
    /// Every early drain, in the order run.
    early: Vec<Row>,
    /// Every late drain, in the order run.
    late: Vec<Row>,
}

impl Pair {
    /// The fastest drain's tasks/s.
    fn best(rows: &[Row]) -> f64 {
        rows.iter().map(|r| r.value).fold(f64::NAN, f64::max)
    }

    /// WAL per task of the fastest drain: "kB / full-page images".
    fn wal(rows: &[Row]) -> String {
        rows.iter()
            .max_by(|a, b| a.value.total_cmp(&b.value))
            .and_then(|r| r.wal)
            .map_or(String::new(), |w| {
                format!(
                    "{:.1} kB, {:.2} FPI",
                    w.bytes_per_task / 1024.0,
                    w.fpi_per_task
                )
            })
    }

    fn samples(rows: &[Row]) -> String {
        rows.iter()
            .map(|r| format!("{:.0}", r.value))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// One statement timed on the large history.
#[derive(Debug, Clone)]
pub(crate) struct Timed {
    statement: String,
    /// What the statement ran on, when the statement alone does not say.
    note: String,
    ms: f64,
    result: String,
}

/// How the history was grown.
#[derive(Debug, Clone)]
pub(crate) struct Growth {
    /// `(flow, runs, tasks)` per flow.
    flows: Vec<(BenchFlow, i64, i64)>,
    workers: i64,
    /// A historic worker with as many tasks as any other, and how many it has.
    busiest_worker: (Uuid, i64),
    /// Whether the inserts ran the foreign-key checks (they are skipped when the role may skip them).
    fk_checked: bool,
    /// Completed tasks in the database after the growth (counted, not assumed).
    finished_tasks: i64,
    insert: Duration,
    vacuum: Duration,
    sizes: String,
}

/// Everything the scenario found.
#[derive(Debug, Clone)]
pub(crate) struct Report {
    settings: Settings,
    pairs: Vec<Pair>,
    growth: Growth,
    statements: Vec<Timed>,
    load_early: String,
    load_late: String,
    load_end: String,
    elapsed: Duration,
}

/// A step as the finished history records it.
struct HistoryStep {
    slug: &'static str,
    /// Depth in the DAG: tasks of level `n` are queued `n` × 10 ms after their run started.
    level: i32,
    tasks: i32,
    map: bool,
    /// Nothing depends on it: its output is part of the run's output.
    leaf: bool,
}

const fn step(slug: &'static str, level: i32, tasks: i32, map: bool, leaf: bool) -> HistoryStep {
    HistoryStep {
        slug,
        level,
        tasks,
        map,
        leaf,
    }
}

/// `a → (b, c) → d`.
const DIAMOND: &[HistoryStep] = &[
    step("a", 0, 1, false, false),
    step("b", 1, 1, false, false),
    step("c", 1, 1, false, false),
    step("d", 2, 1, false, true),
];

/// One root map step over ten elements.
const MAP10: &[HistoryStep] = &[step("double", 0, 10, true, true)];

fn history_steps(flow: BenchFlow) -> &'static [HistoryStep] {
    match flow {
        BenchFlow::Diamond => DIAMOND,
        BenchFlow::Map10 => MAP10,
    }
}

/// The run input of history run `i` (SQL over the series column `i`), of the flow's input type.
fn input_sql(flow: BenchFlow) -> &'static str {
    match flow {
        BenchFlow::Diamond => "to_jsonb(i)",
        BenchFlow::Map10 => {
            "(select jsonb_agg(i * 10 + e order by e) from generate_series(1, 10) e)"
        }
    }
}

/// A map task's element (SQL over `i` and the task index `k`): element `k` of the run input.
fn element_sql(flow: BenchFlow) -> &'static str {
    match flow {
        BenchFlow::Diamond => "null::jsonb",
        BenchFlow::Map10 => "to_jsonb(i * 10 + k + 1)",
    }
}

/// A task's output: a small JSON object (about 100 bytes) like a typical handler result, different for
/// every task.
fn output_sql(step: &str, index: &str) -> String {
    format!(
        "jsonb_build_object('ok', true, 'item', i, 'label', {step} || '-' || {index}, \
         'checksum', md5(i::text || {step} || {index}))"
    )
}

/// A step's output: its task's output, or for a map step the array of its tasks' outputs.
fn step_output_sql() -> String {
    format!(
        "case when s.map then (select jsonb_agg({} order by k) from generate_series(0, s.tasks - 1) k) \
         else {} end",
        output_sql("s.slug", "k"),
        output_sql("s.slug", "0")
    )
}

/// The steps as `s(slug, level, tasks, map, leaf, pos)`, bound as `$1` to `$6`.
const STEPS_FROM: &str =
    "unnest($1::text[], $2::int[], $3::int[], $4::bool[], $5::bool[], $6::int[]) \
                          as s(slug, level, tasks, map, leaf, pos)";

/// The first load average figure of `/proc/loadavg` (empty where there is none).
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap_or_default()
}

/// Runs the scenario: early drains, growth, late drains, then the statements on the history.
pub(crate) async fn run(db: &BenchDb, settings: &Settings) -> Result<Report, BenchError> {
    let started = Instant::now();
    let mut pairs: Vec<Pair> = settings
        .flows
        .iter()
        .flat_map(|&flow| {
            settings.ks.iter().map(move |&k| Pair {
                flow,
                k,
                early: Vec::new(),
                late: Vec::new(),
            })
        })
        .collect();

    // Each round drains every flow and K once, so the repeats of one measurement are spread over the phase.
    let load_early = load_average();
    for _ in 0..settings.repeat.max(1) {
        for pair in &mut pairs {
            let (flow, k) = (pair.flow, pair.k);
            let row = drain_once(db, flow, k, settings.drain_tasks, AfterDrain::DeleteFlow).await?;
            eprintln!(
                "history, early: {} K={k}: {:.0} tasks/s; {}; WAL {}",
                flow.name(),
                row.value,
                row.extra,
                Pair::wal(std::slice::from_ref(&row))
            );
            pair.early.push(row);
        }
    }

    let growth = grow(db, settings.tasks).await?;

    let load_late = load_average();
    for _ in 0..settings.repeat.max(1) {
        for pair in &mut pairs {
            let (flow, k) = (pair.flow, pair.k);
            let row = drain_once(db, flow, k, settings.drain_tasks, AfterDrain::Keep).await?;
            eprintln!(
                "history, late: {} K={k}: {:.0} tasks/s; {}; WAL {}",
                flow.name(),
                row.value,
                row.extra,
                Pair::wal(std::slice::from_ref(&row))
            );
            pair.late.push(row);
        }
    }
    let load_end = load_average();

    let statements = time_statements(db, growth.busiest_worker).await?;

    // On a server of the caller's, leave the database as empty as every other scenario does; a throwaway
    // cluster goes away at exit anyway (deleting the history takes half a minute).
    if !db.is_throwaway() {
        let t = Instant::now();
        for flow in [BenchFlow::Diamond, BenchFlow::Map10] {
            crate::cleanup(db, flow.slug()).await?;
        }
        sqlx::query("delete from pgflow.workers where function_name = 'bench-history'")
            .execute(&db.pool)
            .await?;
        eprintln!(
            "history: deleted the history in {:.1} s",
            t.elapsed().as_secs_f64()
        );
    }

    Ok(Report {
        settings: settings.clone(),
        pairs,
        growth,
        statements,
        load_early,
        load_late,
        load_end,
        elapsed: started.elapsed(),
    })
}

async fn drain_once(
    db: &BenchDb,
    flow: BenchFlow,
    k: usize,
    tasks: usize,
    after: AfterDrain,
) -> Result<Row, BenchError> {
    let driver = Driver::Worker { max_concurrent: k };
    drain(db, flow, driver, tasks, after)
        .await
        .map_err(|e| match e {
            BenchError::Invalid(m) => {
                BenchError::Invalid(format!("history: {} drain K={k}: {m}", flow.name()))
            }
            e => e,
        })
}

/// Grows the finished history to `tasks` tasks, half of them in diamond runs and half in map10 runs, then
/// vacuums and analyses the tables (what autovacuum does on a long-running database).
async fn grow(db: &BenchDb, tasks: u64) -> Result<Growth, BenchError> {
    let t = Instant::now();
    let now: f64 = sqlx::query_scalar("select extract(epoch from now())::float8")
        .fetch_one(&db.pool)
        .await?;
    let start = now - WINDOW_END_AGO_SECONDS - WINDOW_SECONDS;
    // The rows are consistent by construction; checking every foreign key of a million rows one row at a
    // time would take most of the growth. A role that may (a superuser) skips those checks.
    let skip_fk: bool = sqlx::query_scalar("select current_setting('is_superuser') = 'on'")
        .fetch_one(&db.pool)
        .await?;
    let nonce = Uuid::new_v4().simple().to_string();
    let mut flows = Vec::new();
    let mut workers = 0;
    for flow in [BenchFlow::Diamond, BenchFlow::Map10] {
        let per_run = flow.tasks_per_run() as i64;
        let runs = (tasks as i64 / 2) / per_run;
        workers += grow_flow(db, flow, &history_key(&nonce, flow), runs, start, skip_fk).await?;
        flows.push((flow, runs, runs * per_run));
    }
    // The first worker of the flow with the most tasks per run served RUNS_PER_WORKER whole runs: no
    // historic worker has more tasks.
    let busiest = flows
        .iter()
        .filter(|f| f.1 > 0)
        .max_by_key(|f| f.0.tasks_per_run())
        .map(|f| f.0)
        .unwrap_or(BenchFlow::Map10);
    let worker: Uuid = sqlx::query_scalar("select md5($1 || ':w:0')::uuid")
        .bind(history_key(&nonce, busiest))
        .fetch_one(&db.pool)
        .await?;
    let worker_tasks: i64 =
        sqlx::query_scalar("select count(*) from pgflow.step_tasks where last_worker_id = $1")
            .bind(worker)
            .fetch_one(&db.pool)
            .await?;
    let insert = t.elapsed();
    eprintln!(
        "history: inserted {} finished tasks in {:.1} s",
        flows.iter().map(|f| f.2).sum::<i64>(),
        insert.as_secs_f64()
    );

    let t = Instant::now();
    let archives = [BenchFlow::Diamond, BenchFlow::Map10]
        .map(|f| format!("pgmq.\"a_{}\"", f.slug().to_lowercase()))
        .join(", ");
    sqlx::query(&format!(
        "vacuum (analyze) pgflow.runs, pgflow.step_states, pgflow.step_tasks, pgflow.workers, {archives}"
    ))
    .execute(&db.pool)
    .await?;
    sqlx::query("checkpoint").execute(&db.pool).await?;
    let vacuum = t.elapsed();

    let finished_tasks: i64 =
        sqlx::query_scalar("select count(*) from pgflow.step_tasks where status = 'completed'")
            .fetch_one(&db.pool)
            .await?;
    let sizes: String = sqlx::query_scalar(
        "select string_agg(format('%s %s', t, pg_size_pretty(pg_total_relation_size(t::regclass))), ', ' order by o) \
         from unnest($1::text[]) with ordinality as x(t, o)",
    )
    .bind(
        [
            "pgflow.step_tasks",
            "pgflow.step_states",
            "pgflow.runs",
        ]
        .into_iter()
        .map(str::to_owned)
        .chain(
            [BenchFlow::Diamond, BenchFlow::Map10]
                .map(|f| format!("pgmq.a_{}", f.slug().to_lowercase())),
        )
        .collect::<Vec<_>>(),
    )
    .fetch_one(&db.pool)
    .await?;
    eprintln!(
        "history: {finished_tasks} finished tasks; vacuumed and analysed in {:.1} s; sizes: {sizes}",
        vacuum.as_secs_f64()
    );
    Ok(Growth {
        flows,
        workers,
        busiest_worker: (worker, worker_tasks),
        fk_checked: !skip_fk,
        finished_tasks,
        insert,
        vacuum,
        sizes,
    })
}

/// The seed of one flow's synthetic ids (run ids and worker ids are md5 digests of it and a number).
fn history_key(nonce: &str, flow: BenchFlow) -> String {
    format!("{nonce}:{}", flow.slug())
}

/// Inserts `runs` completed runs of `flow`, finished between `start` and the end of the window, with their
/// step states, tasks, archived messages and the stopped workers that ran them; returns the workers
/// inserted. `skip_fk`: the chunks run with `session_replication_role = replica` (no foreign-key checks).
async fn grow_flow(
    db: &BenchDb,
    flow: BenchFlow,
    key: &str,
    runs: i64,
    start: f64,
    skip_fk: bool,
) -> Result<i64, BenchError> {
    let slug = flow.slug();
    let queue = slug.to_lowercase();
    db.compile(slug, &flow.shape()).await?;
    let steps = history_steps(flow);
    let per_run = flow.tasks_per_run() as i64;
    let gap = WINDOW_SECONDS / runs.max(1) as f64;
    let run_seconds = f64::from(steps.iter().map(|s| s.level).max().unwrap_or(0) + 1) * 0.01;
    let slugs: Vec<&str> = steps.iter().map(|s| s.slug).collect();
    let levels: Vec<i32> = steps.iter().map(|s| s.level).collect();
    let counts: Vec<i32> = steps.iter().map(|s| s.tasks).collect();
    let maps: Vec<bool> = steps.iter().map(|s| s.map).collect();
    let leaves: Vec<bool> = steps.iter().map(|s| s.leaf).collect();
    let positions: Vec<i32> = steps
        .iter()
        .scan(0, |pos, s| {
            let p = *pos;
            *pos += s.tasks;
            Some(p)
        })
        .collect();

    // The workers that ran the history: one per RUNS_PER_WORKER consecutive runs, stopped long ago.
    let workers = (runs + RUNS_PER_WORKER - 1) / RUNS_PER_WORKER;
    sqlx::query(
        "insert into pgflow.workers (worker_id, queue_name, function_name, started_at, \
                                     last_heartbeat_at, stopped_at) \
         select md5($1 || ':w:' || w)::uuid, $2, 'bench-history', to_timestamp($3 + w * $4 * $5), \
                least(now(), to_timestamp($3 + (w + 1) * $4 * $5)), least(now(), to_timestamp($3 + (w + 1) * $4 * $5)) \
         from generate_series(0, $6 - 1) w",
    )
    .bind(key)
    .bind(&queue)
    .bind(start)
    .bind(RUNS_PER_WORKER as f64)
    .bind(gap)
    .bind(workers)
    .execute(&db.pool)
    .await?;

    // Message ids the queue has not handed out, and never will: the sequence moves past them.
    let sequence = format!("pgmq.q_{queue}");
    let base: i64 = sqlx::query_scalar("select nextval(pg_get_serial_sequence($1, 'msg_id'))")
        .bind(&sequence)
        .fetch_one(&db.pool)
        .await?;
    sqlx::query("select setval(pg_get_serial_sequence($1, 'msg_id'), $2)")
        .bind(&sequence)
        .bind(base + runs * per_run - 1)
        .execute(&db.pool)
        .await?;

    let runs_sql = format!(
        "insert into pgflow.runs (run_id, flow_slug, status, input, output, remaining_steps, started_at, \
                                  completed_at) \
         select md5($7 || ':r:' || i)::uuid, $8, 'completed', {input}, \
                (select jsonb_object_agg(s.slug, {output}) from {STEPS_FROM} where s.leaf), 0, \
                to_timestamp($9 + i * $10), to_timestamp($9 + i * $10) + make_interval(secs => $13) \
         from generate_series($11::bigint, $12::bigint) i",
        input = input_sql(flow),
        output = step_output_sql(),
    );
    let states_sql = format!(
        "insert into pgflow.step_states (flow_slug, run_id, step_slug, status, remaining_tasks, initial_tasks, \
                                         remaining_deps, output, created_at, started_at, completed_at) \
         select $8, md5($7 || ':r:' || i)::uuid, s.slug, 'completed', 0, s.tasks, 0, {output}, \
                t.at, t.at + s.level * interval '10 ms', t.at + s.level * interval '10 ms' + interval '9 ms' \
         from generate_series($11::bigint, $12::bigint) i \
         cross join {STEPS_FROM} \
         cross join lateral (select to_timestamp($9 + i * $10) as at) t \
         order by i, s.pos",
        output = step_output_sql(),
    );
    let tasks_sql = format!(
        "with tasks as ( \
           insert into pgflow.step_tasks (flow_slug, run_id, step_slug, message_id, task_index, status, \
                                          attempts_count, output, queued_at, started_at, completed_at, \
                                          last_worker_id, queue_name, element) \
           select $8, md5($7 || ':r:' || i)::uuid, s.slug, $13 + i * $14 + s.pos + k, k, 'completed', 1, \
                  {output}, q.at, q.at + interval '4 ms', q.at + interval '9 ms', \
                  md5($7 || ':w:' || (i / $15))::uuid, $16, case when s.map then {element} end \
           from generate_series($11::bigint, $12::bigint) i \
           cross join {STEPS_FROM} \
           cross join lateral generate_series(0, s.tasks - 1) k \
           cross join lateral (select to_timestamp($9 + i * $10) + s.level * interval '10 ms' as at) q \
           order by i, s.pos, k \
           returning run_id, step_slug, task_index, message_id, queued_at, started_at, completed_at) \
         insert into pgmq.\"a_{queue}\" (msg_id, read_ct, enqueued_at, last_read_at, archived_at, vt, message) \
         select message_id, 1, queued_at, started_at, completed_at, started_at + interval '62 seconds', \
                jsonb_build_object('flow_slug', $8::text, 'run_id', run_id, 'step_slug', step_slug, \
                                   'task_index', task_index) \
         from tasks",
        output = output_sql("s.slug", "k"),
        element = element_sql(flow),
    );

    let chunk = (TASKS_PER_CHUNK / per_run).max(1);
    let mut lo = 0;
    while lo < runs {
        let hi = (lo + chunk).min(runs) - 1;
        let mut tx = db.pool.begin().await?;
        if skip_fk {
            sqlx::query("set local session_replication_role = replica")
                .execute(&mut *tx)
                .await?;
        }
        for (n, sql) in [&runs_sql, &states_sql, &tasks_sql].into_iter().enumerate() {
            // $1..$6 the steps, $7 the key, $8 the flow, $9 start, $10 gap, $11..$12 the runs, then
            // the statement's own.
            let mut q = sqlx::query(sql)
                .bind(&slugs)
                .bind(&levels)
                .bind(&counts)
                .bind(&maps)
                .bind(&leaves)
                .bind(&positions)
                .bind(key)
                .bind(slug)
                .bind(start)
                .bind(gap)
                .bind(lo)
                .bind(hi);
            q = match n {
                0 => q.bind(run_seconds),
                1 => q,
                _ => q
                    .bind(base)
                    .bind(per_run)
                    .bind(RUNS_PER_WORKER)
                    .bind(&queue),
            };
            q.execute(&mut *tx).await?;
        }
        tx.commit().await?;
        lo = hi + 1;
    }
    eprintln!(
        "history: {} runs of {slug} ({} tasks), {workers} workers",
        runs,
        runs * per_run
    );
    Ok(workers)
}

/// Times one statement (one round trip; its result as JSON text).
async fn timed(
    db: &BenchDb,
    statement: &str,
    note: String,
    arg: Option<Uuid>,
) -> Result<Timed, BenchError> {
    let sql = format!("select to_jsonb({statement})");
    let query = sqlx::query_scalar(&sql);
    let query = match arg {
        Some(id) => query.bind(id),
        None => query,
    };
    let t = Instant::now();
    let result: Value = query.fetch_one(&db.pool).await?;
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    eprintln!("history: {statement}: {ms:.1} ms; {result}");
    Ok(Timed {
        statement: statement.to_owned(),
        note,
        ms,
        result: result.to_string(),
    })
}

/// One maintenance sweep, one `release_worker_tasks` of a historic worker with many tasks, one retention
/// batch; each must stay cheap however large the history is.
async fn time_statements(db: &BenchDb, worker: (Uuid, i64)) -> Result<Vec<Timed>, BenchError> {
    let mut out = vec![
        timed(
            db,
            "pgflow.run_maintenance(dead_after => '10 seconds', retain_for => '7 days')",
            "one sweep: stalled and dead-worker recovery, one retention batch (nothing older than 7 days)"
                .into(),
            None,
        )
        .await?,
        timed(
            db,
            "pgflow.release_worker_tasks($1)",
            format!("a stopped worker with {} finished tasks", worker.1),
            Some(worker.0),
        )
        .await?,
    ];
    let prune = timed(
        db,
        "pgflow.prune_history(interval '0 seconds', 1000)",
        "one batch: the 1000 oldest finished runs, their tasks and messages, older archived messages, \
         unreferenced stopped workers"
            .into(),
        None,
    )
    .await?;
    let pruned: Value = serde_json::from_str(&prune.result).unwrap_or_default();
    if pruned["runs"].as_i64() != Some(1000) {
        return Err(BenchError::Invalid(format!(
            "history: prune_history deleted {} instead of 1000 runs",
            prune.result
        )));
    }
    out.push(prune);
    Ok(out)
}

impl Report {
    /// The scenario's markdown section.
    pub(crate) fn print(&self) {
        let g = &self.growth;
        println!(
            "\n### History: drains with no history and with {} finished tasks\n",
            g.finished_tasks
        );
        let flows: Vec<String> = g
            .flows
            .iter()
            .map(|(f, runs, tasks)| format!("{runs} {} runs ({tasks} tasks)", f.name()))
            .collect();
        println!(
            "- history: {}, finished over the {:.0} days before the growth, run by {} stopped workers; \
             inserted in {:.1} s ({}), then vacuumed and analysed in {:.1} s; {} finished tasks counted",
            flows.join(" and "),
            WINDOW_SECONDS / 86_400.0,
            g.workers,
            g.insert.as_secs_f64(),
            if g.fk_checked {
                "foreign keys checked"
            } else {
                "foreign-key checks skipped"
            },
            g.vacuum.as_secs_f64(),
            g.finished_tasks
        );
        println!("- sizes after the growth: {}", g.sizes);
        println!(
            "- drains: {} tasks each, one pgflow-rs worker (defaults, `max_concurrent` = K), {} per flow and K in \
             each phase, the fastest counts; late drains keep their runs, so the history grows by one drain \
             each time",
            self.settings.drain_tasks,
            self.settings.repeat.max(1)
        );
        println!(
            "- load average (1 min) before the early drains {}, before the late drains {}, after them {}; \
             scenario {:.0} s\n",
            self.load_early,
            self.load_late,
            self.load_end,
            self.elapsed.as_secs_f64()
        );
        println!(
            "| flow | K | early (empty) | late ({} finished tasks) | late ÷ early | ms per task, early → late | WAL per task, early → late | all drains, early; late (tasks/s) |",
            g.finished_tasks
        );
        println!("|---|---:|---:|---:|---:|---:|---:|---|");
        for p in &self.pairs {
            let (early, late) = (Pair::best(&p.early), Pair::best(&p.late));
            println!(
                "| {} | {} | {early:.0} tasks/s | {late:.0} tasks/s | {:.2} | {:.2} → {:.2} | {} → {} | {}; {} |",
                p.flow.name(),
                p.k,
                late / early,
                1000.0 / early,
                1000.0 / late,
                Pair::wal(&p.early),
                Pair::wal(&p.late),
                Pair::samples(&p.early),
                Pair::samples(&p.late)
            );
        }
        println!("\n| on the large history | ms | what | result |");
        println!("|---|---:|---|---|");
        for s in &self.statements {
            println!(
                "| `{}` | {:.1} | {} | `{}` |",
                s.statement, s.ms, s.note, s.result
            );
        }
    }
}
