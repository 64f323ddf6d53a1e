//! Runs a worker for `crashFlow` on the database URL given as the only argument, until killed.
//! Its tasks block forever; the integration tests kill it with SIGKILL mid-task.

use std::sync::atomic::Ordering;
use std::time::Duration;

use pgflow_runtime::Worker;
use pgflow_tests::crash_flow::{CrashFlow, BLOCK};

#[tokio::main]
async fn main() {
    BLOCK.store(true, Ordering::SeqCst);
    let url = std::env::args()
        .nth(1)
        .expect("usage: crashy_worker <database-url>");
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .expect("connect");
    Worker::<CrashFlow>::builder(pool)
        .poll_interval(Duration::from_millis(10))
        .max_poll_wait(Duration::from_millis(50))
        .maintenance_interval(None)
        .build()
        .expect("valid config")
        .run_until_signal()
        .await
        .expect("worker");
}
