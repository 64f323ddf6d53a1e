//! Handler errors: `StepError`, retryable by default, with a terminal variant.

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

/// A boxed error that can cross threads, used as the cause of a [`StepError`].
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// The error a step handler returns.
///
/// Retryable by default: the runtime calls `pgflow.fail_task`, and SQL retries the task until
/// the step's `max_attempts` is used up. A [`StepError::Terminal`] error asks the runtime to
/// skip the remaining attempts. `?` converts common error types into a retryable error; wrap
/// anything else with [`StepError::retryable`] or [`StepError::terminal`].
///
/// ```
/// use pgflow_runtime::StepError;
/// use std::time::Duration;
///
/// fn parse(raw: &str) -> Result<u32, StepError> {
///     raw.parse::<u32>().map_err(StepError::terminal)
/// }
/// assert!(parse("x").unwrap_err().is_terminal());
///
/// let e = StepError::retryable("rate limited").retry_after(Duration::from_secs(30));
/// assert_eq!(e.retry_delay(), Some(Duration::from_secs(30)));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StepError {
    /// A failure worth retrying (the default for `?`).
    #[error("{source}")]
    Retryable {
        /// What went wrong.
        source: BoxError,
        /// A delay the handler asks for before the next attempt; `None` uses SQL's backoff.
        retry_after: Option<Duration>,
    },
    /// A failure that no retry can fix (bad input, a rejected request).
    #[error("{source}")]
    Terminal {
        /// What went wrong.
        source: BoxError,
    },
}

/// A plain message used as an error source.
#[derive(Debug)]
struct Message(String);

impl fmt::Display for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl StdError for Message {}

impl StepError {
    /// A retryable error from any error or message.
    pub fn retryable(error: impl Into<BoxError>) -> Self {
        StepError::Retryable {
            source: error.into(),
            retry_after: None,
        }
    }

    /// A terminal error from any error or message: the remaining attempts are skipped.
    pub fn terminal(error: impl Into<BoxError>) -> Self {
        StepError::Terminal {
            source: error.into(),
        }
    }

    /// A retryable error with a formatted message.
    pub fn msg(message: impl fmt::Display) -> Self {
        StepError::retryable(Message(message.to_string()))
    }

    /// Asks for the next attempt after `delay` instead of SQL's backoff. No effect on a terminal error.
    #[must_use]
    pub fn retry_after(self, delay: Duration) -> Self {
        match self {
            StepError::Retryable { source, .. } => StepError::Retryable {
                source,
                retry_after: Some(delay),
            },
            other => other,
        }
    }

    /// Turns this error into a terminal one, keeping its cause.
    #[must_use]
    pub fn into_terminal(self) -> Self {
        match self {
            StepError::Retryable { source, .. } | StepError::Terminal { source } => {
                StepError::Terminal { source }
            }
        }
    }

    /// Whether the runtime should stop retrying.
    pub fn is_terminal(&self) -> bool {
        matches!(self, StepError::Terminal { .. })
    }

    /// The delay the handler asked for, if any.
    pub fn retry_delay(&self) -> Option<Duration> {
        match self {
            StepError::Retryable { retry_after, .. } => *retry_after,
            StepError::Terminal { .. } => None,
        }
    }

    /// The underlying cause.
    pub fn cause(&self) -> &(dyn StdError + Send + Sync + 'static) {
        match self {
            StepError::Retryable { source, .. } | StepError::Terminal { source } => &**source,
        }
    }

    /// The message with its whole cause chain (`a: b: c`), as stored in `error_message`.
    pub fn chain_message(&self) -> String {
        let mut out = self.cause().to_string();
        let mut next = self.cause().source();
        while let Some(e) = next {
            out.push_str(": ");
            out.push_str(&e.to_string());
            next = e.source();
        }
        out
    }
}

impl From<std::io::Error> for StepError {
    fn from(e: std::io::Error) -> Self {
        StepError::retryable(e)
    }
}

impl From<serde_json::Error> for StepError {
    fn from(e: serde_json::Error) -> Self {
        StepError::retryable(e)
    }
}

impl From<sqlx::Error> for StepError {
    fn from(e: sqlx::Error) -> Self {
        StepError::retryable(e)
    }
}

impl From<String> for StepError {
    fn from(e: String) -> Self {
        StepError::retryable(Message(e))
    }
}

impl From<&str> for StepError {
    fn from(e: &str) -> Self {
        StepError::retryable(Message(e.to_owned()))
    }
}

impl From<BoxError> for StepError {
    fn from(e: BoxError) -> Self {
        StepError::retryable(e)
    }
}

impl From<std::convert::Infallible> for StepError {
    fn from(e: std::convert::Infallible) -> Self {
        match e {}
    }
}
