// Proves: `#[deployment]` goes on a function and says what the function looks like.
use pgflow_runtime::deployment;

#[deployment(alias = "communityThreads")]
pub struct CommunityV1;

fn main() {}
