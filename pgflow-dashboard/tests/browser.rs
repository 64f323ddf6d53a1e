//! The dashboard in a real browser: headless Chromium through WebDriver (chromedriver, started here on a free
//! port) against two real dashboards (one writable, mounted under `/ops`; one read-only, hiding payloads) over a throwaway
//! PostgreSQL, with a real worker running the test flow. Saves a screenshot of each view in the test's target directory
//! (`target/tmp/dashboard-screenshots/`), or in `docs/dashboard/` (the README's pictures) with
//! `PGFLOW_UPDATE_SCREENSHOTS=1`.
//!
//! Needs Debian's `chromium` and `chromium-driver` (`.ci/run` installs them).
#![allow(unreachable_pub)] // flow input types appear in the generated (public) flow items

use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use fantoccini::{Client as Browser, ClientBuilder, Locator};
use pgflow_dashboard::Dashboard;
use pgflow_runtime::{flow, Client, StepContext, StepError, Worker};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

/// Set when the failed run may succeed on retry.
static HEALED: AtomicBool = AtomicBool::new(false);

/// The test flow's input.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Job {
    /// A name to filter on.
    pub label: String,
    /// `ok`, `fail` (until healed) or `sleep` (until cancelled).
    pub mode: String,
}

#[flow(slug = "dashFlow", input = Job, max_attempts = 1, base_delay = 0, timeout = 120)]
mod dash_flow {
    use super::*;

    /// Three elements; fails or sleeps as the job asks.
    #[step]
    async fn prepare(job: Job, ctx: &StepContext<DashFlow>) -> Result<Vec<u32>, StepError> {
        match job.mode.as_str() {
            "fail" if !HEALED.load(Ordering::SeqCst) => {
                return Err(StepError::terminal(format!(
                    "prepare refused {}: <script>alert('x')</script>",
                    job.label
                )))
            }
            "sleep" => {
                tokio::select! {
                    () = ctx.cancellation().cancelled() => {}
                    () = tokio::time::sleep(Duration::from_secs(60)) => {}
                }
            }
            _ => {}
        }
        Ok(vec![1, 2, 3])
    }

    /// Ten times each element.
    #[step(map = prepare)]
    async fn each(x: u32) -> Result<u32, StepError> {
        Ok(x * 10)
    }

    /// The sum.
    #[step(depends_on = [each])]
    async fn finish(each: Vec<u32>) -> Result<u32, StepError> {
        Ok(each.iter().sum())
    }
}

use dash_flow::DashFlow;

const TOKEN: &str = "test-write-token";
const LIMIT: Duration = Duration::from_secs(20);

/// chromedriver in a process group of its own, killed with the browsers it started on drop (also when the
/// test panics: killing chromedriver alone would leave Chromium running).
struct Driver(Child);

impl Drop for Driver {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.0.id()) {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|dir| PathBuf::from(dir).join(program))
        .find(|p| p.is_file())
}

async fn start_browser() -> (Driver, Browser) {
    let chromium = which("chromium").unwrap_or_else(|| {
        panic!(
            "the dashboard's browser test needs Chromium: `chromium` is not on PATH. \
             Install it with `apt-get install chromium chromium-driver` (Debian), as .ci/run does"
        )
    });
    let driver_bin = which("chromedriver").unwrap_or_else(|| {
        panic!(
            "the dashboard's browser test needs chromedriver: `chromedriver` is not on PATH. \
             Install it with `apt-get install chromium-driver` (Debian), as .ci/run does"
        )
    });
    let port = free_port();
    let driver = Driver(
        Command::new(driver_bin)
            .arg(format!("--port={port}"))
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver starts"),
    );
    pgflow_tests::wait_until(LIMIT, "chromedriver to listen", || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    })
    .await;
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        json!({
            "binary": chromium,
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1400,1000", "--force-device-scale-factor=1"],
        }),
    );
    let browser = ClientBuilder::native()
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{port}"))
        .await
        .expect("a headless Chromium session");
    (driver, browser)
}

/// Serves `router` on a free port.
async fn serve(router: axum::Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    addr
}

