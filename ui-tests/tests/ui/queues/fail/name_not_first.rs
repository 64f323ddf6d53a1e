// Proves: `#[queue]` needs the queue name first, as a string literal, and its options are checked like every other attribute's.
use pgflow_runtime::queue;

#[queue]
pub struct NoName;

#[queue(name = "classify_threads")]
pub struct NamedOption;

#[queue("billing", krate = "x")]
pub struct UnknownOption;

fn main() {}
