//! Runs a worker with zero configuration, `DATABASE_URL` only, until SIGTERM or ctrl-c:
//! `zero_config_worker step` runs the `double` step of `zeroConfigSteps` from its private queue,
//! `zero_config_worker queue` runs the queue `classify_threads` for both community versions.
//! Prints the report and exits 0 after a clean stop; prints the error and exits 1 otherwise.

use std::process::ExitCode;

use pgflow_runtime::{QueueWorker, StepQueued};
use pgflow_tests::deployed::zero_config_steps::{Step, ZeroConfigSteps};
use pgflow_tests::deployed::{ClassifyThreads, CommunityV1, CommunityV2};

#[tokio::main]
async fn main() -> ExitCode {
    let result = match std::env::args().nth(1).as_deref() {
        Some("step") => {
            StepQueued::<ZeroConfigSteps>::worker(Step::Double)
                .run()
                .await
        }
        Some("queue") => {
            QueueWorker::<ClassifyThreads>::builder_from_env()
                .serve::<CommunityV1>()
                .serve::<CommunityV2>()
                .run()
                .await
        }
        _ => {
            eprintln!("usage: zero_config_worker step|queue");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(report) => {
            println!(
                "stopped: {:?}, completed {}",
                report.stop_reason, report.completed
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}
