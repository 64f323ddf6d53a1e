//! Unit tests of the parsing, checking and expansion passes (no compiler involved).

use quote::quote;
use serde_json::json;

fn pattern(tokens: proc_macro2::TokenStream) -> serde_json::Value {
    syn::parse::Parser::parse2(crate::pattern::parse_pattern, tokens)
        .unwrap()
        .value
}

/// The expansion as text, and the messages of its `compile_error!`s.
fn expand(args: proc_macro2::TokenStream, item: proc_macro2::TokenStream) -> (String, Vec<String>) {
    let out = crate::expand_flow(args, item);
    let file: syn::File = syn::parse2(out.clone()).expect("the expansion parses");
    let errors = file
        .items
        .iter()
        .filter_map(|item| match item {
            syn::Item::Macro(m) if m.mac.path.segments.last().unwrap().ident == "compile_error" => {
                Some(m.mac.parse_body::<syn::LitStr>().unwrap().value())
            }
            _ => None,
        })
        .collect();
    (out.to_string(), errors)
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
fn a_flow_with_step_queues_gets_its_routes_at_expansion_time() {
    let (out, errors) = expand(
        quote!(slug = "communityThreadsV1", input = String, step_queues),
        quote!(
            mod community {
                #[step]
                async fn classify(t: String) -> Result<String, StepError> {
                    Ok(t)
                }
                #[step(depends_on = [classify], slug = "deliverSlack")]
                async fn deliver_slack(classify: String) -> Result<(), StepError> {
                    Ok(())
                }
            }
        ),
    );
    assert_eq!(errors, Vec::<String>::new());
    assert!(out.contains("StepQueueRoutes for community :: Community"));
    assert!(out.contains("\"communitythreadsv1__classify\""));
    assert!(out.contains("\"communitythreadsv1__deliverslack\""));
}

#[test]
fn a_flow_without_step_queues_gets_no_routes_however_long_its_names() {
    let (out, errors) = expand(
        quote!(
            slug = "the_flow_slug_here_is_exactly_forty_five_char",
            input = String
        ),
        quote!(
            mod long_names {
                #[step]
                async fn a_step_whose_readable_queue_name_is_far_too_long(
                    t: String,
                ) -> Result<String, StepError> {
                    Ok(t)
                }
            }
        ),
    );
    assert_eq!(errors, Vec::<String>::new());
    assert!(!out.contains("StepQueueRoutes"));
}

#[test]
fn every_step_whose_queue_names_are_too_long_is_reported_with_the_facts() {
    // 44 characters: `<flow>__0` is 47, but both long steps have readable names over 47 and
    // index fallbacks of 48 (indices 10 and 11).
    let mut steps = Vec::new();
    for i in 0..10u32 {
        let f = quote::format_ident!("s{}", i);
        steps.push(quote!(#[step] async fn #f(t: String) -> Result<String, StepError> { Ok(t) }));
    }
    let (out, errors) = expand(
        quote!(
            slug = "a_flow_slug_of_exactly_forty_four_characters",
            input = String,
            step_queues
        ),
        quote!(mod f {
            #(#steps)*
            #[step(slug = "deliverSlack")]
            async fn deliver(t: String) -> Result<String, StepError> { Ok(t) }
            #[step]
            async fn archive(t: String) -> Result<String, StepError> { Ok(t) }
        }),
    );
    assert_eq!(errors.len(), 2, "{errors:#?}");
    assert_eq!(
        errors[0],
        "step `deliverSlack` (index 10) of flow `a_flow_slug_of_exactly_forty_four_characters` has no queue name of at most 47 characters: \
         the readable name `a_flow_slug_of_exactly_forty_four_characters__deliverslack` is 58 characters and the index fallback \
         `a_flow_slug_of_exactly_forty_four_characters__10` is 48; shorten the step slug by at least 11 characters or the flow slug \
         by at least 1, or remove `step_queues` to run every step on the flow's single queue"
    );
    assert!(
        errors[1].starts_with("step `archive` (index 11)"),
        "{}",
        errors[1]
    );
    // The fallback still implements the trait, so `StepQueued<F>` adds no follow-on error.
    assert!(out.contains("StepQueueRoutes for f :: F"));
}

#[test]
fn an_empty_step_queued_flow_is_an_error_and_an_empty_plain_flow_is_not() {
    let (_, errors) = expand(
        quote!(slug = "empty", input = String, step_queues),
        quote!(
            mod empty {}
        ),
    );
    assert_eq!(
        errors,
        ["flow `empty` has no steps, so it cannot use per-step queues; add a `#[step]` function, or remove `step_queues`"]
    );
    let (_, errors) = expand(
        quote!(slug = "empty", input = String),
        quote!(
            mod empty {}
        ),
    );
    assert_eq!(errors, Vec::<String>::new());
}

#[test]
fn options_are_typed_slots_that_report_their_own_duplicates() {
    let (_, errors) = expand(
        quote!(
            slug = "f",
            input = String,
            step_queues,
            step_queues = true,
            timeout = 1,
            timeout = 2
        ),
        quote!(
            mod f {
                #[step(map, map)]
                async fn each(t: String) -> Result<String, StepError> {
                    Ok(t)
                }
            }
        ),
    );
    assert_eq!(
        errors,
        [
            "`step_queues` takes no value; write just `step_queues`",
            "duplicate `timeout` option",
            "duplicate `map` option",
        ]
    );
}
