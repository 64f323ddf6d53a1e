//! Per-step queue names at run time: the same algorithm the macro runs at expansion time.
//!
//! The algorithm itself lives in `pgflow-macros/src/queue_names.rs` and is compiled into both
//! crates from that one file, so the macro and the runtime cannot drift apart.

#[path = "../../pgflow-macros/src/queue_names.rs"]
mod shared;

pub use crate::error::{FlowQueueNameError, QueueNameError, StepQueueNameError};

/// The longest queue name PGMQ accepts.
pub const MAX_QUEUE_NAME_LEN: usize = shared::MAX_QUEUE_NAME_LEN;

/// `lower(flow_slug || '__' || step_slug)`, the preferred per-step queue name.
pub fn readable_name(flow_slug: &str, step_slug: &str) -> String {
    shared::readable_name(flow_slug, step_slug)
}

/// `lower(flow_slug || '__' || step_index)`, the fallback per-step queue name.
pub fn fallback_name(flow_slug: &str, step_index: usize) -> String {
    shared::fallback_name(flow_slug, step_index)
}

/// The single queue of a plain flow, `lower(flow_slug)`.
pub fn default_queue_name(flow_slug: &str) -> String {
    shared::default_queue_name(flow_slug)
}

/// Resolves every step's queue, in step order, or rejects the whole flow.
///
/// ```
/// use pgflow_runtime::queue_names::resolve_step_queues;
/// let queues = resolve_step_queues("communityThreadsV1", &["classify", "deliverSlack"]).unwrap();
/// assert_eq!(queues, ["communitythreadsv1__classify", "communitythreadsv1__deliverslack"]);
/// ```
///
/// # Errors
///
/// [`QueueNameError::Flow`] when even `<flow>__0` is longer than 47 characters,
/// [`QueueNameError::Step`] when one step's readable and fallback names are both too long,
/// [`QueueNameError::EmptyFlow`] for a flow without steps, and [`QueueNameError::Duplicate`]
/// when two names collide.
pub fn resolve_step_queues(
    flow_slug: &str,
    step_slugs: &[&str],
) -> Result<Vec<String>, QueueNameError> {
    shared::resolve_step_queues(flow_slug, step_slugs).map_err(convert)
}

