// Proves: `#[schedule]` turns a function whose body is the run input into one returning the Schedule, with
// its options; the cron literal parsed at compile time is the one the runtime accepts.
use pgflow_runtime::{flow, schedule};

#[flow(slug = "greet", input = String)]
pub mod greet {
    use pgflow_runtime::StepError;

    #[step]
    async fn hello(name: String) -> Result<String, StepError> {
        Ok(name)
    }
}

/// Every night at three, Paris time.
#[schedule(flow = Greet, cron = "0 3 * * *", time_zone = "Europe/Paris", catch_up = 2, overlap = "skip")]
pub fn nightly() -> String {
    "Ada".to_owned()
}

#[schedule(flow = Greet, cron = "*/5 * * * * *", name = "every-five-seconds")]
fn often() -> String {
    "Grace".to_owned()
}

fn main() {
    let s = nightly();
    assert_eq!(s.name(), "nightly");
    s.validate().unwrap();
    let o = often();
    assert_eq!(o.name(), "every-five-seconds");
    o.validate().unwrap();
}
