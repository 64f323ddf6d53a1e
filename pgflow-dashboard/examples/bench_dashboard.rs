//! The dashboard on a big history: bulk-inserts 1,000,000 runs (`generate_series`) next to a few real ones,
//! then times the run list (unfiltered and filtered, with counts) and a run page, through the read layer and
//! through HTTP, and prints the plans of the list queries (EXPLAIN ANALYZE). The numbers go in BENCHMARKS.md.
//!
//! ```text
//! cargo run -q -p pgflow-sql --features throwaway --bin with-throwaway-postgres -- \
//!     cargo run --release -p pgflow-dashboard --example bench_dashboard [-- RUNS]
//! ```
#![allow(unreachable_pub)] // flow items are public

use std::time::{Duration, Instant};

use pgflow_dashboard::Dashboard;
use pgflow_runtime::admin::{Admin, RunFilter};
use pgflow_runtime::client::RunStatus;
use pgflow_runtime::{flow, Client, Flow, StepError, Worker};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

#[flow(slug = "benchFlow", input = serde_json::Value)]
mod bench_flow {
    use super::*;

    /// Three elements.
    #[step]
    async fn split(_input: serde_json::Value) -> Result<Vec<u32>, StepError> {
        Ok(vec![1, 2, 3])
    }

    /// Doubles each.
    #[step(map = split)]
    async fn each(x: u32) -> Result<u32, StepError> {
        Ok(x * 2)
    }

    /// The sum.
    #[step(depends_on = [each])]
    async fn total(each: Vec<u32>) -> Result<u32, StepError> {
        Ok(each.iter().sum())
    }
}

#[flow(slug = "otherFlow", input = serde_json::Value)]
mod other_flow {
    use super::*;

    /// Nothing.
    #[step]
    async fn only(_input: serde_json::Value) -> Result<u32, StepError> {
        Ok(0)
    }
}

/// The median of `n` timings of `f`, in milliseconds.
async fn median<F, Fut>(n: usize, mut f: F) -> f64
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        f().await;
        times.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    times.sort_by(f64::total_cmp);
    times[n / 2]
}

/// GET `path` over HTTP/1.1; the status and body length.
async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, usize) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    let head = String::from_utf8_lossy(&buf[..buf.len().min(12)]).to_string();
    (head[9..12].parse().unwrap_or(0), buf.len())
}

