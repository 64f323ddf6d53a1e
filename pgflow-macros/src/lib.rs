//! Procedural macros for pgflow-rs. Use them through `pgflow_runtime`, which re-exports them.
//!
//! Layout: `attr` and `pattern` parse the arguments of every attribute, `ast` reads a flow module
//! (one item per step, its attributes and handler together) and strips `#[step]`, `check` runs one
//! function per rule and resolves what the expansion needs, `expand` and `shape` emit the code of a
//! valid flow, `fallback` the code of a flow with errors. `queue` is `#[queue]`, and `deployment`
//! (with its own `ast`, `check` and `expand`) is `#[deployment]`. The slug and queue-name rules are
//! `pgflow_sql::names`, the same module the runtime uses.

use proc_macro::TokenStream;
use quote::quote;
use syn::ItemMod;

mod ast;
mod attr;
mod check;
mod ctxt;
mod deployment;
mod expand;
mod fallback;
mod pattern;
mod queue;
mod schedule;
mod shape;

/// Returns the expansion, printed to stderr first when `PGFLOW_MACRO_DEBUG=1`.
fn debug(out: proc_macro2::TokenStream) -> TokenStream {
    if std::env::var_os("PGFLOW_MACRO_DEBUG").is_some_and(|v| v == "1") {
        eprintln!("{out}");
    }
    out.into()
}

/// Turns an inline module of `#[step]` async functions into a typed flow.
///
/// ```ignore
/// use pgflow_runtime::{flow, StepContext, StepError};
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// pub struct Thread { pub id: i64, pub text: String }
///
/// #[flow(slug = "communityThreadsV1", input = Thread, max_attempts = 3, timeout = 60)]
/// pub mod community {
///     use super::*;
///
///     #[step]                                            // root: takes the flow input
///     async fn classify(thread: Thread) -> Result<String, StepError> { Ok("help".into()) }
///
///     #[step(depends_on = [classify], if = { classify: "help" })]
///     async fn deliver_slack(classify: String, ctx: &StepContext<Community>) -> Result<(), StepError> {
///         Ok(())
///     }
/// }
/// // community::Community implements pgflow_runtime::Flow; community::Step::DeliverSlack exists.
/// ```
///
/// # Flow options
///
/// `slug = "..."` (defaults to the module name), `input = Type` (required), `max_attempts`,
/// `base_delay`, `timeout` (integers, seconds), `name = Ident` (the flow type's name, default:
/// the module name in UpperCamelCase), `crate = "::path"` (where `pgflow_runtime` lives, for
/// re-exports; give an absolute path), and the flag `step_queues`.
///
/// `step_queues` deploys the flow with one queue per step, for `StepQueued<Flow>` workers.
/// The macro then resolves every step's queue while it expands: `lower(flow_slug || '__' ||
/// step_slug)` when that has at most 47 characters (PGMQ's limit), else the index fallback
/// `lower(flow_slug || '__' || step_index)`, else a compile error on the flow slug or the step slug
/// that names both candidates, their lengths, and how many characters to remove. Without the flag
/// the flow runs on its single queue `lower(flow_slug)`, whatever the length of its step names,
/// and `StepQueued<Flow>` does not compile.
///
/// # Step options
///
/// `depends_on = [a, b]` (function names of earlier steps), `slug = "..."` (default: the
/// function name), `map` (one task per element of the flow input), `map = dep` (one task per
/// element of `dep`'s output), `if = {..}` / `if_not = {..}` (JSON containment patterns; keys
/// may be identifiers or string literals; a dependent step's top-level keys must be its
/// dependencies), `when_unmet = skip | skip_cascade | fail` (only with a condition; default
/// `skip`), `when_exhausted = skip | skip_cascade | fail` (default `fail`), `max_attempts`,
/// `base_delay`, `timeout`, `start_delay` (integers, seconds).
///
/// # Handler signatures
///
/// - a root step takes the flow input (`Input` by value, or `&Input`);
/// - a dependent step takes one parameter per dependency, named like it (`_name` also works),
///   typed as its output; `Option<T>` when that dependency may be skipped while this step still
///   runs (`when_unmet = skip`, the default with a condition, or `when_exhausted = skip`);
/// - a map step takes one element;
/// - an optional last parameter of type `StepContext<Flow>` or `&StepContext<Flow>`
///   (recognised by the type name `StepContext`);
/// - the return type is `Result<T, E>` or `StepResult<T>`, `T: Serialize + DeserializeOwned`,
///   `E: Into<StepError>`. A map step's output is `Vec<T>`.
///
/// Set `PGFLOW_MACRO_DEBUG=1` to print the expansion to stderr.
#[proc_macro_attribute]
pub fn flow(args: TokenStream, item: TokenStream) -> TokenStream {
    debug(expand_flow(args.into(), item.into()))
}

