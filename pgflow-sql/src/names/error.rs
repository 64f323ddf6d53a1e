//! The errors of the per-step resolver: SQL's PF010 / PF011 / PF012 (and 22023) in Rust, with
//! the exact MESSAGE / DETAIL / HINT texts of `pgflow.resolve_step_queues` and the extra facts
//! SQL does not report.

use std::fmt;

use super::SlugError;

const FLOW_TOO_LONG_HINT: &str = "Shorten the concrete flow slug or use the default single queue.";
const EMPTY_FLOW_DETAIL: &str =
    "The flow has no steps; a step-queued flow needs at least one step.";
const EMPTY_FLOW_HINT: &str = "Add a step to the flow or use the default single queue.";
const STEP_TOO_LONG_HINT: &str = "Shorten the concrete flow slug, shorten the step slug enough for the readable name, or use the default single queue.";
const DUPLICATE_DETAIL: &str =
    "Generated queue names are lowercase, so step slugs that differ only in letter case collide.";
const DUPLICATE_HINT: &str = "Rename one of the steps so the slugs differ by more than letter case, or use the default single queue.";
const INVALID_SLUG_HINT: &str = "A slug starts with a letter or underscore, continues with letters, digits or underscores, and has at most 128 characters.";

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// A flow slug too long for even the shortest per-step queue, `<flow>__0` (SQL: `PF010`).
///
/// [`message`](Self::message), [`detail`](Self::detail) and [`hint`](Self::hint) are exactly
/// SQL's MESSAGE, DETAIL and HINT. [`first_step`](Self::first_step) and
/// [`shortening_hint`](Self::shortening_hint) are extra facts SQL does not report; `Display`
/// shows SQL's three texts followed by the shortening hint.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct FlowQueueNameError {
    /// The concrete flow slug.
    pub flow_slug: String,
    /// `lower(flow_slug || '__0')`, the shortest queue name the flow needs.
    pub fallback_name: String,
    /// Length of `fallback_name` in characters.
    pub fallback_len: usize,
    /// The PGMQ limit, 47.
    pub max_len: usize,
    /// Extra (not in SQL's text): the first step and the readable name it would use; `None` for a
    /// flow without steps.
    pub first_step: Option<FirstStepName>,
}

/// The first step of a flow rejected by [`FlowQueueNameError`], with its readable queue name.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct FirstStepName {
    /// The step slug (index 0).
    pub step_slug: String,
    /// `lower(flow_slug || '__' || step_slug)`.
    pub readable_name: String,
    /// Length of `readable_name` in characters.
    pub readable_len: usize,
}

impl FlowQueueNameError {
    /// SQL's MESSAGE: `Flow "<flow>" cannot use per-step queues.`
    pub fn message(&self) -> String {
        format!("Flow \"{}\" cannot use per-step queues.", self.flow_slug)
    }

    /// SQL's DETAIL: `The shortest required queue "<lower(flow)>__0" is <n> characters; PGMQ allows at most 47.`
    pub fn detail(&self) -> String {
        format!(
            "The shortest required queue \"{}\" is {} characters; PGMQ allows at most {}.",
            self.fallback_name, self.fallback_len, self.max_len
        )
    }

    /// SQL's HINT.
    pub fn hint(&self) -> &'static str {
        FLOW_TOO_LONG_HINT
    }

    /// Extra: how many characters the flow slug must lose for `<flow>__0` to fit.
    pub fn excess(&self) -> usize {
        self.fallback_len.saturating_sub(self.max_len)
    }

    /// Extra (not SQL's text): `Remove at least <n> character(s) from the flow slug "<flow>".`
    pub fn shortening_hint(&self) -> String {
        let n = self.excess();
        format!(
            "Remove at least {n} character{} from the flow slug \"{}\".",
            plural(n),
            self.flow_slug
        )
    }
}

impl fmt::Display for FlowQueueNameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} Hint: {} {}",
            self.message(),
            self.detail(),
            self.hint(),
            self.shortening_hint()
        )
    }
}

impl std::error::Error for FlowQueueNameError {}

/// One step whose readable and index-fallback queue names are both too long (SQL: `PF011`).
///
/// [`message`](Self::message), [`detail`](Self::detail) and [`hint`](Self::hint) are exactly
/// SQL's MESSAGE, DETAIL and HINT. The candidate names (SQL's DETAIL gives only their lengths)
/// and [`shortening_hint`](Self::shortening_hint) are extra; `Display` shows SQL's texts, the
/// candidates and the shortening hint.
#[derive(Debug, Clone, PartialEq, Eq)]
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
}

