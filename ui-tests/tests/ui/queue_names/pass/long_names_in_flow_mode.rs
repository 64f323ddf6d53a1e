// Proves: a plain flow whose step names are too long for per-step queues still compiles and runs in flow mode.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "the_flow_slug_here_is_exactly_forty_five_char", input = Thread)]
mod long_names {
    use super::*;

    #[step]
    async fn a_step_whose_readable_queue_name_is_far_too_long(thread: Thread) -> Result<String, StepError> {
        Ok(thread.text)
    }
}

fn main() {
    use pgflow_runtime::Flow;
    assert_eq!(LongNames::SLUG.len(), 45);
}