fn convert(e: shared::ResolveError) -> QueueNameError {
    let (message, detail, hint) = (e.message(), e.detail(), e.hint());
    match e {
        shared::ResolveError::Empty { flow_slug } => QueueNameError::EmptyFlow { flow_slug },
        shared::ResolveError::Flow(c) => QueueNameError::Flow(Box::new(FlowQueueNameError {
            readable_len: shared::name_len(&c.readable),
            fallback_len: shared::name_len(&c.fallback),
            flow_slug: c.flow_slug,
            step_slug: c.step_slug,
            step_index: c.step_index,
            readable_name: c.readable,
            fallback_name: c.fallback,
            max_len: MAX_QUEUE_NAME_LEN,
            message,
            detail,
            hint,
        })),
        shared::ResolveError::Step(c) => QueueNameError::Step(Box::new(StepQueueNameError {
            readable_len: shared::name_len(&c.readable),
            fallback_len: shared::name_len(&c.fallback),
            flow_slug: c.flow_slug,
            step_slug: c.step_slug,
            step_index: c.step_index,
            readable_name: c.readable,
            fallback_name: c.fallback,
            max_len: MAX_QUEUE_NAME_LEN,
            message,
            detail,
            hint,
        })),
        shared::ResolveError::Duplicate {
            flow_slug,
            queue,
            first,
            second,
        } => QueueNameError::Duplicate {
            flow_slug,
            queue,
            first_step: first.0,
            first_index: first.1,
            second_step: second.0,
            second_index: second.1,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slug(len: usize) -> String {
        let mut s = String::from("f");
        while s.len() < len {
            s.push('x');
        }
        s
    }

    #[test]
    fn readable_name_is_lowercase_flow_and_step() {
        let q = resolve_step_queues("communityThreadsV1", &["classify"]).unwrap();
        assert_eq!(q, ["communitythreadsv1__classify"]);
    }

    #[test]
    fn flow_slugs_of_44_characters_still_fit_index_fallback() {
        let flow = slug(44);
        let long_step = "s".repeat(10);
        let q = resolve_step_queues(&flow, &[&long_step]).unwrap();
        assert_eq!(q[0], format!("{flow}__0"));
        assert_eq!(q[0].len(), 47);
    }

    #[test]
    fn flow_slugs_of_45_to_48_characters_are_rejected_as_a_whole() {
        for len in 45..=48 {
            let flow = slug(len);
            let err = resolve_step_queues(&flow, &["a", "b"]).unwrap_err();
            let QueueNameError::Flow(e) = err else {
                panic!("expected flow error for {len}, got {err:?}")
            };
            assert_eq!(e.fallback_len, len + 3);
            assert_eq!(e.step_index, 0);
            assert_eq!(e.step_slug, "a");
            assert_eq!(e.max_len, 47);
            assert_eq!(
                e.message,
                format!("Flow \"{flow}\" cannot use per-step queues.")
            );
            assert!(e.detail.starts_with(&format!(
                "The shortest required queue \"{flow}__0\" is {} characters; PGMQ allows at most 47.",
                len + 3
            )));
            assert!(e
                .hint
                .starts_with("Shorten the concrete flow slug or use the default single queue."));
        }
    }

    #[test]
    fn readable_name_of_exactly_47_characters_is_used() {
        let flow = slug(20);
        let step = "s".repeat(25);
        let q = resolve_step_queues(&flow, &[&step]).unwrap();
        assert_eq!(q[0].len(), 47);
        assert_eq!(q[0], format!("{flow}__{step}"));
    }

    #[test]
    fn readable_name_of_48_characters_falls_back_to_the_index() {
        let flow = slug(20);
        let step = "s".repeat(26);
        let q = resolve_step_queues(&flow, &[&step]).unwrap();
        assert_eq!(q[0], format!("{flow}__0"));
    }

    #[test]
    fn index_fallback_at_10_and_above_counts_every_digit() {
        let flow = slug(43);
        let mut steps: Vec<String> = (0..12).map(|i| format!("step{i}")).collect();
        steps[10] = "a_very_long_step_name".into();
        let refs: Vec<&str> = steps.iter().map(String::as_str).collect();
        // 43 + 2 + 2 = 47: every fallback fits, readable names are longer.
        let q = resolve_step_queues(&flow, &refs).unwrap();
        assert_eq!(q[10], format!("{flow}__10"));
        assert_eq!(q[11], format!("{flow}__11"));
        let flow = slug(44);
        let err = resolve_step_queues(&flow, &refs).unwrap_err();
        let QueueNameError::Step(e) = err else {
            panic!("expected step error, got {err:?}")
        };
        assert_eq!(e.step_index, 10);
        assert_eq!(e.step_slug, "a_very_long_step_name");
        assert_eq!(e.fallback_len, 48);
        assert_eq!(e.readable_len, 44 + 2 + 21);
        assert_eq!(
            e.message,
            format!("Cannot derive a queue for step \"a_very_long_step_name\" at index 10 in flow \"{flow}\".")
        );
        assert!(e.detail.starts_with(
            "The readable name is 67 characters and the index fallback is 48; PGMQ allows at most 47."
        ));
        assert!(e.to_string().contains("Shorten the concrete flow slug, shorten the step slug enough for the readable name, or use the default single queue."));
    }

    #[test]
    fn index_fallback_at_10_is_used_when_it_fits() {
        let flow = slug(43);
        let steps: Vec<String> = (0..11).map(|i| format!("a_long_step_{i}")).collect();
        let refs: Vec<&str> = steps.iter().map(String::as_str).collect();
        let q = resolve_step_queues(&flow, &refs).unwrap();
        assert_eq!(q[10], format!("{flow}__10"));
        assert_eq!(q[10].len(), 47);
        assert_eq!(q[9], format!("{flow}__9"));
    }

    #[test]
    fn empty_flows_cannot_be_step_queued() {
        let err = resolve_step_queues("empty", &[]).unwrap_err();
        assert!(matches!(err, QueueNameError::EmptyFlow { .. }));
    }

    #[test]
    fn slugs_equal_when_lowercased_collide() {
        let err = resolve_step_queues("f", &["fooBar", "foobar"]).unwrap_err();
        let QueueNameError::Duplicate {
            queue,
            first_index,
            second_index,
            ..
        } = err
        else {
            panic!("expected duplicate")
        };
        assert_eq!(queue, "f__foobar");
        assert_eq!((first_index, second_index), (0, 1));
    }
}
