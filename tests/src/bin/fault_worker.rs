//! Runs a worker for `mixedFlow` on the database URL given as the only argument, until killed, with fast
//! heartbeats and maintenance: the fault tests start several and kill them with SIGKILL under load.

use std::time::Duration;

use pgflow_runtime::Worker;
use pgflow_tests::mixed_flow::MixedFlow;

#[tokio::main]
async fn main() {
    let url = std::env::args()
        .nth(1)
        .expect("usage: fault_worker <database-url>");
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(&url)
        .await
        .expect("connect");
    Worker::<MixedFlow>::builder(pool)
        .max_concurrent(8)
        .poll_interval(Duration::from_millis(10))
        .max_poll_wait(Duration::from_millis(50))
        .heartbeat_interval(Duration::from_millis(100))
        .dead_worker_timeout(Some(Duration::from_millis(600)))
        .maintenance_interval(Some(Duration::from_millis(200)))
        .worker_name("fault-worker")
        .build()
        .expect("valid config")
        .run_until_signal()
        .await
        .expect("worker");
}
