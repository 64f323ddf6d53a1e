// Proves: a queue name with an uppercase letter or a hyphen is an error on the literal that names the character and suggests a valid spelling.
use pgflow_runtime::queue;

#[queue("ClassifyThreads")]
pub struct ClassifyThreads;

#[queue("deliver-slack-alerts")]
pub struct DeliverSlackAlerts;

#[queue("")]
pub struct Empty;

fn main() {}
