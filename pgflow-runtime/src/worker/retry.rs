//! The one retry policy of the worker: exponential backoff between attempts, capped, bounded by a deadline.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// Exponential backoff: `first`, doubling up to `max`.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    first: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    /// The database-error backoff: 100 ms doubling to `max`.
    pub(crate) fn database(max: Duration) -> Self {
        Backoff::new(Duration::from_millis(100), max)
    }

    pub(crate) fn new(first: Duration, max: Duration) -> Self {
        let first = first.min(max);
        Backoff {
            first,
            max,
            next: first,
        }
    }

    /// The wait before the next attempt; doubles the one after.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(self.max);
        delay
    }

    /// Back to the first delay (after a success).
    pub(crate) fn reset(&mut self) {
        self.next = self.first;
    }
}

/// `d` scaled by a random factor in [0.75, 1.25), so that idle workers do not poll in lockstep.
pub(crate) fn jitter(d: Duration) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(d.as_nanos() as u64);
    let unit = (h.finish() >> 11) as f64 / (1u64 << 53) as f64;
    d.mul_f64(0.75 + 0.5 * unit)
}

/// Why [`retry`] gave up.
#[derive(Debug)]
pub(crate) enum GaveUp<E> {
    /// The deadline passed; the last error.
    Deadline(E),
    /// The error is not worth retrying.
    Permanent(E),
}

/// Runs `op` until it succeeds, returns an error `retryable` rejects, or the next wait would end after
/// `deadline`. Waits per `backoff` between attempts; `on_retry` sees each retried error and its attempt number.
pub(crate) async fn retry<T, E, Fut>(
    mut backoff: Backoff,
    deadline: Instant,
    retryable: impl Fn(&E) -> bool,
    mut on_retry: impl FnMut(&E, u32, Duration),
    mut op: impl FnMut() -> Fut,
) -> Result<T, GaveUp<E>>
where
    Fut: Future<Output = Result<T, E>>,
{
    let mut attempt = 1;
    loop {
        match op().await {
            Ok(v) => return Ok(v),
            Err(e) if !retryable(&e) => return Err(GaveUp::Permanent(e)),
            Err(e) => {
                let wait = backoff.next_delay();
                if Instant::now() + wait > deadline {
                    return Err(GaveUp::Deadline(e));
                }
                on_retry(&e, attempt, wait);
                tokio::time::sleep(wait).await;
                attempt += 1;
            }
        }
    }
}

/// Whether a database error is worth retrying: lost connections, timeouts, serialization failures and
/// deadlocks, server shutdowns. Data errors (an unstorable value) and programming errors are not.
pub(crate) fn transient(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => {
            let code = db.code();
            let code = code.as_deref().unwrap_or("");
            // 08: connection exception; 40: transaction rollback (serialization, deadlock);
            // 53: insufficient resources; 57: operator intervention (admin shutdown, cancel); 58: system error.
            ["08", "40", "53", "57", "58"]
                .iter()
                .any(|class| code.starts_with(class))
        }
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_)
        | sqlx::Error::Tls(_) => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_within_a_quarter_and_varies() {
        let d = Duration::from_millis(100);
        let samples: Vec<Duration> = (0..64).map(|_| jitter(d)).collect();
        assert!(samples
            .iter()
            .all(|s| *s >= Duration::from_millis(75) && *s < Duration::from_millis(125)));
        assert!(samples.iter().any(|s| *s != samples[0]));
    }

    #[test]
    fn backoff_doubles_up_to_its_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(500));
        let waits: Vec<u64> = (0..5).map(|_| b.next_delay().as_millis() as u64).collect();
        assert_eq!(waits, [100, 200, 400, 500, 500]);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_millis(100));
    }

    #[tokio::test(start_paused = true)]
    async fn retry_stops_at_the_deadline_with_the_last_error() {
        let mut calls = 0;
        let deadline = Instant::now() + Duration::from_millis(350);
        let result: Result<(), GaveUp<u32>> = retry(
            Backoff::new(Duration::from_millis(100), Duration::from_secs(1)),
            deadline,
            |_| true,
            |_, _, _| {},
            || {
                calls += 1;
                let n = calls;
                async move { Err(n) }
            },
        )
        .await;
        // Attempts at 0, 100 and 300 ms; the next wait (400 ms) would end after the deadline.
        assert!(matches!(result, Err(GaveUp::Deadline(3))));
    }

    #[tokio::test(start_paused = true)]
    async fn retry_does_not_repeat_a_permanent_error() {
        let result: Result<(), GaveUp<&str>> = retry(
            Backoff::database(Duration::from_secs(1)),
            Instant::now() + Duration::from_secs(60),
            |e: &&str| *e != "bad data",
            |_, _, _| {},
            || async { Err("bad data") },
        )
        .await;
        assert!(matches!(result, Err(GaveUp::Permanent("bad data"))));
    }
}
