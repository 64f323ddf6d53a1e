// Proves: the parameter must be a flow's step enum; the error is on the user's type and says where the step enum comes from.
use pgflow_runtime::{deployment, queue};

#[queue("classify_threads")]
pub struct ClassifyThreads;

#[deployment(alias = "communityThreads")]
fn community_v1(step: u8) {
    match step {
        _ => ClassifyThreads,
    }
}

fn main() {}
