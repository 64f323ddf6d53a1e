// Proves: a plain flow (no `step_queues`) whose step names are too long for per-step queues still compiles and runs on its single queue.
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
    use pgflow_runtime::sql::names::{default_queue_name, resolve_step_queues};
    use pgflow_runtime::{Flow, FlowStep};
    assert_eq!(LongNames::SLUG.len(), 45);
    // Its single queue fits; per-step queues could not exist for it.
    assert_eq!(default_queue_name(LongNames::SLUG), "the_flow_slug_here_is_exactly_forty_five_char");
    let steps: Vec<&str> = long_names::Step::ALL.iter().map(|s| FlowStep::slug(*s)).collect();
    assert!(resolve_step_queues(LongNames::SLUG, &steps).is_err());
    // A plain worker for it builds (no database needed to build one).
    let _ = pgflow_runtime::Worker::<LongNames>::builder;
}
