//! The two-stage community-threads pipeline (a slow `classify` step feeding a fast `deliverSlack`
//! step) run in plain mode and in per-step-queue mode, with the starvation comparison.
//!
//! `cargo run -p pgflow-examples --bin community_threads [-- --threads 200]`
//!
//! `classify` is slow and variable (20–80 ms); `deliverSlack` is fast and runs only for threads
//! classified `help`. A burst of threads arrives at once, so `classify` has a backlog. In plain
//! mode every task shares one queue, so a ready delivery waits behind the classify backlog; in
//! step-queued mode `deliverSlack` has its own queue and worker, with the same total capacity
//! (4 handlers). The program prints how long deliveries waited (ready → done, from the
//! database's step timestamps) in each mode, and fails unless every run completed.
//!
//! With `DATABASE_URL` unset it uses a throwaway PostgreSQL, removed at exit. Errors are printed
//! as one line (for example, which package to install when PostgreSQL is missing).

use std::process::ExitCode;
use std::time::Duration;

use pgflow_examples::community::{run_mode, table, BoxError, Mode};
use pgflow_sql::throwaway::{fresh_database, Contents};

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("community_threads: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), BoxError> {
    let mut threads: i64 = 200;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        match (flag.as_str(), args.next()) {
            ("--threads", Some(n)) => threads = n.parse()?,
            _ => return Err("usage: community_threads [--threads N]".into()),
        }
    }

    let db = fresh_database(Contents::Empty).await?;
    pgflow_sql::install(db.pool()).await?;
    println!("database ready; {threads} threads per mode, every other one a question\n");

    let mut reports = Vec::new();
    for mode in [Mode::Plain, Mode::StepQueued] {
        let report = run_mode(&db.options(), mode, threads, Duration::from_secs(120)).await?;
        println!(
            "{}: {} of {} runs completed in {:.2} s",
            mode.label(),
            report.completed,
            report.runs,
            report.makespan.as_secs_f64()
        );
        reports.push(report);
    }
    println!("\n{}", table(&reports));
    if let Some(r) = reports.iter().find(|r| r.completed != r.runs) {
        return Err(format!(
            "{}: {} of {} runs completed",
            r.mode.label(),
            r.completed,
            r.runs
        )
        .into());
    }
    if let [plain, stepped] = &reports[..] {
        println!(
            "deliverSlack p99 while classify is backlogged: {:.0} ms plain vs {:.0} ms step-queued ({:.1}x)",
            plain.deliver_p99_ms,
            stepped.deliver_p99_ms,
            plain.deliver_p99_ms / stepped.deliver_p99_ms
        );
    }
    Ok(())
}
