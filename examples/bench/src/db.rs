//! The benchmark's database: one durable server, one database, helpers shared by every scenario.

use std::time::Duration;

use pgflow_sql::throwaway::{Durability, TempPostgres};
use serde_json::{json, Value};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions as _, Connection as _, PgConnection, PgPool};
use uuid::Uuid;

use crate::BenchError;

/// The server and the benchmark's own database on it.
pub(crate) struct BenchDb {
    /// Keeps the throwaway cluster alive (removed on drop or exit).
    temp: Option<TempPostgres>,
    /// The server's connection, outside the bench's database (to drop it at the end).
    admin: PgConnectOptions,
    /// The bench's database.
    name: String,
    pub(crate) options: PgConnectOptions,
    pub(crate) pool: PgPool,
    pub(crate) server_version: String,
    pub(crate) settings: String,
    /// Whether function timing is on.
    pub(crate) profile: bool,
}

/// Starts `$3` runs of flow `$1` with input `$2` in one `pgflow.start_flows` call → their ids: how every
/// harness starts its runs (at most 200 per statement).
pub(crate) const START_RUNS: &str =
    "select run_id from pgflow.start_flows($1, array_fill($2::jsonb, array[$3]))";

/// WAL the benchmark's own cluster writes and keeps for reuse before it measures anything.
const WARM_WAL: &str = "512MB";

/// Gives a new cluster the WAL files of a server that has been running: `WARM_WAL` of them, written once and
/// kept for reuse (`min_wal_size`). A new cluster has one WAL file and creates each next one when the last
/// fills up, writing 16 MB of zeros and syncing them while every commit waits: at the latency scenarios' rates,
/// a stall of about 100 ms every second or so. A server that has run for a while recycles its old files
/// instead (checkpoints rename them), as it does here after this.
async fn warm_wal(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query(&format!("alter system set min_wal_size = '{WARM_WAL}'"))
        .execute(&mut *conn)
        .await?;
    sqlx::query("select pg_reload_conf()")
        .execute(&mut *conn)
        .await?;
    let target: i64 = sqlx::query_scalar("select pg_size_bytes($1)")
        .bind(WARM_WAL)
        .fetch_one(&mut *conn)
        .await?;
    let start: String = sqlx::query_scalar("select pg_current_wal_insert_lsn()::text")
        .fetch_one(&mut *conn)
        .await?;
    sqlx::query("create table bench_wal_warmup (pad text)")
        .execute(&mut *conn)
        .await?;
    loop {
        let written: i64 =
            sqlx::query_scalar("select (pg_current_wal_insert_lsn() - $1::pg_lsn)::bigint")
                .bind(&start)
                .fetch_one(&mut *conn)
                .await?;
        if written >= target {
            break;
        }
        // Incompressible-enough rows (no TOAST compression gain), 16 MB of WAL per statement.
        sqlx::query(
            "insert into bench_wal_warmup select repeat(md5(g::text), 60) from generate_series(1, 8000) g",
        )
        .execute(&mut *conn)
        .await?;
    }
    sqlx::query("drop table bench_wal_warmup")
        .execute(&mut *conn)
        .await?;
    // Two checkpoints: the files before the first one's start are recycled by the second.
    for _ in 0..2 {
        sqlx::query("select pg_switch_wal()")
            .execute(&mut *conn)
            .await?;
        sqlx::query("checkpoint").execute(&mut *conn).await?;
    }
    Ok(())
}

