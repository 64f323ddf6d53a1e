//! Unit tests of the parsing, checking and expansion passes (no compiler involved).

use quote::quote;
use serde_json::json;

fn pattern(tokens: proc_macro2::TokenStream) -> serde_json::Value {
    syn::parse::Parser::parse2(crate::pattern::parse_pattern, tokens)
        .unwrap()
        .value
}

/// The expansion of `#[flow]` as text, and the messages of its `compile_error!`s.
fn expand(args: proc_macro2::TokenStream, item: proc_macro2::TokenStream) -> (String, Vec<String>) {
    split(crate::expand_flow(args, item))
}

/// The expansion of `#[queue]` as text, and the messages of its `compile_error!`s.
fn expand_queue(
    args: proc_macro2::TokenStream,
    item: proc_macro2::TokenStream,
) -> (String, Vec<String>) {
    split(crate::queue::expand(args, item))
}

/// The expansion of `#[deployment]` as text, and the messages of its `compile_error!`s.
fn expand_deployment(
    args: proc_macro2::TokenStream,
    item: proc_macro2::TokenStream,
) -> (String, Vec<String>) {
    split(crate::deployment::expand(args, item))
}

fn split(out: proc_macro2::TokenStream) -> (String, Vec<String>) {
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

#[test]
fn a_flow_is_its_own_default_deployment_and_its_step_enum_names_it() {
    let flow = quote!(
        mod community {
            #[step]
            async fn classify(t: String) -> Result<String, StepError> {
                Ok(t)
            }
        }
    );
    let (out, errors) = expand(quote!(slug = "community", input = String), flow.clone());
    assert_eq!(errors, Vec::<String>::new());
    assert!(out
        .contains("impl :: pgflow_runtime :: __private :: Deployment for community :: Community"));
    assert!(out.contains("type Flow = Community ;"));
    assert!(out.contains("Routing :: FlowQueue"));
    // The fallback keeps both, so deploying a flow with errors adds no follow-on error.
    let (out, errors) = expand(
        quote!(slug = "community", input = String, timeout = 0),
        flow,
    );
    assert_eq!(errors.len(), 1);
    assert!(out.contains("Deployment for community :: Community"));
    assert!(out.contains("type Flow = Community ;"));
}

#[test]
fn queue_names_are_checked_with_the_shared_rule_and_say_how_to_fix_them() {
    let unit = quote!(
        pub struct Q;
    );
    let cases = [
        (quote!("classify_threads"), None),
        (
            quote!("ClassifyThreads"),
            Some("queue name `ClassifyThreads` must start with a lowercase ASCII letter or `_`, not `C`; write `classify_threads`"),
        ),
        (
            quote!("classify_Threads"),
            Some("queue name `classify_Threads` contains `T`; queue names use only lowercase ASCII letters, digits and `_` (`^[a-z_][a-z0-9_]*$`); write `classify_threads`"),
        ),
        (
            quote!("9lives"),
            Some("queue name `9lives` must start with a lowercase ASCII letter or `_`, not `9`; start with a lowercase ASCII letter or `_` and use only lowercase ASCII letters, digits and `_`"),
        ),
        (
            quote!("a_queue_name_of_fifty_characters_is_three_too_long"),
            Some("queue name `a_queue_name_of_fifty_characters_is_three_too_long` is 50 characters; at most 47 are allowed (the PGMQ limit); remove at least 3 characters"),
        ),
    ];
    for (name, expected) in cases {
        let (out, errors) = expand_queue(name.clone(), unit.clone());
        assert_eq!(errors, expected.into_iter().collect::<Vec<_>>(), "{name}");
        // The struct and its `Queue` impl are emitted either way: no follow-on errors.
        assert!(
            out.contains("impl :: pgflow_runtime :: __private :: Queue for Q"),
            "{out}"
        );
        assert!(out.contains(":: core :: hash :: Hash"), "{out}");
    }
}

#[test]
fn a_route_map_becomes_queue_names_and_one_routes_to_impl_per_queue() {
    let (out, errors) = expand_deployment(
        quote!(alias = "communityThreads"),
        quote!(
            /// Version 1.
            pub fn community_v1(step: community_v1::Step) {
                use community_v1::Step;
                match step {
                    Step::Classify => ClassifyThreads,
                    Step::Summarize => queues::Cpu,
                    _ => ClassifyThreads,
                }
            }
        ),
    );
    assert_eq!(errors, Vec::<String>::new());
    assert!(out.contains("pub struct CommunityV1 ;"), "{out}");
    assert!(out.contains("# [doc = r\" Version 1.\"]"), "{out}");
    assert!(out.contains(
        "type Flow = < community_v1 :: Step as :: pgflow_runtime :: __private :: FlowStep > :: Flow"
    ));
    assert!(out.contains("ALIAS : :: core :: option :: Option < & 'static str > = :: core :: option :: Option :: Some (\"communityThreads\")"));
    assert!(out.contains("Step :: Classify => < ClassifyThreads as :: pgflow_runtime :: __private :: Queue > :: NAME"));
    assert!(
        out.contains("_ => < ClassifyThreads as :: pgflow_runtime :: __private :: Queue > :: NAME")
    );
    assert!(out.contains("use community_v1 :: Step ;"));
    assert!(out.contains("Routing :: Named (community_v1)"));
    assert_eq!(
        out.matches("RoutesTo < ClassifyThreads > for CommunityV1")
            .count(),
        1
    );
    assert_eq!(
        out.matches("RoutesTo < queues :: Cpu > for CommunityV1")
            .count(),
        1
    );
}

#[test]
fn every_mistake_of_a_deployment_is_reported_and_the_fallback_still_deploys() {
    let (out, errors) = expand_deployment(
        quote!(alias = "community-threads", name = V1, alais = "x"),
        quote!(
            const fn community_v1<T>(step: community_v1::Step, extra: u8) -> &'static str {
                match step {
                    community_v1::Step::Classify if true => ClassifyThreads,
                    community_v1::Step::Summarize => "cpu",
                    _ => Cpu,
                }
            }
        ),
    );
    assert_eq!(
        errors,
        [
            "unknown `#[deployment]` option `alais`; did you mean `alias`?; expected one of: alias, name, crate",
            "invalid alias: slug `community-threads` contains `-`; slugs use only ASCII letters, digits and `_` (`^[a-zA-Z_][a-zA-Z0-9_]*$`); write `community_threads`",
            "a `#[deployment]` function is a route map, not code that runs: remove `const`",
            "a `#[deployment]` function cannot be generic: it deploys one concrete flow",
            "remove the return type: each `match` arm names a queue type, and the macro turns it into that queue's name",
            "a `#[deployment]` function takes only the flow's step enum; remove this parameter",
            "a route cannot have a guard: routes are static, one queue per step; remove `if ...` and match on the step alone",
            "a route names the queue's type, not its name: declare `#[queue(\"cpu\")] pub struct MyQueue;` once and write `MyQueue` here",
        ]
    );
    assert!(out.contains("struct V1 ;"));
    assert!(out.contains("Deployment for V1"));
    assert!(out.contains("unreachable !"));
    assert!(out.contains("RoutesTo < ClassifyThreads > for V1"));
    assert!(out.contains("RoutesTo < Cpu > for V1"));
}

