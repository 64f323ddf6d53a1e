//! Handler errors (`StepError`) and the typed queue-name errors.

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

/// A flow slug too long for even the shortest per-step queue, `<flow>__0`.
///
/// Mirrors upstream's `FlowQueueNameError` and the SQL error
/// `Flow "<slug>" cannot use per-step queues.`
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message} {detail} Hint: {hint}")]
#[non_exhaustive]
pub struct FlowQueueNameError {
    /// The concrete flow slug.
    pub flow_slug: String,
    /// The first step's slug.
    pub step_slug: String,
    /// The first step's index (always 0).
    pub step_index: usize,
    /// `lower(flow_slug || '__' || step_slug)`.
    pub readable_name: String,
    /// Length of `readable_name` in characters.
    pub readable_len: usize,
    /// `lower(flow_slug || '__0')`, the shortest queue the flow needs.
    pub fallback_name: String,
    /// Length of `fallback_name` in characters.
    pub fallback_len: usize,
    /// The PGMQ limit, 47.
    pub max_len: usize,
    /// The SQL-compatible MESSAGE.
    pub message: String,
    /// The SQL-compatible DETAIL.
    pub detail: String,
    /// A concrete shortening hint (SQL HINT plus how many characters to remove).
    pub hint: String,
}

/// One step whose readable and index-fallback queue names are both too long.
///
/// Mirrors upstream's `StepQueueNameError` and the SQL error
/// `Cannot derive a queue for step "<step>" at index <i> in flow "<flow>".`
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message} {detail} Hint: {hint}")]
#[non_exhaustive]
pub struct StepQueueNameError {
    /// The concrete flow slug.
    pub flow_slug: String,
    /// The step whose names do not fit.
    pub step_slug: String,
    /// The step's zero-based index.
    pub step_index: usize,
    /// `lower(flow_slug || '__' || step_slug)`.
    pub readable_name: String,
    /// Length of `readable_name` in characters.
    pub readable_len: usize,
    /// `lower(flow_slug || '__' || step_index)`.
    pub fallback_name: String,
    /// Length of `fallback_name` in characters.
    pub fallback_len: usize,
    /// The PGMQ limit, 47.
    pub max_len: usize,
    /// The SQL-compatible MESSAGE.
    pub message: String,
    /// The SQL-compatible DETAIL.
    pub detail: String,
    /// A concrete shortening hint (SQL HINT plus how many characters to remove).
    pub hint: String,
}

/// Why a flow's per-step route map cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum QueueNameError {
    /// The flow slug cannot fit even `<flow>__0`.
    #[error(transparent)]
    Flow(Box<FlowQueueNameError>),
    /// One step's readable and fallback names are both too long.
    #[error(transparent)]
    Step(Box<StepQueueNameError>),
    /// The flow has no steps, so it cannot be step-queued.
    #[error("Flow \"{flow_slug}\" cannot use per-step queues because it has no steps.")]
    EmptyFlow {
        /// The concrete flow slug.
        flow_slug: String,
    },
    /// Two steps resolve to the same queue name (slugs equal when lowercased).
    #[error("Flow \"{flow_slug}\" cannot use per-step queues: steps \"{first_step}\" (index {first_index}) and \"{second_step}\" (index {second_index}) both resolve to queue \"{queue}\". Hint: Rename one of the steps so the slugs differ when lowercased.")]
    Duplicate {
        /// The concrete flow slug.
        flow_slug: String,
        /// The colliding queue name.
        queue: String,
        /// The earlier step.
        first_step: String,
        /// The earlier step's index.
        first_index: usize,
        /// The later step.
        second_step: String,
        /// The later step's index.
        second_index: usize,
    },
}