impl BenchDb {
    /// `DATABASE_URL`'s server when set, otherwise a durable throwaway cluster; a new database on it with
    /// PGMQ and pgflow installed. With `trace_context`, every run started in it gets that W3C trace context
    /// (the database default of the setting `pgflow.trace_context`), so every task attempt is a span. With
    /// `statements` (the census), the throwaway cluster loads `pg_stat_statements`, and sessions of the new
    /// database count nothing unless they ask to (`pg_stat_statements.track = 'none'`).
    pub(crate) async fn open(
        profile: bool,
        trace_context: Option<&str>,
        statements: bool,
    ) -> Result<Self, BenchError> {
        let (temp, admin) = match std::env::var("DATABASE_URL") {
            Ok(url) if !url.is_empty() => (None, url.parse::<PgConnectOptions>()?),
            _ => {
                let temp = TempPostgres::start(Durability::Durable).await?;
                let admin = temp.url("postgres").parse::<PgConnectOptions>()?;
                if statements {
                    let mut conn = PgConnection::connect_with(&admin).await?;
                    sqlx::query("alter system set shared_preload_libraries = 'pg_stat_statements'")
                        .execute(&mut conn)
                        .await?;
                    conn.close().await?;
                    temp.restart().await?;
                }
                (Some(temp), admin)
            }
        };
        let admin = admin.disable_statement_logging();
        let name = format!("pgflow_bench_{:08x}", std::process::id());
        let mut conn = PgConnection::connect_with(&admin).await?;
        sqlx::query(&format!("drop database if exists \"{name}\" with (force)"))
            .execute(&mut conn)
            .await?;
        sqlx::query(&format!("create database \"{name}\""))
            .execute(&mut conn)
            .await?;
        if profile {
            // Sessions opened from now on time every PL function (pg_stat_user_functions).
            sqlx::query(&format!(
                "alter database \"{name}\" set track_functions = 'pl'"
            ))
            .execute(&mut conn)
            .await?;
        }
        if statements {
            sqlx::query(&format!(
                "alter database \"{name}\" set pg_stat_statements.track = 'none'"
            ))
            .execute(&mut conn)
            .await?;
        }
        if let Some(ctx) = trace_context {
            sqlx::query(&format!(
                "alter database \"{name}\" set pgflow.trace_context = '{}'",
                ctx.replace('\'', "''")
            ))
            .execute(&mut conn)
            .await?;
        }
        if temp.is_some() {
            warm_wal(&mut conn).await?;
        }
        conn.close().await?;
        let options = admin.clone().database(&name);
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(60))
            .connect_with(options.clone())
            .await?;
        pgflow_sql::install(&pool).await?;
        let server_version: String = sqlx::query_scalar("select version()")
            .fetch_one(&pool)
            .await?;
        let settings: String = sqlx::query_scalar(
            "select string_agg(name || '=' || setting, ', ' order by name) from pg_settings \
             where name in ('fsync', 'synchronous_commit', 'full_page_writes', 'shared_buffers', 'max_connections', \
             'min_wal_size')",
        )
        .fetch_one(&pool)
        .await?;
        Ok(BenchDb {
            temp,
            admin,
            name,
            options,
            pool,
            server_version,
            settings,
            profile,
        })
    }

    /// Drops the bench's database on a server given by `DATABASE_URL` (the throwaway cluster goes as a whole
    /// at exit), after closing the bench's connections to it.
    pub(crate) async fn remove(self) -> Result<(), BenchError> {
        self.pool.close().await;
        if self.temp.is_none() {
            let mut conn = PgConnection::connect_with(&self.admin).await?;
            sqlx::query(&format!(
                "drop database if exists \"{}\" with (force)",
                self.name
            ))
            .execute(&mut conn)
            .await?;
            conn.close().await?;
        }
        Ok(())
    }

    /// Whether the server is the benchmark's own throwaway cluster (removed at exit with everything on it).
    pub(crate) fn is_throwaway(&self) -> bool {
        self.temp.is_some()
    }

    /// The pgflow and PGMQ functions by time spent in themselves since the last `pg_stat_reset()`,
    /// per task, as a markdown table.
    pub(crate) async fn function_profile(&self, tasks: usize) -> Result<String, sqlx::Error> {
        // Backends report their function statistics when they go idle or exit.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let rows: Vec<(String, i64, f64, f64)> = sqlx::query_as(
            "select schemaname || '.' || funcname, calls, total_time, self_time from pg_stat_user_functions \
             where schemaname in ('pgflow', 'pgmq') order by self_time desc limit 12",
        )
        .fetch_all(&self.pool)
        .await?;
        let mut out = String::from("| function | calls per task | total µs per task | self µs per task |\n|---|---:|---:|---:|\n");
        for (name, calls, total, own) in rows {
            let t = tasks as f64;
            out.push_str(&format!(
                "| {name} | {:.2} | {:.0} | {:.0} |\n",
                calls as f64 / t,
                total * 1000.0 / t,
                own * 1000.0 / t
            ));
        }
        Ok(out)
    }

    /// A connection of its own (one per benchmark client).
    pub(crate) async fn connect(&self) -> Result<PgConnection, sqlx::Error> {
        PgConnection::connect_with(&self.options).await
    }

    /// Vacuums and analyses the database so one scenario's dead rows do not slow the next.
    pub(crate) async fn settle(&self) -> Result<(), sqlx::Error> {
        sqlx::query("vacuum (analyze)").execute(&self.pool).await?;
        sqlx::query("checkpoint").execute(&self.pool).await?;
        Ok(())
    }

    /// Compiles a flow from its shape JSON.
    pub(crate) async fn compile(&self, slug: &str, shape: &Value) -> Result<(), BenchError> {
        let result: Value = sqlx::query_scalar("select pgflow.ensure_flow_compiled($1, $2)")
            .bind(slug)
            .bind(shape)
            .fetch_one(&self.pool)
            .await?;
        match result["status"].as_str() {
            Some("compiled" | "verified") => Ok(()),
            _ => Err(BenchError::Invalid(format!(
                "ensure_flow_compiled({slug}) returned {result}"
            ))),
        }
    }

    /// Registers a worker row (the claim records the worker id); [`stop_worker`] marks it stopped.
    pub(crate) async fn register_worker(&self, queue: &str) -> Result<Uuid, sqlx::Error> {
        let id = Uuid::new_v4();
        sqlx::query(
            "insert into pgflow.workers (worker_id, queue_name, function_name) values ($1, $2, 'bench')",
        )
        .bind(id)
        .bind(queue)
        .execute(&self.pool)
        .await?;
        Ok(id)
    }

    /// Starts `runs` runs of `slug` with `input`, up to 200 per `pgflow.start_flows` call; returns their ids.
    pub(crate) async fn start_runs(
        &self,
        slug: &str,
        input: &Value,
        runs: usize,
    ) -> Result<Vec<Uuid>, sqlx::Error> {
        self.start_in_statements(START_RUNS, slug, input, runs)
            .await
    }

    /// As [`BenchDb::start_runs`], but with one `pgflow.start_flow` call per run (up to 200 in a statement).
    pub(crate) async fn start_runs_each(
        &self,
        slug: &str,
        input: &Value,
        runs: usize,
    ) -> Result<Vec<Uuid>, sqlx::Error> {
        self.start_in_statements(
            "select (r).run_id from (select pgflow.start_flow($1, $2) as r from generate_series(1, $3)) x",
            slug,
            input,
            runs,
        )
        .await
    }

    /// Runs `sql` (binding slug, input and a count of at most 200) until `runs` runs have started.
    async fn start_in_statements(
        &self,
        sql: &str,
        slug: &str,
        input: &Value,
        runs: usize,
    ) -> Result<Vec<Uuid>, sqlx::Error> {
        let mut ids = Vec::with_capacity(runs);
        let mut left = runs;
        while left > 0 {
            let n = left.min(200);
            let started: Vec<Uuid> = sqlx::query_scalar(sql)
                .bind(slug)
                .bind(input)
                .bind(n as i32)
                .fetch_all(&self.pool)
                .await?;
            ids.extend(started);
            left -= n;
        }
        Ok(ids)
    }

    /// Fails the benchmark unless every run in `run_ids` completed.
    pub(crate) async fn verify_completed(&self, run_ids: &[Uuid]) -> Result<(), BenchError> {
        let (total, completed): (i64, i64) = sqlx::query_as(
            "select count(*), count(*) filter (where status = 'completed') from pgflow.runs where run_id = any ($1)",
        )
        .bind(run_ids)
        .fetch_one(&self.pool)
        .await?;
        if completed != run_ids.len() as i64 {
            return Err(BenchError::Invalid(format!(
                "{completed} of {} runs completed ({total} found); the benchmark is invalid",
                run_ids.len()
            )));
        }
        Ok(())
    }

    /// A summary of where the runs of `slug` are stuck (for an invalid benchmark's error).
    pub(crate) async fn dump_state(&self, slug: &str) -> Result<String, sqlx::Error> {
        let summary: Option<String> = sqlx::query_scalar(
            "select string_agg(what, '; ') from ( \
               select 'runs ' || status || ': ' || count(*) as what from pgflow.runs where flow_slug = $1 group by status \
               union all select 'steps ' || step_slug || ' ' || status || ': ' || count(*) from pgflow.step_states \
                 where flow_slug = $1 group by step_slug, status \
               union all select 'tasks ' || step_slug || ' ' || status || ': ' || count(*) from pgflow.step_tasks \
                 where flow_slug = $1 group by step_slug, status \
               union all select 'started steps with remaining_tasks = 0: ' || count(*) from pgflow.step_states \
                 where flow_slug = $1 and status = 'started' and remaining_tasks = 0 \
             ) x",
        )
        .bind(slug)
        .fetch_one(&self.pool)
        .await?;
        let queue: (i64, i64) = sqlx::query_as(&format!(
            "select count(*) filter (where vt <= now()), count(*) filter (where vt > now()) from pgmq.\"q_{}\"",
            slug.to_lowercase()
        ))
        .fetch_one(&self.pool)
        .await?;
        Ok(format!(
            "{}; queue visible {}, invisible {}",
            summary.unwrap_or_default(),
            queue.0,
            queue.1
        ))
    }

    /// How many runs are open (`started`), and a signature of the work in flight (started step states and
    /// their remaining tasks) that changes whenever a task completes. Nothing else runs during a
    /// scenario, so the open runs are the scenario's. Both counts read only the open work through
    /// indexes on `status`, so polling costs the same however much finished history the database holds.
    pub(crate) async fn progress(&self) -> Result<(i64, (i64, i64)), sqlx::Error> {
        let (open, steps, tasks): (i64, i64, i64) = sqlx::query_as(
            "select (select count(*) from pgflow.runs where status = 'started'), \
                    count(*), coalesce(sum(remaining_tasks), 0) \
             from pgflow.step_states where status = 'started'",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok((open, (steps, tasks)))
    }

    /// WAL written so far: bytes (the insert position) and full-page images (`pg_stat_wal`; backends report
    /// theirs when they go idle or exit).
    pub(crate) async fn wal(&self) -> Result<(i64, i64), sqlx::Error> {
        sqlx::query_as(
            "select (pg_current_wal_insert_lsn() - '0/0')::bigint, (select wal_fpi from pg_stat_wal)",
        )
        .fetch_one(&self.pool)
        .await
    }

    /// p50 and p99 start-to-finish latency (ms) of the completed runs among `run_ids`, from the database's
    /// own timestamps.
    pub(crate) async fn run_latency(&self, run_ids: &[Uuid]) -> Result<RunLatency, sqlx::Error> {
        let (p50, p99, max): (Option<f64>, Option<f64>, Option<f64>) = sqlx::query_as(
            "select percentile_cont(0.5) within group (order by ms), percentile_cont(0.99) within group (order by ms), \
             max(ms) \
             from (select (extract(epoch from completed_at - started_at) * 1000)::float8 as ms \
                   from pgflow.runs where run_id = any ($1) and status = 'completed') x",
        )
        .bind(run_ids)
        .fetch_one(&self.pool)
        .await?;
        type Percentiles = (Option<f64>, Option<f64>, Option<f64>, Option<f64>);
        let (waiting, waiting_p99, running, running_p99): Percentiles = sqlx::query_as(
            "select percentile_cont(0.5) within group (order by w), percentile_cont(0.99) within group (order by w), \
             percentile_cont(0.5) within group (order by r), percentile_cont(0.99) within group (order by r) \
             from (select (extract(epoch from started_at - queued_at) * 1000)::float8 as w, \
                          (extract(epoch from completed_at - started_at) * 1000)::float8 as r \
                   from pgflow.step_tasks where run_id = any ($1) and status = 'completed') x",
        )
        .bind(run_ids)
        .fetch_one(&self.pool)
        .await?;
        let nan = |v: Option<f64>| v.unwrap_or(f64::NAN);
        Ok(RunLatency {
            p50: nan(p50),
            p99: nan(p99),
            max: nan(max),
            task_wait_p50: nan(waiting),
            task_wait_p99: nan(waiting_p99),
            task_claimed_p50: nan(running),
            task_claimed_p99: nan(running_p99),
        })
    }
}

