//! The per-step queue-name algorithm, shared verbatim by the macro and the runtime.
//!
//! This file has no dependencies so that `pgflow-runtime` can include the very same source with
//! `#[path = "../../pgflow-macros/src/queue_names.rs"]`. SQL (`pgflow-sql`) is authoritative; the
//! three implementations must agree.
//!
//! Contract (exact): names are lowercase and at most 47 characters. For the zero-based step index
//! `i`, `readable = lower(flow_slug || '__' || step_slug)` and `fallback = lower(flow_slug || '__' || i)`.
//! The readable name is used when it fits, else the fallback when it fits, else the whole flow is
//! rejected. Names are never truncated or hashed.
#![allow(dead_code)]

/// The longest queue name PGMQ accepts (`pgmq.validate_queue_name`).
pub(crate) const MAX_QUEUE_NAME_LEN: usize = 47;

/// Hint attached to a flow-level failure (the flow slug cannot fit even `<flow>__0`).
pub(crate) const FLOW_HINT: &str =
    "Shorten the concrete flow slug or use the default single queue.";

/// Hint attached to a step-level failure (readable and fallback names both too long).
pub(crate) const STEP_HINT: &str = "Shorten the concrete flow slug, shorten the step slug enough for the readable name, or use the default single queue.";

/// Hint attached to a flow whose default (single) queue name is too long.
pub(crate) const DEFAULT_QUEUE_HINT: &str = "Shorten the concrete flow slug.";

/// `lower(flow_slug || '__' || step_slug)`.
pub(crate) fn readable_name(flow_slug: &str, step_slug: &str) -> String {
    format!("{flow_slug}__{step_slug}").to_lowercase()
}

/// `lower(flow_slug || '__' || step_index)`.
pub(crate) fn fallback_name(flow_slug: &str, step_index: usize) -> String {
    format!("{flow_slug}__{step_index}").to_lowercase()
}

/// The single queue of a plain (not step-queued) flow: `lower(flow_slug)`.
pub(crate) fn default_queue_name(flow_slug: &str) -> String {
    flow_slug.to_lowercase()
}

/// Length in characters, as PostgreSQL's `length()` counts them.
pub(crate) fn name_len(name: &str) -> usize {
    name.chars().count()
}

/// Both candidate names for one step, with the facts an error needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Candidates {
    pub(crate) flow_slug: String,
    pub(crate) step_slug: String,
    pub(crate) step_index: usize,
    pub(crate) readable: String,
    pub(crate) fallback: String,
}

impl Candidates {
    /// Computes both candidates for the step at `step_index`.
    pub(crate) fn new(flow_slug: &str, step_slug: &str, step_index: usize) -> Self {
        Candidates {
            flow_slug: flow_slug.to_owned(),
            step_slug: step_slug.to_owned(),
            step_index,
            readable: readable_name(flow_slug, step_slug),
            fallback: fallback_name(flow_slug, step_index),
        }
    }

    /// The chosen name: readable if it fits, else fallback if it fits, else `None`.
    pub(crate) fn resolve(&self) -> Option<&str> {
        if name_len(&self.readable) <= MAX_QUEUE_NAME_LEN {
            Some(&self.readable)
        } else if name_len(&self.fallback) <= MAX_QUEUE_NAME_LEN {
            Some(&self.fallback)
        } else {
            None
        }
    }
}

/// Why a flow's complete route map cannot be built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ResolveError {
    /// The flow has no steps; there is nothing to route.
    Empty { flow_slug: String },
    /// The flow slug cannot fit even the shortest suffix `<flow>__0` (facts of step 0).
    Flow(Candidates),
    /// One step's readable and fallback names are both too long.
    Step(Candidates),
    /// Two steps resolve to the same queue name.
    Duplicate {
        flow_slug: String,
        queue: String,
        first: (String, usize),
        second: (String, usize),
    },
}

