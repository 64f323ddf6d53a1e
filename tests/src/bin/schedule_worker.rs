//! Runs a worker on `DATABASE_URL` until SIGTERM or ctrl-c:
//! `schedule_worker ticks CRON` serves `scheduledTicks`, declares the schedule `ticks` (that cron, input 7)
//! and fires due schedules every 100 ms; `schedule_worker limited` serves `limitedWork` with 8 handler
//! slots, under whatever limits the database holds. Several of these processes run at once in the tests.

use std::process::ExitCode;
use std::time::Duration;

use pgflow_runtime::schedules::Schedule;
use pgflow_runtime::Worker;
use pgflow_tests::deployed::limited_work::LimitedWork;
use pgflow_tests::deployed::scheduled_ticks::ScheduledTicks;

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["ticks", cron] => {
            Worker::<ScheduledTicks>::builder_from_env()
                .schedule(Schedule::for_flow::<ScheduledTicks>("ticks", *cron, &7))
                .schedule_interval(Some(Duration::from_millis(100)))
                .max_poll_wait(Duration::from_millis(200))
                .run()
                .await
        }
        ["limited"] => {
            Worker::<LimitedWork>::builder_from_env()
                .max_concurrent(8)
                .max_poll_wait(Duration::from_millis(200))
                .run()
                .await
        }
        _ => {
            eprintln!("usage: schedule_worker ticks CRON | schedule_worker limited");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(report) => {
            println!("stopped: {:?}", report.stop_reason);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}