impl StepQueueNameError {
    /// SQL's MESSAGE: `Cannot derive a queue for step "<step>" at index <i> in flow "<flow>".`
    pub fn message(&self) -> String {
        format!(
            "Cannot derive a queue for step \"{}\" at index {} in flow \"{}\".",
            self.step_slug, self.step_index, self.flow_slug
        )
    }

    /// SQL's DETAIL: `The readable name is <r> characters and the index fallback is <f>; PGMQ allows at most 47.`
    pub fn detail(&self) -> String {
        format!(
            "The readable name is {} characters and the index fallback is {}; PGMQ allows at most {}.",
            self.readable_len, self.fallback_len, self.max_len
        )
    }

    /// SQL's HINT.
    pub fn hint(&self) -> &'static str {
        STEP_TOO_LONG_HINT
    }

    /// Extra: how many characters the flow slug must lose for the index fallback to fit.
    pub fn flow_slug_excess(&self) -> usize {
        self.fallback_len.saturating_sub(self.max_len)
    }

    /// Extra: how many characters the step slug must lose for the readable name to fit.
    pub fn step_slug_excess(&self) -> usize {
        self.readable_len.saturating_sub(self.max_len)
    }

    /// Extra (not SQL's text): how much to remove from the flow slug or from the step slug.
    pub fn shortening_hint(&self) -> String {
        let (flow, step) = (self.flow_slug_excess(), self.step_slug_excess());
        format!(
            "Remove at least {flow} character{} from the flow slug \"{}\", or at least {step} character{} from the step slug \"{}\".",
            plural(flow),
            self.flow_slug,
            plural(step),
            self.step_slug
        )
    }
}

impl fmt::Display for StepQueueNameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} Candidates: \"{}\" and \"{}\". Hint: {} {}",
            self.message(),
            self.detail(),
            self.readable_name,
            self.fallback_name,
            self.hint(),
            self.shortening_hint()
        )
    }
}

impl std::error::Error for StepQueueNameError {}