/// Resolves the queue of every step, in step order, or rejects the whole flow.
pub(crate) fn resolve_step_queues(
    flow_slug: &str,
    step_slugs: &[&str],
) -> Result<Vec<String>, ResolveError> {
    if step_slugs.is_empty() {
        return Err(ResolveError::Empty {
            flow_slug: flow_slug.to_owned(),
        });
    }
    let mut names: Vec<String> = Vec::with_capacity(step_slugs.len());
    for (index, step_slug) in step_slugs.iter().enumerate() {
        let candidates = Candidates::new(flow_slug, step_slug, index);
        let Some(name) = candidates.resolve() else {
            if name_len(&fallback_name(flow_slug, 0)) > MAX_QUEUE_NAME_LEN {
                return Err(ResolveError::Flow(Candidates::new(
                    flow_slug,
                    step_slugs[0],
                    0,
                )));
            }
            return Err(ResolveError::Step(candidates));
        };
        if let Some(first) = names.iter().position(|n| n == name) {
            return Err(ResolveError::Duplicate {
                flow_slug: flow_slug.to_owned(),
                queue: name.to_owned(),
                first: (step_slugs[first].to_string(), first),
                second: (step_slug.to_string(), index),
            });
        }
        names.push(name.to_owned());
    }
    Ok(names)
}

impl ResolveError {
    /// The SQL-compatible MESSAGE line.
    pub(crate) fn message(&self) -> String {
        match self {
            ResolveError::Empty { flow_slug } => {
                format!("Flow \"{flow_slug}\" cannot use per-step queues because it has no steps.")
            }
            ResolveError::Flow(c) => {
                format!("Flow \"{}\" cannot use per-step queues.", c.flow_slug)
            }
            ResolveError::Step(c) => format!(
                "Cannot derive a queue for step \"{}\" at index {} in flow \"{}\".",
                c.step_slug, c.step_index, c.flow_slug
            ),
            ResolveError::Duplicate {
                flow_slug,
                queue,
                first,
                second,
            } => format!(
                "Flow \"{flow_slug}\" cannot use per-step queues: steps \"{}\" (index {}) and \"{}\" (index {}) both resolve to queue \"{queue}\".",
                first.0, first.1, second.0, second.1
            ),
        }
    }

    /// The SQL-compatible DETAIL line.
    pub(crate) fn detail(&self) -> String {
        match self {
            ResolveError::Empty { .. } => {
                "Per-step queues route each step to its own queue; an empty flow has none.".to_owned()
            }
            ResolveError::Flow(c) => format!(
                "The shortest required queue \"{}\" is {} characters; PGMQ allows at most {MAX_QUEUE_NAME_LEN}. Step \"{}\" at index {} would use \"{}\" ({} characters).",
                c.fallback,
                name_len(&c.fallback),
                c.step_slug,
                c.step_index,
                c.readable,
                name_len(&c.readable)
            ),
            ResolveError::Step(c) => format!(
                "The readable name is {} characters and the index fallback is {}; PGMQ allows at most {MAX_QUEUE_NAME_LEN}. Candidates: \"{}\" and \"{}\".",
                name_len(&c.readable),
                name_len(&c.fallback),
                c.readable,
                c.fallback
            ),
            ResolveError::Duplicate { .. } => {
                "Generated queue names are lowercase, so step slugs that differ only in case collide."
                    .to_owned()
            }
        }
    }

    /// The SQL-compatible HINT line, with a concrete shortening target where one exists.
    pub(crate) fn hint(&self) -> String {
        match self {
            ResolveError::Empty { .. } => "Add a step or use the default single queue.".to_owned(),
            ResolveError::Flow(c) => {
                let over = name_len(&c.fallback) - MAX_QUEUE_NAME_LEN;
                format!(
                    "{FLOW_HINT} Remove at least {over} character{} from \"{}\".",
                    if over == 1 { "" } else { "s" },
                    c.flow_slug
                )
            }
            ResolveError::Step(c) => {
                let step_over = name_len(&c.readable) - MAX_QUEUE_NAME_LEN;
                let flow_over = name_len(&c.fallback) - MAX_QUEUE_NAME_LEN;
                format!(
                    "{STEP_HINT} The flow slug needs at least {flow_over} fewer character{}, or the step slug at least {step_over}.",
                    if flow_over == 1 { "" } else { "s" }
                )
            }
            ResolveError::Duplicate { .. } => {
                "Rename one of the steps so the slugs differ when lowercased.".to_owned()
            }
        }
    }

    /// MESSAGE, DETAIL and HINT on one line each.
    pub(crate) fn full_text(&self) -> String {
        format!(
            "{}\n{}\nHint: {}",
            self.message(),
            self.detail(),
            self.hint()
        )
    }
}

/// Checks the plain flow's single queue `lower(flow_slug)`; returns its length when too long.
pub(crate) fn default_queue_too_long(flow_slug: &str) -> Option<usize> {
    let len = name_len(&default_queue_name(flow_slug));
    (len > MAX_QUEUE_NAME_LEN).then_some(len)
}
