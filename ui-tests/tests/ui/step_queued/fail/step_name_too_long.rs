// Proves: with `step_queues`, a step at index 10 whose readable name and index fallback are both over 47 characters is an error on that step's slug.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "a_flow_slug_of_exactly_forty_four_characters", input = Thread, step_queues)]
mod f {
    use super::*;

    #[step]
    async fn s0(thread: Thread) -> Result<String, StepError> { Ok(thread.text) }
    #[step] async fn s1(t: Thread) -> Result<u8, StepError> { let _ = t; Ok(1) }
    #[step] async fn s2(t: Thread) -> Result<u8, StepError> { let _ = t; Ok(2) }
    #[step] async fn s3(t: Thread) -> Result<u8, StepError> { let _ = t; Ok(3) }
    #[step] async fn s4(t: Thread) -> Result<u8, StepError> { let _ = t; Ok(4) }
    #[step] async fn s5(t: Thread) -> Result<u8, StepError> { let _ = t; Ok(5) }
    #[step] async fn s6(t: Thread) -> Result<u8, StepError> { let _ = t; Ok(6) }
    #[step] async fn s7(t: Thread) -> Result<u8, StepError> { let _ = t; Ok(7) }
    #[step] async fn s8(t: Thread) -> Result<u8, StepError> { let _ = t; Ok(8) }
    #[step] async fn s9(t: Thread) -> Result<u8, StepError> { let _ = t; Ok(9) }
    #[step(slug = "deliverSlack")]
    async fn deliver_slack(t: Thread) -> Result<u8, StepError> { let _ = t; Ok(10) }
}

fn main() {
    let _ = pgflow_runtime::StepQueued::<F>::worker(f::Step::DeliverSlack);
}