/// Polls `check` (every 100 ms) until it returns `Some`; panics naming `what` after the limit.
async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + LIMIT;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {LIMIT:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The element matching `css`, waiting (up to the limit) for a page that has it to load.
async fn el(b: &Browser, css: &str) -> fantoccini::elements::Element {
    b.wait()
        .at_most(LIMIT)
        .for_element(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("no `{css}` on the page within {LIMIT:?}: {e}"))
}

/// Clicks `css`, finding it again when a refresh of the page's live part replaced it in between.
async fn click(b: &Browser, css: &str) {
    eventually(&format!("a click on `{css}`"), || async {
        el(b, css).await.click().await.ok()
    })
    .await;
}

async fn js(b: &Browser, script: &str) -> Value {
    b.execute(script, vec![]).await.expect("script runs")
}

async fn count(b: &Browser, css: &str) -> usize {
    b.find_all(Locator::Css(css)).await.map_or(0, |v| v.len())
}

async fn attr(b: &Browser, css: &str, name: &str) -> Option<String> {
    b.find(Locator::Css(css))
        .await
        .ok()?
        .attr(name)
        .await
        .ok()?
}

async fn screenshot(b: &Browser, name: &str) {
    let png = b.screenshot().await.expect("a screenshot");
    let dir = if std::env::var_os("PGFLOW_UPDATE_SCREENSHOTS").is_some() {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/dashboard")
    } else {
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard-screenshots")
    };
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(name), png).unwrap();
}

