//! Procedural macros for pgflow-rs. Use them through `pgflow_runtime`, which re-exports them.
//!
//! Layout: `attr` and `pattern` parse arguments, `ast` reads the module and strips `#[step]`,
//! `check` validates and builds the model, `expand` emits code, `queue_names` is the per-step
//! queue-name algorithm shared with the runtime.

use proc_macro::TokenStream;
use quote::quote;
use syn::ItemMod;

mod ast;
mod attr;
mod check;
mod ctxt;
mod expand;
mod pattern;
mod queue_names;

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
/// re-exports; give an absolute path).
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
    let out = expand_flow(args.into(), item.into());
    if std::env::var_os("PGFLOW_MACRO_DEBUG").is_some_and(|v| v == "1") {
        eprintln!("{out}");
    }
    out.into()
}

fn expand_flow(
    args: proc_macro2::TokenStream,
    item: proc_macro2::TokenStream,
) -> proc_macro2::TokenStream {
    let cx = ctxt::Ctxt::default();
    let flow_attr = attr::parse_flow_attr(&cx, args);
    let mut module: ItemMod = match syn::parse2(item.clone()) {
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
    let handlers = ast::read_steps(&cx, &mut module);
    let model = check::check(&cx, &flow_attr, &module, &handlers);
    let ok = !cx.has_errors();
    let expanded = expand::expand(&model, module, &handlers, flow_attr.input.as_ref(), ok);
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

#[cfg(test)]
mod tests;