#[test]
fn run_output_fields_are_optional_exactly_for_leaves_that_may_be_skipped() {
    let (out, errors) = expand(
        quote!(slug = "outputs", input = String),
        quote! {
            mod outputs {
                #[step]
                async fn root(s: String) -> Result<String, StepError> { Ok(s) }
                #[step(depends_on = [root])]
                async fn plain_leaf(root: String) -> Result<u32, StepError> { Ok(0) }
                #[step(depends_on = [root], if = { root: "x" })]
                async fn skippable_leaf(root: String) -> Result<bool, StepError> { Ok(true) }
                #[step(depends_on = [root], if = { root: "x" }, when_unmet = fail)]
                async fn failing_leaf(root: String) -> Result<i8, StepError> { Ok(1) }
                #[step(depends_on = [root], when_exhausted = skip)]
                async fn exhausted_leaf(root: String) -> Result<i16, StepError> { Ok(1) }
                #[step(depends_on = [root], when_exhausted = skip_cascade)]
                async fn cascading(root: String) -> Result<String, StepError> { Ok(root) }
                #[step(depends_on = [cascading])]
                async fn below_cascade(cascading: String) -> Result<i32, StepError> { Ok(1) }
            }
        },
    );
    assert_eq!(errors, Vec::<String>::new());
    let option = |t: &str| format!(":: core :: option :: Option < {t} >");
    for (field, ty) in [
        ("plain_leaf", "u32".to_owned()),
        ("failing_leaf", "i8".to_owned()),
        ("skippable_leaf", option("bool")),
        ("exhausted_leaf", option("i16")),
        ("below_cascade", option("i32")),
    ] {
        let decl = format!("pub {field} : {ty} ,");
        assert!(out.contains(&decl), "{decl} missing from the expansion");
    }
}