async fn run_status(pool: &sqlx::PgPool, run: uuid::Uuid) -> String {
    sqlx::query_scalar("select status from pgflow.runs where run_id = $1")
        .bind(run)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_browser_watches_runs_opens_one_cancels_and_retries_and_a_read_only_dashboard_refuses_writes(
) {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool().clone();
    let shutdown = CancellationToken::new();
    let worker = Worker::<DashFlow>::builder(pool.clone())
        .poll_interval(Duration::from_millis(10))
        .max_poll_wait(Duration::from_millis(50))
        .heartbeat_interval(Duration::from_millis(200))
        .cancel_grace(Duration::from_millis(300))
        .build()
        .expect("valid worker config")
        .spawn(shutdown.clone())
        .await
        .expect("the worker starts");
    let writable = serve(axum::Router::new().nest(
        "/ops",
        Dashboard::new(pool.clone()).write_token(TOKEN).router(),
    ))
    .await;
    let read_only = serve(Dashboard::new(pool.clone()).hide_payloads(true).router()).await;
    let w = format!("http://{writable}/ops");
    let r = format!("http://{read_only}");
    let (_driver, b) = start_browser().await;
    let client = Client::new(pool.clone());

    // 1. Runs appear without a reload.
    b.goto(&format!("{w}/runs")).await.unwrap();
    assert_eq!(count(&b, "tr[data-run]").await, 0);
    js(&b, "window.__noReload = true; return null;").await;
    let job = |label: &str, mode: &str| Job {
        label: label.into(),
        mode: mode.into(),
    };
    let mut ok = Vec::new();
    for i in 0..3 {
        ok.push(
            client
                .start::<DashFlow>(&job(&format!("ok{i}"), "ok"))
                .await
                .unwrap(),
        );
    }
    let failing = client.start::<DashFlow>(&job("bad", "fail")).await.unwrap();
    let sleeping = client
        .start::<DashFlow>(&job("nap", "sleep"))
        .await
        .unwrap();
    for run in &ok {
        run.wait(LIMIT).await.unwrap();
    }
    let _ = failing.wait(LIMIT).await;
    eventually("five runs listed without a reload", || async {
        (count(&b, "tr[data-run]").await == 5).then_some(())
    })
    .await;
    assert_eq!(
        js(&b, "return window.__noReload === true;").await,
        json!(true),
        "the page reloaded"
    );
    eventually("counts of 3 completed and 1 failed", || async {
        let completed = b
            .find(Locator::Css("a.count[data-status=completed] .n"))
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        let failed = b
            .find(Locator::Css("a.count[data-status=failed] .n"))
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        (completed == "3" && failed == "1").then_some(())
    })
    .await;
    screenshot(&b, "runs.png").await;

    // Filters: by status, and by an input value at a JSON path.
    b.goto(&format!("{w}/runs?status=failed")).await.unwrap();
    assert_eq!(count(&b, "tr[data-run]").await, 1);
    b.goto(&format!("{w}/runs?path=label&value=ok1"))
        .await
        .unwrap();
    assert_eq!(count(&b, "tr[data-run]").await, 1);

    // 2. The failed run: its DAG and its task's error, as text.
    b.goto(&format!("{w}/runs/{}", failing.run_id()))
        .await
        .unwrap();
    assert_eq!(
        attr(&b, "#run-status", "data-status").await.as_deref(),
        Some("failed")
    );
    assert_eq!(count(&b, "svg.dag g.node").await, 3);
    assert_eq!(
        count(&b, "svg.dag g.node.st-failed[data-step=prepare]").await,
        1
    );
    let error = el(&b, ".task-error").await.text().await.unwrap();
    assert!(
        error.contains("prepare refused bad: <script>alert('x')</script>"),
        "{error}"
    );
    assert_eq!(
        count(&b, "main script").await,
        0,
        "the error's markup was not escaped"
    );
    screenshot(&b, "run.png").await;

    // 3. Cancel the sleeping run: sign in, confirm, and see it cancelled.
    eventually("the sleeping run's handler to start", || async {
        let started: bool = sqlx::query_scalar(
            "select exists (select 1 from pgflow.step_tasks where run_id = $1 and status = 'started')",
        )
        .bind(sleeping.run_id())
        .fetch_one(&pool)
        .await
        .unwrap();
        started.then_some(())
    })
    .await;
    b.goto(&format!("{w}/runs/{}", sleeping.run_id()))
        .await
        .unwrap();
    click(&b, "#cancel").await;
    el(&b, "#actor").await.send_keys("alice").await.unwrap();
    el(&b, "#token").await.send_keys("wrong").await.unwrap();
    click(&b, "#signin").await;
    assert!(
        b.wait()
            .at_most(LIMIT)
            .for_element(Locator::Css("#login-error"))
            .await
            .is_ok(),
        "a wrong token is refused"
    );
    el(&b, "#actor").await.send_keys("alice").await.unwrap();
    el(&b, "#token").await.send_keys(TOKEN).await.unwrap();
    click(&b, "#signin").await;
    eventually("signed in, back on the confirmation page", || async {
        b.current_url()
            .await
            .ok()?
            .path()
            .ends_with("/cancel")
            .then_some(())
    })
    .await;
    el(&b, "input[name=reason]")
        .await
        .send_keys("from the browser test")
        .await
        .unwrap();
    click(&b, "#confirm").await;
    eventually("the run page to show the run cancelled", || async {
        (attr(&b, "#run-status", "data-status").await.as_deref() == Some("cancelled")).then_some(())
    })
    .await;
    assert_eq!(run_status(&pool, sleeping.run_id()).await, "cancelled");

    // 4. Retry the failed run and watch it complete (the page refreshes itself).
    HEALED.store(true, Ordering::SeqCst);
    b.goto(&format!("{w}/runs/{}", failing.run_id()))
        .await
        .unwrap();
    click(&b, "#retry").await;
    click(&b, "#confirm").await;
    eventually("the retried run to complete on its page", || async {
        (attr(&b, "#run-status", "data-status").await.as_deref() == Some("completed")).then_some(())
    })
    .await;
    eventually("the map's progress 3/3 in the DAG", || async {
        let text = b
            .find(Locator::Css("svg.dag g.node[data-step=each]"))
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        text.contains("3/3").then_some(())
    })
    .await;
    // The retried task shows both its attempts: the failed one (hatched, with its error) and the one that
    // completed.
    eventually(
        "both attempts of the retried task on the timeline",
        || async { (count(&b, "tr[data-task='prepare[0]'] .bar.run").await == 2).then_some(()) },
    )
    .await;
    assert_eq!(
        count(
            &b,
            "tr[data-task='prepare[0]'] .bar.run.earlier[data-outcome=run_retried]"
        )
        .await,
        1
    );
    assert_eq!(
        count(
            &b,
            "tr[data-task='prepare[0]'] .bar.run.current.st-completed"
        )
        .await,
        1
    );
    let earlier = el(&b, "tr[data-task='prepare[0]'] li.earlier-attempt")
        .await
        .text()
        .await
        .unwrap();
    assert!(
        earlier.contains("run_retried") && earlier.contains("prepare refused bad"),
        "{earlier}"
    );
    screenshot(&b, "run-retried.png").await;

    // Both actions are in the operator record, by alice.
    let actions: Vec<(String, String, bool)> = sqlx::query_as(
        "select actor, action, succeeded from pgflow.operator_actions order by action_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        actions,
        [
            ("alice".into(), "cancel".into(), true),
            ("alice".into(), "retry".into(), true)
        ]
    );

    // Replay the retried run from its map step: a new run, which completes and links back.
    eventually("the replay's step to be chosen", || async {
        let select = el(&b, ".actions select[name=step]").await;
        select.select_by_value("each").await.ok()
    })
    .await;
    click(&b, "#replay").await;
    click(&b, "#confirm").await;
    eventually("the replay's page to show it completed", || async {
        (attr(&b, "#run-status", "data-status").await.as_deref() == Some("completed")).then_some(())
    })
    .await;
    eventually(
        "the new run's page, linking back to the replayed run",
        || async {
            let source = b.source().await.ok()?;
            (source.contains("Replay of") && source.contains(&failing.run_id().to_string()))
                .then_some(())
        },
    )
    .await;
    eventually("the replay to complete on its page", || async {
        (attr(&b, "#run-status", "data-status").await.as_deref() == Some("completed")).then_some(())
    })
    .await;

    // Schedules: pause and resume one, each confirmed and recorded.
    pgflow_runtime::schedules::Schedule::new("nightly-report", "dashFlow", "0 3 * * *")
        .input(json!({"label": "nightly", "mode": "ok"}))
        .set(&pool)
        .await
        .unwrap();
    b.goto(&format!("{w}/schedules")).await.unwrap();
    assert_eq!(
        attr(&b, "tr[data-schedule=nightly-report]", "data-paused")
            .await
            .as_deref(),
        Some("false")
    );
    click(&b, "a.pause-resume").await;
    click(&b, "#confirm").await;
    eventually("the schedule shown paused", || async {
        (attr(&b, "tr[data-schedule=nightly-report]", "data-paused")
            .await
            .as_deref()
            == Some("true"))
        .then_some(())
    })
    .await;
    screenshot(&b, "schedules.png").await;
    click(&b, "a.pause-resume").await;
    click(&b, "#confirm").await;
    eventually("the schedule shown active again", || async {
        (attr(&b, "tr[data-schedule=nightly-report]", "data-paused")
            .await
            .as_deref()
            == Some("false"))
        .then_some(())
    })
    .await;
    let paused: bool = sqlx::query_scalar(
        "select paused from pgflow.schedules where schedule_name = 'nightly-report'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(!paused);

    // The other views.
    b.goto(&format!("{w}/queues")).await.unwrap();
    assert!(count(&b, "tr[data-queue]").await >= 1);
    screenshot(&b, "queues.png").await;
    b.goto(&format!("{w}/workers")).await.unwrap();
    assert_eq!(
        count(&b, "tr[data-worker]").await,
        1,
        "{}",
        b.source().await.unwrap()
    );
    screenshot(&b, "workers.png").await;

    // A read-only dashboard: no write buttons, and a forged POST is refused.
    b.goto(&format!("{r}/runs/{}", ok[0].run_id()))
        .await
        .unwrap();
    assert_eq!(
        attr(&b, "#run-status", "data-status").await.as_deref(),
        Some("completed")
    );
    assert_eq!(count(&b, "#cancel, #retry, #replay, .actions").await, 0);
    assert!(b.source().await.unwrap().contains("read-only"));
    // It hides payloads too: no input or output on the page.
    assert_eq!(count(&b, "#run-input, #run-output").await, 0);
    assert!(b.source().await.unwrap().contains("Payloads are hidden"));
    let status = js(
        &b,
        &format!(
            "return fetch('/runs/{}/replay', {{method: 'POST', headers: {{'content-type': \
             'application/x-www-form-urlencoded'}}, body: 'confirm=yes&step=prepare&csrf=x'}}).then(r => r.status);",
            ok[0].run_id()
        ),
    )
    .await;
    assert_eq!(status, json!(403));
    // No page of the dashboard can be framed by another (a confirmation clicked through a frame).
    let framing = js(
        &b,
        "return fetch('/runs').then(r => [r.headers.get('x-frame-options'), \
         r.headers.get('content-security-policy')]);",
    )
    .await;
    assert_eq!(framing, json!(["DENY", "frame-ancestors 'none'"]));

    // A cross-site POST to the writable dashboard (from the read-only one's origin) changes nothing.
    let victim = client
        .start::<DashFlow>(&job("victim", "sleep"))
        .await
        .unwrap();
    js(
        &b,
        &format!(
            "return fetch('{w}/runs/{}/cancel', {{method: 'POST', mode: 'no-cors', credentials: 'include', \
             headers: {{'content-type': 'application/x-www-form-urlencoded'}}, body: 'confirm=yes'}}).then(() => null, () => null);",
            victim.run_id()
        ),
    )
    .await;
    // The script returns the fetch's promise, which WebDriver awaits: the server has answered the forged
    // request by now.
    assert_eq!(run_status(&pool, victim.run_id()).await, "started");
    let recorded: i64 = sqlx::query_scalar("select count(*) from pgflow.operator_actions")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(recorded, 5, "the forged request left no record");
    victim.cancel(Some("test over")).await.unwrap();

    b.close().await.unwrap();
    shutdown.cancel();
    worker.stop().await.unwrap();
}
