//! The slug and queue-name rules in plain Rust: the same rules the SQL core enforces.
//!
//! The SQL is authoritative: `pgflow.is_valid_slug` decides what a slug is, and
//! `pgflow.resolve_step_queues` decides every per-step queue name (both in `pgflow-sql/migrations/`). This module states the same rules in Rust, without any database or heavy
//! dependency, so that the `#[flow]` macro runs them at expansion time (it depends on this crate with
//! `default-features = false`) and the runtime re-exports them as `pgflow_runtime::sql::names`.
//! The integration tests compare [`resolve_step_queues`] with the SQL resolver on generated names,
//! errors included.
//!
//! # Per-step queue names
//!
//! For the step at zero-based index `i` of a flow with its complete, ordered list of steps:
//!
//! - `readable = lower(flow_slug || '__' || step_slug)`, used when it has at most 47 characters;
//! - otherwise `fallback = lower(flow_slug || '__' || i)`, used when it has at most 47 characters;
//! - otherwise the whole flow is rejected.
//!
//! Names are never truncated or hashed, and there is no separate limit on the number of steps.
//!
//! ```
//! use pgflow_sql::names::resolve_step_queues;
//!
//! let queues = resolve_step_queues("communityThreadsV1", &["classify", "deliverSlack"]).unwrap();
//! assert_eq!(queues, ["communitythreadsv1__classify", "communitythreadsv1__deliverslack"]);
//! ```

mod error;
#[cfg(test)]
mod tests;

pub use error::{FirstStepName, FlowQueueNameError, QueueNameError, StepQueueNameError};

/// The longest queue name PGMQ accepts (`pgmq.validate_queue_name`), in characters.
pub const MAX_QUEUE_NAME_LEN: usize = 47;

/// The longest slug `pgflow.is_valid_slug` accepts, in characters.
pub const MAX_SLUG_LEN: usize = 128;

/// The slug every flow input reserves for itself: a dependent step's input has one key per
/// dependency slug next to `run`, so no step may be called `run`.
pub const RESERVED_SLUG: &str = "run";

/// Length in characters, as PostgreSQL's `length()` counts them.
pub fn name_len(name: &str) -> usize {
    name.chars().count()
}

/// Why a slug is not valid. The rule is SQL's `pgflow.is_valid_slug`: not empty, at most 128
/// characters, `^[a-zA-Z_][a-zA-Z0-9_]*$`, and not `run`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SlugError {
    /// The slug is empty.
    #[error("slug is empty")]
    Empty,
    /// The slug has more than 128 characters.
    #[error("slug is {len} characters; at most 128 are allowed")]
    TooLong {
        /// The slug.
        slug: String,
        /// Its length in characters.
        len: usize,
    },
    /// The slug is `run`, which flow inputs reserve.
    #[error("slug `run` is reserved; choose another name")]
    Reserved,
    /// The first character is not an ASCII letter or `_`.
    #[error("slug `{slug}` must start with an ASCII letter or `_`")]
    BadStart {
        /// The slug.
        slug: String,
    },
    /// A character other than an ASCII letter, digit or `_`.
    #[error("slug `{slug}` contains `{found}`; slugs use only ASCII letters, digits and `_` (`^[a-zA-Z_][a-zA-Z0-9_]*$`)")]
    BadCharacter {
        /// The slug.
        slug: String,
        /// The first character that is not allowed.
        found: char,
    },
}

/// Checks a flow or step slug against the rule of SQL's `pgflow.is_valid_slug`.
///
/// ```
/// use pgflow_sql::names::{check_slug, SlugError};
/// assert!(check_slug("deliverSlack").is_ok());
/// assert_eq!(check_slug("run"), Err(SlugError::Reserved));
/// ```
///
/// # Errors
///
/// A [`SlugError`] naming the first problem found.
pub fn check_slug(slug: &str) -> Result<(), SlugError> {
    let len = name_len(slug);
    let mut chars = slug.chars();
    let Some(first) = chars.next() else {
        return Err(SlugError::Empty);
    };
    if len > MAX_SLUG_LEN {
        return Err(SlugError::TooLong {
            slug: slug.to_owned(),
            len,
        });
    }
    if slug == RESERVED_SLUG {
        return Err(SlugError::Reserved);
    }
    if !(first.is_ascii_alphabetic() || first == '_') {
        return Err(SlugError::BadStart {
            slug: slug.to_owned(),
        });
    }
    if let Some(found) = chars.find(|c| !(c.is_ascii_alphanumeric() || *c == '_')) {
        return Err(SlugError::BadCharacter {
            slug: slug.to_owned(),
            found,
        });
    }
    Ok(())
}

