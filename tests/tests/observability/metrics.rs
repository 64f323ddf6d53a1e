//! Metrics through the `metrics` facade, served by `serve_prometheus` and read with an HTTP scrape.

use std::sync::OnceLock;
use std::time::Duration;

use pgflow_runtime::observability::{self, record_queue_stats};
use pgflow_runtime::{flow, Client, StepContext, StepError, Worker};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::{spawn, stop, LIMIT};

#[flow(slug = "metricsFlow", input = i64, max_attempts = 3, base_delay = 0)]
mod metered {
    use super::*;

    #[step]
    async fn first(n: i64) -> Result<i64, StepError> {
        Ok(n + 1)
    }

    /// Fails on its first attempt, asking for an immediate retry.
    #[step(depends_on = [first])]
    async fn second(first: i64, ctx: &StepContext<Metered>) -> Result<i64, StepError> {
        if ctx.attempt() == 1 {
            return Err(StepError::msg("not yet").retry_after(Duration::ZERO));
        }
        Ok(first * 2)
    }
}

/// The exporter's address, installed once per process.
fn exporter() -> std::net::SocketAddr {
    static ADDR: OnceLock<std::net::SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| {
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port");
        observability::serve_prometheus(addr).expect("the exporter installs");
        addr
    })
}

/// `GET /metrics` over plain HTTP/1.1; the body.
async fn scrape(addr: std::net::SocketAddr) -> String {
    let mut stream = tokio::time::timeout(LIMIT, tokio::net::TcpStream::connect(addr))
        .await
        .expect("connects in time")
        .expect("the exporter listens");
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut response = String::new();
    tokio::time::timeout(LIMIT, stream.read_to_string(&mut response))
        .await
        .expect("answers in time")
        .unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    response
}

/// The value of the sample `name` whose labels include every one of `labels`.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?;
        let (labels_part, value) = match rest.strip_prefix('{') {
            Some(r) => r.split_once("} ")?,
            None => ("", rest.strip_prefix(' ')?),
        };
        labels
            .iter()
            .all(|(k, v)| labels_part.split(',').any(|l| l == format!("{k}=\"{v}\"")))
            .then(|| value.trim().parse().ok())?
    })
}

#[tokio::test]
async fn a_scrape_shows_per_step_counters_histograms_gauges_and_queue_depth() {
    let addr = exporter();
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    let worker = spawn(Worker::<metered::Metered>::builder(pool.clone())).await;
    let run = Client::new(pool.clone())
        .start::<metered::Metered>(&20)
        .await
        .unwrap();
    let out = run.wait(LIMIT).await.unwrap();
    assert_eq!(out.second, 42);
    stop(worker).await;
    record_queue_stats(pool).await.unwrap();

    let text = scrape(addr).await;
    let step = |s: &'static str| {
        [
            ("flow", "metricsFlow"),
            ("step", s),
            ("queue", "metricsflow"),
        ]
    };
    let get = |name: &str, labels: &[(&str, &str)]| {
        sample(&text, name, labels).unwrap_or_else(|| panic!("no {name} {labels:?} in:\n{text}"))
    };
    assert_eq!(get(observability::TASKS_CLAIMED, &step("first")), 1.0);
    assert_eq!(get(observability::TASKS_CLAIMED, &step("second")), 2.0);
    assert_eq!(get(observability::TASKS_COMPLETED, &step("first")), 1.0);
    assert_eq!(get(observability::TASKS_COMPLETED, &step("second")), 1.0);
    assert_eq!(get(observability::TASKS_RETRIED, &step("second")), 1.0);
    assert_eq!(get(observability::TASKS_FAILED, &step("second")), 0.0);
    assert_eq!(get(observability::STALE_RESULTS, &step("first")), 0.0);
    let handler_count = format!("{}_count", observability::HANDLER_DURATION);
    assert_eq!(get(&handler_count, &step("second")), 2.0);
    let wait_count = format!("{}_count", observability::QUEUE_WAIT);
    assert_eq!(get(&wait_count, &step("first")), 1.0);
    let queue = [("queue", "metricsflow")];
    assert!(get(&format!("{}_count", observability::CLAIM_DURATION), &queue) >= 1.0);
    let claimed_batches = get(
        &format!("{}_sum", observability::EXCHANGE_BATCH),
        &[("queue", "metricsflow"), ("part", "claimed")],
    );
    assert_eq!(claimed_batches, 3.0, "three tasks claimed in all");
    assert_eq!(get(observability::TASKS_IN_FLIGHT, &queue), 0.0);
    assert_eq!(get(observability::UNRECORDED_RESULTS, &queue), 0.0);
    assert_eq!(get(observability::DEFERRED_READS, &queue), 0.0);
    assert_eq!(get(observability::QUEUE_DEPTH, &queue), 0.0);
    assert_eq!(get(observability::QUEUE_OLDEST_AGE, &queue), 0.0);
    // Bounded cardinality: no run id anywhere in the labels.
    assert!(!text.contains(&run.run_id().to_string()));
}