fn expand_flow(
    args: proc_macro2::TokenStream,
    item: proc_macro2::TokenStream,
) -> proc_macro2::TokenStream {
    let cx = ctxt::Ctxt::default();
    let flow_attr = attr::parse_flow_attr(&cx, args);
    let module: ItemMod = match syn::parse2(item.clone()) {
        Ok(m) => m,
        Err(_) => {
            let e = syn::Error::new(
                proc_macro2::Span::call_site(),
                "`#[flow]` goes on an inline module: `#[flow(...)] mod name { ... }`",
            )
            .to_compile_error();
            return quote!(#e #item);
        }
    };
    if module.content.is_none() {
        let e = syn::Error::new_spanned(
            &module,
            "`#[flow]` needs an inline module with a body (`mod name { ... }`); a file module (`mod name;`) cannot be read by the macro",
        )
        .to_compile_error();
        return quote!(#e #item);
    }
    let mut flow = ast::Flow::read(&cx, flow_attr, module);
    check::check(&cx, &mut flow);
    let expanded = if cx.has_errors() {
        fallback::expand(&flow)
    } else {
        expand::expand(&flow)
    };
    let errors = cx.into_compile_errors();
    quote!(#errors #expanded)
}

/// Marks a step inside a `#[flow]` module. `#[flow]` reads and removes it; used anywhere else it
/// is an error. See [`macro@flow`] for the options.
#[proc_macro_attribute]
pub fn step(_args: TokenStream, item: TokenStream) -> TokenStream {
    let item = proc_macro2::TokenStream::from(item);
    let e = syn::Error::new(
        proc_macro2::Span::call_site(),
        "`#[step]` only works on an `async fn` directly inside a `#[flow(...)]` module",
    )
    .to_compile_error();
    quote!(#e #item).into()
}

/// Declares a named, shared PGMQ queue: a unit struct implementing `pgflow_runtime::Queue`.
///
/// ```ignore
/// use pgflow_runtime::queue;
///
/// /// Classification work of every community flow version.
/// #[queue("classify_threads")]
/// pub struct ClassifyThreads;
///
/// assert_eq!(<ClassifyThreads as pgflow_runtime::Queue>::NAME, "classify_threads");
/// ```
///
/// The name is checked while the attribute expands: a lowercase identifier (`^[a-z_][a-z0-9_]*$`)
/// of 1 to 47 characters, the rule of `pgflow_runtime::sql::names::check_queue_name`, which PGMQ
/// accepts too. A bad name is an error on the literal that says what is wrong and how to fix it.
///
/// The struct keeps its visibility, doc comments and other attributes, and gains the derives a
/// marker type needs: `Debug`, `Clone`, `Copy`, `Default`, `PartialEq`, `Eq`, `Hash` (do not
/// derive these yourself). `crate = "::path"` says where `pgflow_runtime` lives, for re-exports.
///
/// Set `PGFLOW_MACRO_DEBUG=1` to print the expansion to stderr.
#[proc_macro_attribute]
pub fn queue(args: TokenStream, item: TokenStream) -> TokenStream {
    debug(queue::expand(args.into(), item.into()))
}

/// Declares a named deployment of one concrete flow version: a stable alias and a route map from
/// the flow's steps to declared queues.
///
/// Write the route map as a function that takes the flow's step enum and whose body is one
/// exhaustive `match` naming a queue type per step (`use` declarations may precede it):
///
/// ```ignore
/// use pgflow_runtime::{deployment, queue};
///
/// #[queue("classify_threads")]
/// pub struct ClassifyThreads;
/// #[queue("deliver_slack_alerts")]
/// pub struct DeliverSlackAlerts;
///
/// /// Version 1 of the community pipeline, started as `communityThreads`.
/// #[deployment(alias = "communityThreads")]
/// pub fn community_v1(step: community_v1::Step) {
///     match step {
///         community_v1::Step::Classify => ClassifyThreads,
///         community_v1::Step::DeliverSlack => DeliverSlackAlerts,
///     }
/// }
/// // `CommunityV1` implements `Deployment` (alias `Some("communityThreads")`, routing
/// // `Routing::Named`) and `RoutesTo<ClassifyThreads>` and `RoutesTo<DeliverSlackAlerts>`.
/// ```
///
/// The function becomes a unit struct named after it in UpperCamelCase (`community_v1` ->
/// `CommunityV1`), with the function's visibility, doc comments and other attributes (`#[cfg]`
/// applies to everything generated). It implements:
///
/// - `Deployment`, with `type Flow` the flow of the step enum, `ALIAS = Some(alias)` and
///   `routing()` returning `Routing::Named` of the `match`, in which each arm's queue type
///   becomes that queue's name;
/// - `RoutesTo<Q>` for every queue type the arms name, so a queue worker for `Q` accepts the
///   deployment only when it routes a step to `Q`.
///
/// The `match` stays the user's own code: a step the flow does not have is rustc's error on
/// that pattern, and a step without a route is rustc's non-exhaustive-match error, both in
/// `cargo check`. A `_ =>` arm routes every remaining step to one queue. Guards (`if`) are
/// refused: a route is static. Name each queue type the same way in every arm (the macro compares
/// paths as written, and two spellings of one type would implement `RoutesTo` twice).
///
/// # Options
///
/// `alias = "..."` (required; a valid slug, the name producers start the flow by), `name = Ident`
/// (the struct's name; needed when the default would clash with a type in scope, such as the
/// flow type `#[flow]` re-exports next to its module, which is also UpperCamelCase of the module
/// name), `crate = "::path"` (where `pgflow_runtime` lives).
///
/// Set `PGFLOW_MACRO_DEBUG=1` to print the expansion to stderr.
#[proc_macro_attribute]
pub fn deployment(args: TokenStream, item: TokenStream) -> TokenStream {
    debug(deployment::expand(args.into(), item.into()))
}

/// Declares a durable cron schedule of a flow: the function's body is the input of every run, and the
/// function becomes one returning `pgflow_runtime::schedules::Schedule` (named after the function unless
/// `name = "..."`), to pass to `WorkerBuilder::schedule` or `Schedule::set`.
///
/// ```ignore
/// #[pgflow_runtime::schedule(flow = greet::Greet, cron = "0 3 * * *", time_zone = "Europe/Paris")]
/// fn nightly_greeting() -> String {
///     "Ada".to_owned()
/// }
/// // Worker::<greet::Greet>::builder(pool).schedule(nightly_greeting())
/// ```
///
/// The cron expression (5 fields, or 6 with seconds first, or `@hourly`...) is parsed while the attribute
/// expands: an invalid one is a compile error on the literal that quotes it. Options: `flow = Type`
/// (required), `cron = "..."` (required), `time_zone = "IANA/Name"` (default UTC), `name = "..."`,
/// `catch_up = N` (catch up at most N missed fires, 1 to 1000; default: skip them), `overlap = "skip"` or
/// `"allow"` (default), `crate = "::path"`.
#[proc_macro_attribute]
pub fn schedule(args: TokenStream, item: TokenStream) -> TokenStream {
    debug(schedule::expand(args.into(), item.into()))
}

#[cfg(test)]
mod tests;