/// Whether SQL's `pgflow.is_valid_slug` accepts `slug`.
pub fn is_valid_slug(slug: &str) -> bool {
    check_slug(slug).is_ok()
}

/// The single queue of a flow that is not step-queued: `lower(flow_slug)`.
pub fn default_queue_name(flow_slug: &str) -> String {
    flow_slug.to_lowercase()
}

/// The preferred per-step queue name, `lower(flow_slug || '__' || step_slug)`.
pub fn readable_name(flow_slug: &str, step_slug: &str) -> String {
    format!("{flow_slug}__{step_slug}").to_lowercase()
}

/// The per-step queue name used when the readable one is too long,
/// `lower(flow_slug || '__' || step_index)`.
pub fn fallback_name(flow_slug: &str, step_index: usize) -> String {
    format!("{flow_slug}__{step_index}").to_lowercase()
}

/// The queue of one step: its readable name when that fits, else its index fallback.
///
/// This is the per-step part of [`resolve_step_queues`]; it does not check the slugs, the other
/// steps, or whether the flow slug fits `<flow>__0` (which [`resolve_step_queues`] checks first).
///
/// # Errors
///
/// A [`StepQueueNameError`] (boxed, as in [`QueueNameError::Step`]) when both names are longer
/// than 47 characters.
pub fn resolve_step_queue(
    flow_slug: &str,
    step_slug: &str,
    step_index: usize,
) -> Result<String, Box<StepQueueNameError>> {
    let readable = readable_name(flow_slug, step_slug);
    if name_len(&readable) <= MAX_QUEUE_NAME_LEN {
        return Ok(readable);
    }
    let fallback = fallback_name(flow_slug, step_index);
    if name_len(&fallback) <= MAX_QUEUE_NAME_LEN {
        return Ok(fallback);
    }
    Err(Box::new(StepQueueNameError {
        flow_slug: flow_slug.to_owned(),
        step_slug: step_slug.to_owned(),
        step_index,
        readable_len: name_len(&readable),
        readable_name: readable,
        fallback_len: name_len(&fallback),
        fallback_name: fallback,
        max_len: MAX_QUEUE_NAME_LEN,
    }))
}

/// Resolves the queue of every step, in step order, or rejects the whole flow, exactly as SQL's
/// `pgflow.resolve_step_queues(flow_slug, step_slugs)` does.
///
/// The checks run in SQL's order, so both report the same error: the flow slug, then
/// whether `<flow>__0` fits, then whether there are steps; then for each step in order its slug,
/// its names, and whether its name repeats an earlier step's.
///
/// ```
/// use pgflow_sql::names::{resolve_step_queues, QueueNameError};
///
/// let flow = "a_flow_slug_of_exactly_forty_three_chars_xx";
/// let mut steps: Vec<String> = (0..10).map(|i| format!("s{i}")).collect();
/// steps.push("deliverSlack".into());
/// let steps: Vec<&str> = steps.iter().map(String::as_str).collect();
/// // The readable name of index 10 is too long; its fallback `<flow>__10` is exactly 47.
/// assert_eq!(resolve_step_queues(flow, &steps).unwrap()[10], format!("{flow}__10"));
///
/// let err = resolve_step_queues(&format!("{flow}y"), &steps).unwrap_err();
/// assert_eq!(err.sqlstate(), "PF011");
/// assert_eq!(err.step(), Some(("deliverSlack", 10)));
/// ```
///
/// # Errors
///
/// [`QueueNameError::InvalidFlowSlug`] / [`QueueNameError::InvalidStepSlug`] for a slug that is not
/// valid, [`QueueNameError::Flow`] when even `<flow>__0` is longer than 47 characters,
/// [`QueueNameError::EmptyFlow`] for a flow without steps, [`QueueNameError::Step`] when one step's
/// readable and fallback names are both too long, and [`QueueNameError::Duplicate`] when two steps
/// resolve to the same name.
pub fn resolve_step_queues(
    flow_slug: &str,
    step_slugs: &[&str],
) -> Result<Vec<String>, QueueNameError> {
    if let Err(problem) = check_slug(flow_slug) {
        return Err(QueueNameError::InvalidFlowSlug {
            flow_slug: flow_slug.to_owned(),
            problem,
        });
    }
    let shortest = fallback_name(flow_slug, 0);
    if name_len(&shortest) > MAX_QUEUE_NAME_LEN {
        let first_step = step_slugs.first().map(|step| {
            let readable_name = readable_name(flow_slug, step);
            FirstStepName {
                step_slug: (*step).to_owned(),
                readable_len: name_len(&readable_name),
                readable_name,
            }
        });
        return Err(QueueNameError::Flow(Box::new(FlowQueueNameError {
            flow_slug: flow_slug.to_owned(),
            fallback_len: name_len(&shortest),
            fallback_name: shortest,
            max_len: MAX_QUEUE_NAME_LEN,
            first_step,
        })));
    }
    if step_slugs.is_empty() {
        return Err(QueueNameError::EmptyFlow {
            flow_slug: flow_slug.to_owned(),
        });
    }
    let mut names: Vec<String> = Vec::with_capacity(step_slugs.len());
    for (step_index, step_slug) in step_slugs.iter().enumerate() {
        if let Err(problem) = check_slug(step_slug) {
            return Err(QueueNameError::InvalidStepSlug {
                flow_slug: flow_slug.to_owned(),
                step_slug: (*step_slug).to_owned(),
                step_index,
                problem,
            });
        }
        let name =
            resolve_step_queue(flow_slug, step_slug, step_index).map_err(QueueNameError::Step)?;
        if let Some(first_index) = names.iter().position(|n| *n == name) {
            return Err(QueueNameError::Duplicate {
                flow_slug: flow_slug.to_owned(),
                queue: name,
                first_step: step_slugs[first_index].to_owned(),
                first_index,
                second_step: (*step_slug).to_owned(),
                second_index: step_index,
            });
        }
        names.push(name);
    }
    Ok(names)
}

