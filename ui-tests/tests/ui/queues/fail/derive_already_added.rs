// Proves: deriving what `#[queue]` derives is an error: on the user's derive when it follows `#[queue]`, rustc's conflicting-impl error when it precedes it (the attribute cannot see it).
use pgflow_runtime::queue;

#[queue("after")]
#[derive(Debug, Clone)]
pub struct After;

#[derive(Hash)]
#[queue("before")]
pub struct Before;

fn main() {}
