//! A worker's metric handles, built once at startup for each (flow, step) it runs: recording an event
//! looks its step up among a few entries and touches a cached handle, with no allocation.

use metrics::{Counter, Gauge, Histogram};

use super::names::*;

/// The handles of one (flow, step) of a worker's queue.
pub(crate) struct StepMetrics {
    flow: &'static str,
    step: &'static str,
    pub(crate) claimed: Counter,
    pub(crate) completed: Counter,
    pub(crate) failed: Counter,
    pub(crate) retried: Counter,
    pub(crate) stale: Counter,
    pub(crate) handler: Histogram,
    pub(crate) wait: Histogram,
}

/// The handles of one worker.
pub(crate) struct WorkerMetrics {
    steps: Vec<StepMetrics>,
    pub(crate) deferred: Counter,
    pub(crate) unsupported: Counter,
    pub(crate) claim: Histogram,
    pub(crate) batch_outputs: Histogram,
    pub(crate) batch_claimed: Histogram,
    pub(crate) in_flight: Gauge,
    pub(crate) unrecorded: Gauge,
}

impl WorkerMetrics {
    /// Registers the handles of `queue` and its (flow, step) pairs with the installed recorder.
    pub(crate) fn new(queue: &str, flows: &[&'static str], steps: &[&'static str]) -> Self {
        let q = queue.to_owned();
        let steps = flows
            .iter()
            .zip(steps)
            .map(|(&flow, &step)| {
                let labels = [
                    ("flow", flow.to_owned()),
                    ("step", step.to_owned()),
                    ("queue", q.clone()),
                ];
                StepMetrics {
                    flow,
                    step,
                    claimed: metrics::counter!(TASKS_CLAIMED, &labels),
                    completed: metrics::counter!(TASKS_COMPLETED, &labels),
                    failed: metrics::counter!(TASKS_FAILED, &labels),
                    retried: metrics::counter!(TASKS_RETRIED, &labels),
                    stale: metrics::counter!(STALE_RESULTS, &labels),
                    handler: metrics::histogram!(HANDLER_DURATION, &labels),
                    wait: metrics::histogram!(QUEUE_WAIT, &labels),
                }
            })
            .collect();
        WorkerMetrics {
            steps,
            deferred: metrics::counter!(DEFERRED_READS, "queue" => q.clone()),
            unsupported: metrics::counter!(UNSUPPORTED_STOPS, "queue" => q.clone()),
            claim: metrics::histogram!(CLAIM_DURATION, "queue" => q.clone()),
            batch_outputs: metrics::histogram!(EXCHANGE_BATCH, "queue" => q.clone(), "part" => "outputs"),
            batch_claimed: metrics::histogram!(EXCHANGE_BATCH, "queue" => q.clone(), "part" => "claimed"),
            in_flight: metrics::gauge!(TASKS_IN_FLIGHT, "queue" => q.clone()),
            unrecorded: metrics::gauge!(UNRECORDED_RESULTS, "queue" => q),
        }
    }

    /// The handles of (flow, step); `None` for a pair the worker does not run.
    pub(crate) fn step(&self, flow: &str, step: &str) -> Option<&StepMetrics> {
        self.steps.iter().find(|s| s.flow == flow && s.step == step)
    }

    /// Runs `f` on the handles of (flow, step), when the worker runs that pair.
    pub(crate) fn on(&self, flow: &str, step: &str, f: impl FnOnce(&StepMetrics)) {
        if let Some(s) = self.step(flow, step) {
            f(s);
        }
    }
}
