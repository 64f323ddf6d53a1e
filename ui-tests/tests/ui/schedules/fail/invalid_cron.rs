// Proves: an invalid cron literal is a compile error on the literal that quotes it.
use pgflow_runtime::{flow, schedule};

#[flow(slug = "greet", input = String)]
pub mod greet {
    use pgflow_runtime::StepError;

    #[step]
    async fn hello(name: String) -> Result<String, StepError> {
        Ok(name)
    }
}

#[schedule(flow = Greet, cron = "61 * * * *")]
fn nightly() -> String {
    "Ada".to_owned()
}

fn main() {
    let _ = nightly();
}
