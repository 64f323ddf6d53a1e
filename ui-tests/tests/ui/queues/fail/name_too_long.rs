// Proves: a queue name of 48 characters is an error on the literal with the PGMQ limit and how many characters to remove.
use pgflow_runtime::queue;

#[queue("a_queue_name_of_exactly_forty_eight_characters__")]
pub struct TooLong;

fn main() {}
