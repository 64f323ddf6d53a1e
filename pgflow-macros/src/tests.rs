//! Unit tests of the parsing and checking passes (no compiler involved).

use quote::quote;
use serde_json::json;

use crate::check::slug_problem;
use crate::queue_names::{resolve_step_queues, ResolveError};

fn pattern(tokens: proc_macro2::TokenStream) -> serde_json::Value {
    syn::parse::Parser::parse2(crate::pattern::parse_pattern, tokens)
        .unwrap()
        .value
}

#[test]
fn patterns_written_as_rust_tokens_become_json() {
    assert_eq!(
        pattern(
            quote!({ classify: { route: "help", "n": -2, f: 1.5, ok: true, none: null, list: [1, "a"], } })
        ),
        json!({"classify": {"route": "help", "n": -2, "f": 1.5, "ok": true, "none": null, "list": [1, "a"]}})
    );
    assert_eq!(pattern(quote!("{\"a\": [1]}")), json!({"a": [1]}));
}

#[test]
fn slugs_follow_sql_is_valid_slug() {
    assert!(slug_problem("greetUser").is_none());
    assert!(slug_problem("_x9").is_none());
    assert!(slug_problem(&"a".repeat(128)).is_none());
    for bad in ["", "run", "9a", "a-b", "a b", "é"] {
        assert!(slug_problem(bad).is_some(), "{bad:?} should be invalid");
    }
    assert!(slug_problem(&"a".repeat(129)).is_some());
}

#[test]
fn the_macro_resolver_matches_the_seed_examples() {
    assert_eq!(
        resolve_step_queues("communityThreadsV1", &["classify"]).unwrap(),
        ["communitythreadsv1__classify"]
    );
    let flow45 = "f".repeat(45);
    assert!(matches!(
        resolve_step_queues(&flow45, &["a"]),
        Err(ResolveError::Flow(_))
    ));
    let flow44 = "f".repeat(44);
    let steps: Vec<String> = (0..11).map(|i| format!("s{i}")).collect();
    let refs: Vec<&str> = steps.iter().map(String::as_str).collect();
    let Err(ResolveError::Step(c)) = resolve_step_queues(&flow44, &refs) else {
        panic!("index 10 cannot fit a 44-character flow")
    };
    assert_eq!(c.step_index, 10);
    assert_eq!(c.fallback.len(), 48);
}
