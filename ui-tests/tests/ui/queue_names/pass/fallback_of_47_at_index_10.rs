// Proves: with `step_queues`, an index fallback of exactly 47 characters (`<43-character flow>__10`) is used.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
#[flow(slug = "a_flow_slug_of_exactly_forty_three_chars_xx", input = Thread, step_queues)]
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
    use pgflow_runtime::StepQueued;
    let queue = StepQueued::<F>::queue_for(f::Step::DeliverSlack);
    assert_eq!(queue, "a_flow_slug_of_exactly_forty_three_chars_xx__10");
    assert_eq!(queue.len(), 47);
    assert_eq!(StepQueued::<F>::queue_for(f::Step::S9), "a_flow_slug_of_exactly_forty_three_chars_xx__s9");
}
