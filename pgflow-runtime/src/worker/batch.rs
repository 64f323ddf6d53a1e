//! How the driver batches: which outputs an exchange takes ([`Recording`]), and how long it gathers and how
//! far ahead it claims, from handler run times ([`RunTime`]).

use std::collections::HashMap;
use std::time::Duration;

use uuid::Uuid;

use super::result::TaskResult;

/// Longest wait for the results of handlers still running before an exchange records the ones already in
/// (see `gather_for`).
const GATHER_MAX: Duration = Duration::from_millis(1);

/// The runs whose outputs the exchanges in flight are recording, with how many outputs each.
///
/// Recording an output takes its run's row lock (`_complete_tasks`, lock order 2) until the exchange commits.
/// A second exchange in flight that records an output of the same run waits for that commit, and its claim
/// waits with it; in a bulk drain two exchanges in flight overlap in this way often (the branches of one
/// diamond finishing on either side of an exchange's start), which left a core idle. So an exchange takes
/// only outputs of runs no exchange in flight is recording; the others wait for the next one, which is no
/// later than the lock would have let them through.
#[derive(Default)]
pub(crate) struct Recording(HashMap<Uuid, usize>);

impl Recording {
    /// Whether no exchange in flight records an output of `run_id`.
    pub(crate) fn free(&self, run_id: &Uuid) -> bool {
        !self.0.contains_key(run_id)
    }

    /// How many of `outputs` an exchange started now could take.
    pub(crate) fn takeable(&self, outputs: &[TaskResult]) -> usize {
        outputs.iter().filter(|o| self.free(&o.key.run_id)).count()
    }

    /// Takes up to `limit` outputs of free runs, oldest first, for an exchange starting now; the rest stay in
    /// `outputs`, in order.
    pub(crate) fn take(&mut self, outputs: &mut Vec<TaskResult>, limit: usize) -> Vec<TaskResult> {
        let (mut batch, mut kept) = (Vec::new(), Vec::with_capacity(outputs.len()));
        for output in outputs.drain(..) {
            if batch.len() < limit && self.free(&output.key.run_id) {
                batch.push(output);
            } else {
                kept.push(output);
            }
        }
        *outputs = kept;
        for output in &batch {
            *self.0.entry(output.key.run_id).or_default() += 1;
        }
        batch
    }

    /// An exchange carrying `outputs` has ended (whatever its result).
    pub(crate) fn ended(&mut self, outputs: &[TaskResult]) {
        for output in outputs {
            if let Some(n) = self.0.get_mut(&output.key.run_id) {
                *n -= 1;
                if *n == 0 {
                    self.0.remove(&output.key.run_id);
                }
            }
        }
    }
}

/// A moving average of handler run times.
#[derive(Default)]
pub(crate) struct RunTime(Option<f64>);

impl RunTime {
    pub(crate) fn add(&mut self, sample: Duration) {
        let s = sample.as_secs_f64();
        self.0 = Some(self.0.map_or(s, |avg| 0.8 * avg + 0.2 * s));
    }

    /// How long an exchange waits for the results of handlers still running: twice the average run time,
    /// when that is under [`GATHER_MAX`] (siblings started together, such as the two branches of a diamond,
    /// then share one exchange instead of taking one each); nothing for slower handlers.
    pub(crate) fn gather_for(&self) -> Duration {
        match self.0 {
            Some(avg) if avg * 2.0 <= GATHER_MAX.as_secs_f64() => {
                Duration::from_secs_f64(avg * 2.0)
            }
            _ => Duration::ZERO,
        }
    }

    /// Tasks one slot gets through in `window`, by the average (0 before the first sample).
    pub(crate) fn per_slot(&self, window: Duration) -> usize {
        match self.0 {
            Some(avg) => (window.as_secs_f64() / avg.max(1e-6)).min(1e6) as usize,
            None => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio::sync::Semaphore;

    use super::super::result::{Outcome, TaskKey};
    use super::*;

    #[test]
    fn run_time_sizes_claim_ahead_only_once_it_has_seen_a_handler() {
        let mut t = RunTime::default();
        assert_eq!(t.per_slot(Duration::from_millis(100)), 0);
        t.add(Duration::from_millis(10));
        assert_eq!(t.per_slot(Duration::from_millis(100)), 10);
        t.add(Duration::from_secs(10));
        assert_eq!(t.per_slot(Duration::from_millis(100)), 0);
    }

    fn output(run: u128, step: &str) -> TaskResult {
        TaskResult {
            key: TaskKey {
                run_id: Uuid::from_u128(run),
                flow_slug: "f".into(),
                step_slug: step.into(),
                task_index: 0,
                msg_id: 1,
                attempt: 1,
            },
            outcome: Outcome::Output(serde_json::Value::Null),
            ran_for: Duration::ZERO,
            first_error: None,
            _permit: Arc::new(Semaphore::new(1))
                .try_acquire_owned()
                .expect("a free permit"),
        }
    }

    fn runs(batch: &[TaskResult]) -> Vec<u128> {
        batch.iter().map(|o| o.key.run_id.as_u128()).collect()
    }

    #[test]
    fn an_exchange_beside_others_leaves_out_the_runs_they_record() {
        let mut recording = Recording::default();
        let mut outputs = vec![output(1, "b"), output(2, "b")];
        let first = recording.take(&mut outputs, 64);
        assert_eq!(runs(&first), [1, 2], "nothing in flight: everything goes");

        // Run 1's other branch finishes while the first exchange is in flight; so do two other runs' tasks.
        outputs = vec![output(1, "c"), output(3, "b"), output(4, "b")];
        assert_eq!(recording.takeable(&outputs), 2);
        let second = recording.take(&mut outputs, 1);
        assert_eq!(runs(&second), [3], "oldest free run first, up to the limit");
        assert_eq!(runs(&outputs), [1, 4], "the rest keep their order");
        assert_eq!(
            recording.takeable(&outputs),
            1,
            "run 1 is still being recorded"
        );

        recording.ended(&first);
        assert_eq!(recording.takeable(&outputs), 2, "run 1 is free again");
        assert!(recording.free(&Uuid::from_u128(1)));
        assert!(!recording.free(&Uuid::from_u128(3)));
        let third = recording.take(&mut outputs, 64);
        assert_eq!(runs(&third), [1, 4]);
        recording.ended(&second);
        recording.ended(&third);
        assert!(
            recording.0.is_empty(),
            "every run is released once its exchanges end"
        );
    }

    #[test]
    fn exchanges_wait_for_fast_siblings_only() {
        let mut t = RunTime::default();
        assert_eq!(t.gather_for(), Duration::ZERO, "no handler seen yet");
        t.add(Duration::from_micros(100));
        assert_eq!(t.gather_for(), Duration::from_micros(200));
        t.add(Duration::from_millis(50));
        assert_eq!(
            t.gather_for(),
            Duration::ZERO,
            "slow handlers: record at once"
        );
    }
}