/// Why a flow's per-step route map cannot be built: one variant per error SQL's
/// `pgflow.resolve_step_queues` raises.
///
/// [`sqlstate`](Self::sqlstate), [`message`](Self::message), [`detail`](Self::detail) and
/// [`hint`](Self::hint) are exactly SQL's SQLSTATE, MESSAGE, DETAIL and HINT for the same input.
/// `Display` shows them on one line, with the extra facts of [`FlowQueueNameError`] and
/// [`StepQueueNameError`] where there are some.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum QueueNameError {
    /// The flow slug is not a valid slug (SQL: SQLSTATE `22023`).
    #[error(
        "Flow slug \"{flow_slug}\" is not a valid slug. Hint: {INVALID_SLUG_HINT} ({problem})"
    )]
    InvalidFlowSlug {
        /// The flow slug as given.
        flow_slug: String,
        /// What is wrong with it.
        problem: SlugError,
    },
    /// The flow slug cannot fit even `<flow>__0` (SQL: `PF010`).
    #[error(transparent)]
    Flow(Box<FlowQueueNameError>),
    /// The flow has no steps, so it cannot be step-queued (SQL: `PF010`).
    #[error("Flow \"{flow_slug}\" cannot use per-step queues. {EMPTY_FLOW_DETAIL} Hint: {EMPTY_FLOW_HINT}")]
    EmptyFlow {
        /// The concrete flow slug.
        flow_slug: String,
    },
    /// A step slug is not a valid slug (SQL: SQLSTATE `22023`).
    #[error("Step slug \"{step_slug}\" at index {step_index} in flow \"{flow_slug}\" is not a valid slug. Hint: {INVALID_SLUG_HINT} ({problem})")]
    InvalidStepSlug {
        /// The concrete flow slug.
        flow_slug: String,
        /// The step slug as given.
        step_slug: String,
        /// The step's zero-based index.
        step_index: usize,
        /// What is wrong with it.
        problem: SlugError,
    },
    /// One step's readable and fallback names are both too long (SQL: `PF011`).
    #[error(transparent)]
    Step(Box<StepQueueNameError>),
    /// Two steps resolve to the same queue name: their slugs differ only in letter case (SQL: `PF012`).
    #[error("Steps \"{first_step}\" (index {first_index}) and \"{second_step}\" (index {second_index}) of flow \"{flow_slug}\" resolve to the same queue \"{queue}\". {DUPLICATE_DETAIL} Hint: {DUPLICATE_HINT}")]
    Duplicate {
        /// The concrete flow slug.
        flow_slug: String,
        /// The queue name both steps resolve to.
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

impl QueueNameError {
    /// SQL's SQLSTATE for this error: `22023`, `PF010`, `PF011` or `PF012`.
    pub fn sqlstate(&self) -> &'static str {
        match self {
            QueueNameError::InvalidFlowSlug { .. } | QueueNameError::InvalidStepSlug { .. } => {
                "22023"
            }
            QueueNameError::Flow(_) | QueueNameError::EmptyFlow { .. } => "PF010",
            QueueNameError::Step(_) => "PF011",
            QueueNameError::Duplicate { .. } => "PF012",
        }
    }

    /// SQL's MESSAGE.
    pub fn message(&self) -> String {
        match self {
            QueueNameError::InvalidFlowSlug { flow_slug, .. } => {
                format!("Flow slug \"{flow_slug}\" is not a valid slug.")
            }
            QueueNameError::Flow(e) => e.message(),
            QueueNameError::EmptyFlow { flow_slug } => {
                format!("Flow \"{flow_slug}\" cannot use per-step queues.")
            }
            QueueNameError::InvalidStepSlug {
                flow_slug,
                step_slug,
                step_index,
                ..
            } => format!(
                "Step slug \"{step_slug}\" at index {step_index} in flow \"{flow_slug}\" is not a valid slug."
            ),
            QueueNameError::Step(e) => e.message(),
            QueueNameError::Duplicate {
                flow_slug,
                queue,
                first_step,
                first_index,
                second_step,
                second_index,
            } => format!(
                "Steps \"{first_step}\" (index {first_index}) and \"{second_step}\" (index {second_index}) of flow \"{flow_slug}\" resolve to the same queue \"{queue}\"."
            ),
        }
    }

    /// SQL's DETAIL; `None` where SQL sends none (an invalid slug).
    pub fn detail(&self) -> Option<String> {
        match self {
            QueueNameError::InvalidFlowSlug { .. } | QueueNameError::InvalidStepSlug { .. } => None,
            QueueNameError::Flow(e) => Some(e.detail()),
            QueueNameError::EmptyFlow { .. } => Some(EMPTY_FLOW_DETAIL.to_owned()),
            QueueNameError::Step(e) => Some(e.detail()),
            QueueNameError::Duplicate { .. } => Some(DUPLICATE_DETAIL.to_owned()),
        }
    }

    /// SQL's HINT.
    pub fn hint(&self) -> &'static str {
        match self {
            QueueNameError::InvalidFlowSlug { .. } | QueueNameError::InvalidStepSlug { .. } => {
                INVALID_SLUG_HINT
            }
            QueueNameError::Flow(e) => e.hint(),
            QueueNameError::EmptyFlow { .. } => EMPTY_FLOW_HINT,
            QueueNameError::Step(e) => e.hint(),
            QueueNameError::Duplicate { .. } => DUPLICATE_HINT,
        }
    }

    /// The concrete flow slug.
    pub fn flow_slug(&self) -> &str {
        match self {
            QueueNameError::InvalidFlowSlug { flow_slug, .. }
            | QueueNameError::EmptyFlow { flow_slug }
            | QueueNameError::InvalidStepSlug { flow_slug, .. }
            | QueueNameError::Duplicate { flow_slug, .. } => flow_slug,
            QueueNameError::Flow(e) => &e.flow_slug,
            QueueNameError::Step(e) => &e.flow_slug,
        }
    }

    /// The step the error is about, as `(step_slug, step_index)`: the rejected step, or for a
    /// duplicate the later of the two steps. `None` for the errors about the whole flow.
    pub fn step(&self) -> Option<(&str, usize)> {
        match self {
            QueueNameError::InvalidStepSlug {
                step_slug,
                step_index,
                ..
            } => Some((step_slug, *step_index)),
            QueueNameError::Step(e) => Some((&e.step_slug, e.step_index)),
            QueueNameError::Duplicate {
                second_step,
                second_index,
                ..
            } => Some((second_step, *second_index)),
            QueueNameError::InvalidFlowSlug { .. }
            | QueueNameError::Flow(_)
            | QueueNameError::EmptyFlow { .. } => None,
        }
    }
}
