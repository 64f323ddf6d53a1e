//! Unit tests of the name rules; `tests/tests/sql/queue_names.rs` compares them with SQL.

use super::*;

/// A slug of exactly `len` characters, mixed case so that lowercasing matters.
fn slug(len: usize) -> String {
    let mut s = String::from("F");
    while s.len() < len {
        s.push(if s.len() % 2 == 0 { 'x' } else { 'Y' });
    }
    s
}

fn steps(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("s{i}")).collect()
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn slugs_follow_sql_is_valid_slug() {
    for good in ["greetUser", "_x9", "A", &"a".repeat(128)] {
        assert!(is_valid_slug(good), "{good:?} is valid");
    }
    assert_eq!(check_slug(""), Err(SlugError::Empty));
    assert_eq!(check_slug("run"), Err(SlugError::Reserved));
    assert!(is_valid_slug("Run"), "only lowercase `run` is reserved");
    assert!(matches!(
        check_slug(&"a".repeat(129)),
        Err(SlugError::TooLong { len: 129, .. })
    ));
    assert!(matches!(check_slug("9a"), Err(SlugError::BadStart { .. })));
    assert!(matches!(
        check_slug("a-b"),
        Err(SlugError::BadCharacter { found: '-', .. })
    ));
    assert!(matches!(check_slug("é"), Err(SlugError::BadStart { .. })));
    assert!(matches!(
        check_slug("aé"),
        Err(SlugError::BadCharacter { found: 'é', .. })
    ));
}

#[test]
fn readable_names_are_the_lowercase_flow_and_step_slugs() {
    let q = resolve_step_queues("communityThreadsV1", &["classify", "deliverSlack"]).unwrap();
    assert_eq!(
        q,
        [
            "communitythreadsv1__classify",
            "communitythreadsv1__deliverslack"
        ]
    );
    assert_eq!(
        default_queue_name("communityThreadsV1"),
        "communitythreadsv1"
    );
}

#[test]
fn a_readable_name_of_47_characters_is_used_and_one_of_48_falls_back_to_the_index() {
    let flow = slug(20);
    let (fits, too_long) = ("s".repeat(25), "t".repeat(26));
    let q = resolve_step_queues(&flow, &[&fits, &too_long]).unwrap();
    assert_eq!(q[0], readable_name(&flow, &fits));
    assert_eq!(q[0].len(), 47);
    assert_eq!(q[1], format!("{}__1", flow.to_lowercase()));
}

#[test]
fn a_flow_slug_of_44_characters_fits_its_index_fallback_exactly() {
    let flow = slug(44);
    let q = resolve_step_queues(&flow, &["a_long_step"]).unwrap();
    assert_eq!(q[0], format!("{}__0", flow.to_lowercase()));
    assert_eq!(q[0].len(), 47);
}

#[test]
fn flow_slugs_of_45_to_48_characters_are_rejected_with_sql_texts() {
    for len in 45..=48 {
        let flow = slug(len);
        let err = resolve_step_queues(&flow, &["a", "b"]).unwrap_err();
        assert_eq!(err.sqlstate(), "PF010");
        assert_eq!(err.step(), None);
        let QueueNameError::Flow(e) = &err else {
            panic!("expected a flow error for {len}, got {err:?}")
        };
        assert_eq!(
            (e.fallback_len, e.max_len, e.excess()),
            (len + 3, 47, len - 44)
        );
        let first = e.first_step.as_ref().unwrap();
        assert_eq!(first.step_slug, "a");
        assert_eq!(first.readable_len, len + 3);
        assert_eq!(
            err.message(),
            format!("Flow \"{flow}\" cannot use per-step queues.")
        );
        assert_eq!(
            err.detail().unwrap(),
            format!(
                "The shortest required queue \"{}__0\" is {} characters; PGMQ allows at most 47.",
                flow.to_lowercase(),
                len + 3
            )
        );
        assert_eq!(
            err.hint(),
            "Shorten the concrete flow slug or use the default single queue."
        );
        let n = len - 44;
        assert!(err.to_string().ends_with(&format!(
            "Remove at least {n} character{} from the flow slug \"{flow}\".",
            if n == 1 { "" } else { "s" }
        )));
    }
}

#[test]
fn a_long_flow_slug_is_reported_before_an_empty_step_list_as_sql_does() {
    let err = resolve_step_queues(&slug(45), &[]).unwrap_err();
    let QueueNameError::Flow(e) = &err else {
        panic!("expected a flow error, got {err:?}")
    };
    assert_eq!(e.first_step, None);
    let err = resolve_step_queues("empty", &[]).unwrap_err();
    assert_eq!(err.sqlstate(), "PF010");
    assert_eq!(err.message(), "Flow \"empty\" cannot use per-step queues.");
    assert_eq!(
        err.detail().unwrap(),
        "The flow has no steps; a step-queued flow needs at least one step."
    );
    assert_eq!(
        err.hint(),
        "Add a step to the flow or use the default single queue."
    );
}

