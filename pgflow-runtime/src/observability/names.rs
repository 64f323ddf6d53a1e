//! The metric names, one constant each, and their descriptions.

/// Counter, labels `flow`, `step`, `queue`: tasks claimed.
pub const TASKS_CLAIMED: &str = "pgflow_tasks_claimed_total";
/// Counter, labels `flow`, `step`, `queue`: outputs recorded (tasks completed).
pub const TASKS_COMPLETED: &str = "pgflow_tasks_completed_total";
/// Counter, labels `flow`, `step`, `queue`: failures recorded that end the task (no attempt left, or
/// terminal).
pub const TASKS_FAILED: &str = "pgflow_tasks_failed_total";
/// Counter, labels `flow`, `step`, `queue`: failures recorded that queue the task for another attempt.
pub const TASKS_RETRIED: &str = "pgflow_tasks_retried_total";
/// Counter, labels `flow`, `step`, `queue`: results (outputs or failures) that changed nothing because the
/// task moved on to another attempt or finished.
pub const STALE_RESULTS: &str = "pgflow_stale_results_total";
/// Counter, label `queue`: messages read while their task ran under another claim (left to it).
pub const DEFERRED_READS: &str = "pgflow_deferred_reads_total";
/// Counter, label `queue`: claims that found messages the worker must not run (the worker stops).
pub const UNSUPPORTED_STOPS: &str = "pgflow_unsupported_stops_total";
/// Histogram (seconds), labels `flow`, `step`, `queue`: how long handlers ran.
pub const HANDLER_DURATION: &str = "pgflow_handler_duration_seconds";
/// Histogram (seconds), labels `flow`, `step`, `queue`: from claimed to started (a task claimed ahead
/// waits for a free handler slot).
pub const QUEUE_WAIT: &str = "pgflow_task_wait_seconds";
/// Histogram (seconds), label `queue`: the round trip of one exchange (record outputs and claim).
pub const CLAIM_DURATION: &str = "pgflow_claim_round_trip_seconds";
/// Histogram (tasks), labels `queue`, `part` (`outputs` recorded, `claimed` tasks): the size of each
/// exchange.
pub const EXCHANGE_BATCH: &str = "pgflow_exchange_batch_size";
/// Gauge, label `queue`: handlers running now.
pub const TASKS_IN_FLIGHT: &str = "pgflow_tasks_in_flight";
/// Gauge, label `queue`: tasks claimed whose result is not recorded yet (claimed ahead, running, or
/// waiting for the next exchange).
pub const UNRECORDED_RESULTS: &str = "pgflow_unrecorded_results";
/// Gauge, label `queue`: messages in the queue (from `pgflow.queue_stats()`).
pub const QUEUE_DEPTH: &str = "pgflow_queue_depth";
/// Gauge, label `queue`: messages a worker could read now.
pub const QUEUE_VISIBLE: &str = "pgflow_queue_visible";
/// Gauge, label `queue`: age in seconds of the oldest message (0 when empty).
pub const QUEUE_OLDEST_AGE: &str = "pgflow_queue_oldest_message_age_seconds";

/// Registers the description and unit of every metric with the installed recorder.
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(TASKS_CLAIMED, "Tasks claimed");
    describe_counter!(TASKS_COMPLETED, "Task outputs recorded");
    describe_counter!(TASKS_FAILED, "Task failures recorded with no attempt left");
    describe_counter!(
        TASKS_RETRIED,
        "Task failures recorded that queue another attempt"
    );
    describe_counter!(STALE_RESULTS, "Results ignored because the task moved on");
    describe_counter!(
        DEFERRED_READS,
        "Messages read while their task ran elsewhere"
    );
    describe_counter!(
        UNSUPPORTED_STOPS,
        "Claims that found messages the worker must not run"
    );
    describe_histogram!(HANDLER_DURATION, Unit::Seconds, "Handler run time");
    describe_histogram!(QUEUE_WAIT, Unit::Seconds, "From claimed to started");
    describe_histogram!(CLAIM_DURATION, Unit::Seconds, "Exchange round trip");
    describe_histogram!(
        EXCHANGE_BATCH,
        Unit::Count,
        "Outputs recorded and tasks claimed per exchange"
    );
    describe_gauge!(TASKS_IN_FLIGHT, "Handlers running");
    describe_gauge!(
        UNRECORDED_RESULTS,
        "Claimed tasks whose result is not recorded yet"
    );
    describe_gauge!(QUEUE_DEPTH, "Messages in the queue");
    describe_gauge!(QUEUE_VISIBLE, "Messages visible now");
    describe_gauge!(QUEUE_OLDEST_AGE, Unit::Seconds, "Age of the oldest message");
}