#[tokio::main]
async fn main() {
    let runs: i64 = std::env::args()
        .nth(1)
        .map_or(1_000_000, |n| n.parse().expect("RUNS is a number"));
    let db = pgflow_tests::test_db().await;
    let pool = db.pool().clone();
    for (slug, shape) in [
        (bench_flow::BenchFlow::SLUG, bench_flow::BenchFlow::shape()),
        (other_flow::OtherFlow::SLUG, other_flow::OtherFlow::shape()),
    ] {
        sqlx::query("select pgflow.ensure_flow_compiled(flow_slug => $1, shape => $2)")
            .bind(slug)
            .bind(shape)
            .execute(&pool)
            .await
            .unwrap();
    }
    sqlx::query("select pgflow.activate_alias('bench', 'benchFlow')")
        .execute(&pool)
        .await
        .unwrap();

    let t = Instant::now();
    sqlx::query(
        "insert into pgflow.runs (flow_slug, status, input, output, remaining_steps, started_at, completed_at, \
                                  failed_at, cancelled_at, cancel_reason) \
         select case when i % 10 = 3 then 'otherFlow' else 'benchFlow' end, s.status, \
                jsonb_build_object('customer', jsonb_build_object('id', i % 5000), 'n', i), \
                case when s.status = 'completed' then '{\"total\": 12}'::jsonb end, 0, s.at, \
                case when s.status = 'completed' then s.at + interval '1 second' end, \
                case when s.status = 'failed' then s.at + interval '1 second' end, \
                case when s.status = 'cancelled' then s.at + interval '1 second' end, \
                case when s.status = 'cancelled' then 'bench' end \
         from generate_series(1, $1) i \
         cross join lateral (select case when i % 50 = 0 then 'failed' when i % 50 = 1 then 'cancelled' \
                                         else 'completed' end as status, \
                                    now() - interval '1 hour' - ($1 - i) * interval '1 second' as at) s",
    )
    .bind(runs)
    .execute(&pool)
    .await
    .unwrap();
    let insert = t.elapsed();
    sqlx::query("vacuum analyze pgflow.runs")
        .execute(&pool)
        .await
        .unwrap();
    println!("inserted {runs} runs in {insert:.1?} (then vacuum analyze)");

    // A few real runs on top, run by a real worker: the newest page and the run page read these.
    let shutdown = CancellationToken::new();
    let worker = Worker::<bench_flow::BenchFlow>::builder(pool.clone())
        .poll_interval(Duration::from_millis(10))
        .build()
        .unwrap()
        .spawn(shutdown.clone())
        .await
        .unwrap();
    let client = Client::new(pool.clone());
    let mut real = Vec::new();
    for i in 0..20 {
        let run = client
            .start::<bench_flow::BenchFlow>(&json!({"customer": {"id": 77_777}, "n": i}))
            .await
            .unwrap();
        real.push(run);
    }
    for run in &real {
        run.wait(Duration::from_secs(60)).await.unwrap();
    }
    worker.stop().await.unwrap();
    let real_run = real[10].run_id();
    let old_run: uuid::Uuid = sqlx::query_scalar(
        "select run_id from pgflow.runs where flow_slug = 'benchFlow' order by started_at limit 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();

    let admin = Admin::new(pool.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = Dashboard::new(pool.clone()).router();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });

    let deep = admin
        .runs(&RunFilter::new().limit(500))
        .await
        .unwrap()
        .next
        .unwrap();
    let cases: Vec<(&str, RunFilter, String)> = vec![
        ("newest page, no filter", RunFilter::new(), "/runs".into()),
        (
            "page 2 (keyset cursor)",
            RunFilter::new().after(deep),
            format!("/runs?after={deep}"),
        ),
        (
            "alias `bench`",
            RunFilter::new().flow("bench"),
            "/runs?flow=bench".into(),
        ),
        (
            "version otherFlow",
            RunFilter::new().version("otherFlow"),
            "/runs?version=otherFlow".into(),
        ),
        (
            "status failed",
            RunFilter::new().status(RunStatus::Failed),
            "/runs?status=failed".into(),
        ),
        (
            "status failed + alias + last 24 h",
            RunFilter::new()
                .status(RunStatus::Failed)
                .flow("bench")
                .started_after(chrono::Utc::now() - chrono::Duration::hours(24)),
            format!(
                "/runs?status=failed&flow=bench&from={}",
                (chrono::Utc::now() - chrono::Duration::hours(24)).format("%Y-%m-%dT%H:%M")
            ),
        ),
        (
            "input customer.id = 77777 (recent match)",
            RunFilter::new().input_equals(["customer", "id"], json!(77_777)),
            "/runs?path=customer.id&value=77777".into(),
        ),
        (
            "input customer.id = 4999 (matches all history)",
            RunFilter::new().input_equals(["customer", "id"], json!(4999)),
            "/runs?path=customer.id&value=4999".into(),
        ),
    ];
    println!("\n| Query ({runs} runs) | runs() ms | run_counts() ms | HTTP page ms |");
    println!("|---|---:|---:|---:|");
    for (name, filter, path) in &cases {
        let list = median(7, || async {
            admin.runs(filter).await.unwrap();
        })
        .await;
        let counts = median(7, || async {
            admin.run_counts(filter).await.unwrap();
        })
        .await;
        let http = median(7, || async {
            let (status, _) = get(addr, path).await;
            assert_eq!(status, 200, "{path}");
        })
        .await;
        println!("| {name} | {list:.1} | {counts:.1} | {http:.1} |");
    }
    for (name, id) in [
        ("real run (3 steps, 5 tasks)", real_run),
        ("bulk run (no steps)", old_run),
    ] {
        let read = median(7, || async {
            admin.run(id).await.unwrap().unwrap();
        })
        .await;
        let http = median(7, || async {
            assert_eq!(get(addr, &format!("/runs/{id}")).await.0, 200);
        })
        .await;
        println!("| run page: {name} | {read:.1} (run()) | | {http:.1} |");
    }

    println!("\nPlans:");
    for (name, sql) in [
        (
            "newest page",
            "select run_id from pgflow.runs r order by r.started_at desc, r.run_id desc limit 51",
        ),
        (
            "status failed",
            "select run_id from pgflow.runs r where r.status = 'failed' order by r.started_at desc, r.run_id desc limit 51",
        ),
        (
            "input customer.id = 77777, newest page",
            "select run_id from pgflow.runs r where r.input @> '{\"customer\": {\"id\": 77777}}' \
             and r.input #> '{customer,id}' = '77777' order by r.started_at desc, r.run_id desc limit 51",
        ),
        (
            "count completed (capped)",
            "select count(*) from (select 1 from pgflow.runs r where r.status = 'completed' limit 10001) x",
        ),
    ] {
        let plan: Vec<String> = sqlx::query_scalar(&format!("explain (analyze, buffers, costs off) {sql}"))
            .fetch_all(&pool)
            .await
            .unwrap();
        println!("-- {name}\n{}", plan.join("\n"));
    }
    shutdown.cancel();
}