/// Start-to-finish latency of runs, and where a task's time went.
pub(crate) struct RunLatency {
    pub(crate) p50: f64,
    pub(crate) p99: f64,
    pub(crate) max: f64,
    /// Median time a task waited on its queue (`queued_at` → `started_at`, its claim).
    pub(crate) task_wait_p50: f64,
    /// 99th percentile of the same.
    pub(crate) task_wait_p99: f64,
    /// Median time from a task's claim to its recorded output (`started_at` → `completed_at`).
    pub(crate) task_claimed_p50: f64,
    /// 99th percentile of the same.
    pub(crate) task_claimed_p99: f64,
}

/// The flows the benchmark runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BenchFlow {
    /// `a → (b, c) → d`, four tasks per run.
    Diamond,
    /// One root map step over a ten-element array, ten tasks per run.
    Map10,
}

impl BenchFlow {
    pub(crate) fn name(self) -> &'static str {
        match self {
            BenchFlow::Diamond => "diamond",
            BenchFlow::Map10 => "map10",
        }
    }

    pub(crate) fn tasks_per_run(self) -> usize {
        match self {
            BenchFlow::Diamond => 4,
            BenchFlow::Map10 => 10,
        }
    }

    pub(crate) fn shape(self) -> Value {
        use pgflow_runtime::Flow as _;
        match self {
            BenchFlow::Diamond => crate::flows::diamond::Diamond::shape(),
            BenchFlow::Map10 => crate::flows::map10::Map10::shape(),
        }
    }

    pub(crate) fn input(self) -> Value {
        match self {
            BenchFlow::Diamond => json!(1),
            BenchFlow::Map10 => json!([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]),
        }
    }

    /// What the benchmark's handlers return (trivial work: the benchmark measures the engine).
    pub(crate) fn handle(step_slug: &str, input: &Value) -> Value {
        match step_slug {
            "a" => json!(input.as_i64().unwrap_or(0)),
            "b" | "c" => json!(input["a"].as_i64().unwrap_or(0) + 1),
            "d" => json!(input["b"].as_i64().unwrap_or(0) + input["c"].as_i64().unwrap_or(0)),
            _ => json!(input.as_i64().unwrap_or(0) * 2),
        }
    }
}

impl BenchFlow {
    /// The concrete flow slug (its queue is the lower-cased slug).
    pub(crate) fn slug(self) -> &'static str {
        match self {
            BenchFlow::Diamond => "benchDiamond",
            BenchFlow::Map10 => "benchMap10",
        }
    }
}

/// Marks worker `id` stopped, as a worker does when it shuts down (the worker rows the bench registers itself).
/// A row left live counts as a peer of its queue's workers for the liveness window (30 s), and they run fewer
/// exchanges meanwhile.
pub(crate) async fn stop_worker(
    conn: impl sqlx::PgExecutor<'_>,
    id: Uuid,
) -> Result<(), sqlx::Error> {
    sqlx::query("select pgflow.mark_worker_stopped(worker_id => $1)")
        .bind(id)
        .execute(conn)
        .await?;
    Ok(())
}