/// A caller-given queue name that is not a lowercase identifier of 1 to 47 characters.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidQueueNameError {
    /// The name is empty.
    #[error("queue name is empty")]
    Empty,
    /// The name has more than 47 characters.
    #[error("queue name `{name}` is {len} characters; at most 47 are allowed (the PGMQ limit)")]
    TooLong {
        /// The name as given.
        name: String,
        /// Its length in characters.
        len: usize,
    },
    /// The first character is not a lowercase ASCII letter or `_`.
    #[error("queue name `{name}` must start with a lowercase ASCII letter or `_`")]
    BadStart {
        /// The name as given.
        name: String,
    },
    /// A character other than a lowercase ASCII letter, a digit or `_`.
    #[error("queue name `{name}` contains `{found}`; queue names use only lowercase ASCII letters, digits and `_` (`^[a-z_][a-z0-9_]*$`)")]
    BadCharacter {
        /// The name as given.
        name: String,
        /// The first character that is not allowed.
        found: char,
    },
}

/// Checks a queue name chosen by a caller (rather than generated from slugs): a lowercase
/// identifier `^[a-z_][a-z0-9_]*$` of 1 to 47 characters.
///
/// The rule is stricter than PGMQ's, so every name it accepts is also accepted by PGMQ and maps to
/// its tables unchanged. PGMQ 1.11.1 checks exactly two things:
///
/// - `pgmq.validate_queue_name(queue_name)` (called by `pgmq.create` and friends) raises
///   `queue name is too long, maximum length is 47 characters` when `length(queue_name) > 47`,
///   and checks nothing else: an empty name passes;
/// - `pgmq.format_table_name(queue_name, prefix)` (called by every function that touches a queue's
///   tables) raises when the name contains `$`, `;`, `--` or `'`, and otherwise returns
///   `lower(prefix || '_' || queue_name)`, the table name (`q_<name>`, `a_<name>`) in schema `pgmq`.
///
/// So PGMQ accepts uppercase letters but lowercases them for the tables (two names that differ
/// only in case share tables), and accepts characters that need quoting. A lowercase identifier
/// avoids both: its table names are itself with a prefix, and it never needs quoting.
///
/// ```
/// use pgflow_sql::names::check_queue_name;
/// assert!(check_queue_name("billing_jobs").is_ok());
/// assert!(check_queue_name("Billing").is_err());
/// assert!(check_queue_name(&"q".repeat(48)).is_err());
/// ```
///
/// # Errors
///
/// An [`InvalidQueueNameError`] naming the first problem found.
pub fn check_queue_name(name: &str) -> Result<(), InvalidQueueNameError> {
    let mut chars = name.chars();
    let Some(first) = chars.next() else {
        return Err(InvalidQueueNameError::Empty);
    };
    let len = name_len(name);
    if len > MAX_QUEUE_NAME_LEN {
        return Err(InvalidQueueNameError::TooLong {
            name: name.to_owned(),
            len,
        });
    }
    if !(first.is_ascii_lowercase() || first == '_') {
        return Err(InvalidQueueNameError::BadStart {
            name: name.to_owned(),
        });
    }
    if let Some(found) =
        chars.find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_'))
    {
        return Err(InvalidQueueNameError::BadCharacter {
            name: name.to_owned(),
            found,
        });
    }
    Ok(())
}