#[test]
fn index_ten_uses_its_fallback_when_it_fits_and_rejects_the_flow_when_it_does_not() {
    let mut names = steps(10);
    names.push("deliverSlack".into());
    let flow = slug(43);
    let q = resolve_step_queues(&flow, &refs(&names)).unwrap();
    assert_eq!(q[10], format!("{}__10", flow.to_lowercase()));
    assert_eq!(q[10].len(), 47);

    let flow = slug(44);
    let err = resolve_step_queues(&flow, &refs(&names)).unwrap_err();
    assert_eq!(err.sqlstate(), "PF011");
    assert_eq!(err.step(), Some(("deliverSlack", 10)));
    let QueueNameError::Step(e) = &err else {
        panic!("expected a step error, got {err:?}")
    };
    assert_eq!((e.readable_len, e.fallback_len), (58, 48));
    assert_eq!((e.flow_slug_excess(), e.step_slug_excess()), (1, 11));
    assert_eq!(
        err.message(),
        format!("Cannot derive a queue for step \"deliverSlack\" at index 10 in flow \"{flow}\".")
    );
    assert_eq!(
        err.detail().unwrap(),
        "The readable name is 58 characters and the index fallback is 48; PGMQ allows at most 47."
    );
    assert_eq!(err.hint(), "Shorten the concrete flow slug, shorten the step slug enough for the readable name, or use the default single queue.");
    assert!(err.to_string().ends_with(&format!(
        "Remove at least 1 character from the flow slug \"{flow}\", or at least 11 characters from the step slug \"deliverSlack\"."
    )));
}

#[test]
fn step_slugs_equal_when_lowercased_collide_with_sql_texts() {
    let err = resolve_step_queues("comm", &["fetch", "Fetch"]).unwrap_err();
    assert_eq!(err.sqlstate(), "PF012");
    assert_eq!(err.step(), Some(("Fetch", 1)));
    assert_eq!(
        err.message(),
        "Steps \"fetch\" (index 0) and \"Fetch\" (index 1) of flow \"comm\" resolve to the same queue \"comm__fetch\"."
    );
    assert_eq!(
        err.detail().unwrap(),
        "Generated queue names are lowercase, so step slugs that differ only in letter case collide."
    );
    assert_eq!(err.hint(), "Rename one of the steps so the slugs differ by more than letter case, or use the default single queue.");
}

#[test]
fn invalid_slugs_are_rejected_in_sql_order() {
    let err = resolve_step_queues("my-flow", &["a"]).unwrap_err();
    assert_eq!(err.sqlstate(), "22023");
    assert_eq!(err.message(), "Flow slug \"my-flow\" is not a valid slug.");
    assert_eq!(err.detail(), None);
    // Steps are checked in order: at index 10 a 44-character flow fits no name of a long step.
    let flow = slug(44);
    let mut names = steps(10);
    names.extend(["too_long".into(), "run".into()]);
    let err = resolve_step_queues(&flow, &refs(&names)).unwrap_err();
    assert_eq!(
        (err.sqlstate(), err.step()),
        ("PF011", Some(("too_long", 10)))
    );
    names.swap(10, 11);
    let err = resolve_step_queues(&flow, &refs(&names)).unwrap_err();
    assert_eq!((err.sqlstate(), err.step()), ("22023", Some(("run", 10))));
    assert_eq!(
        err.message(),
        format!("Step slug \"run\" at index 10 in flow \"{flow}\" is not a valid slug.")
    );
    assert_eq!(err.hint(), "A slug starts with a letter or underscore, continues with letters, digits or underscores, and has at most 128 characters.");
}

#[test]
fn caller_given_queue_names_are_lowercase_identifiers_of_at_most_47_characters() {
    for good in ["a", "_", "billing_jobs_2", &"q".repeat(47)] {
        assert_eq!(check_queue_name(good), Ok(()), "{good:?}");
    }
    assert_eq!(check_queue_name(""), Err(InvalidQueueNameError::Empty));
    assert!(matches!(
        check_queue_name(&"q".repeat(48)),
        Err(InvalidQueueNameError::TooLong { len: 48, .. })
    ));
    for bad_start in ["Billing", "2jobs", "-x"] {
        assert!(matches!(
            check_queue_name(bad_start),
            Err(InvalidQueueNameError::BadStart { .. })
        ));
    }
    for (bad, found) in [
        ("jobS", 'S'),
        ("a-b", '-'),
        ("a;b", ';'),
        ("a$", '$'),
        ("a'b", '\''),
    ] {
        assert_eq!(
            check_queue_name(bad),
            Err(InvalidQueueNameError::BadCharacter {
                name: bad.to_owned(),
                found
            })
        );
    }
    // Every generated default queue of a valid flow slug is such a name.
    assert_eq!(
        check_queue_name(&default_queue_name("communityThreadsV1")),
        Ok(())
    );
}

#[test]
fn display_shows_sql_message_detail_and_hint_on_one_line() {
    let flow = slug(44);
    let mut long = steps(10);
    long.push("too_long".into());
    for (flow, steps) in [
        ("my-flow".to_owned(), vec!["a".to_owned()]),
        (slug(45), vec!["a".to_owned()]),
        ("empty".to_owned(), vec![]),
        ("f".to_owned(), vec!["run".to_owned()]),
        (flow, long),
        (
            "comm".to_owned(),
            vec!["fetch".to_owned(), "Fetch".to_owned()],
        ),
    ] {
        let err = resolve_step_queues(&flow, &refs(&steps)).unwrap_err();
        let text = err.to_string();
        let expected = match err.detail() {
            Some(detail) => format!("{} {detail}", err.message()),
            None => err.message(),
        };
        assert!(text.starts_with(&expected), "{text}");
        assert!(text.contains(&format!("Hint: {}", err.hint())), "{text}");
        assert_eq!(err.flow_slug(), flow);
    }
}
