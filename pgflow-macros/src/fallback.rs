//! The expansion of a flow with errors: just enough for the rest of the crate to keep compiling.
//!
//! The module, the flow type, the step enum, the `Flow` and `Deployment` impls (and `StepQueueRoutes`
//! when the flow asked for per-step queues) are still emitted, so code that names them reports no follow-on
//! errors and IDEs can still read them. Nothing here can run: the flow's errors stop the build.

use proc_macro2::TokenStream;
use quote::quote;
use syn::Item;

use crate::ast::Flow;
use crate::expand::{common_items, default_deployment, input_type, private, push_items};

/// Everything that replaces the `#[flow]` module of a flow with errors.
pub(crate) fn expand(flow: &Flow) -> TokenStream {
    let p = private(flow);
    let ident = &flow.ident;
    let slug = &flow.slug.value;
    let mod_ident = &flow.module.ident;
    let (generated, reexport) = common_items(flow);
    let mut module = flow.module.clone();
    // The handlers are never called from the (missing) dispatch: no dead-code warnings on top.
    if let Some((_, items)) = module.content.as_mut() {
        for item in items.iter_mut() {
            if let Item::Fn(f) = item {
                if flow.steps.iter().any(|s| s.handler.ident == f.sig.ident) {
                    f.attrs.push(syn::parse_quote!(#[allow(dead_code)]));
                }
            }
        }
    }
    push_items(&mut module, generated);
    let input = input_type(flow);
    let routes = flow.attrs.step_queues.is_set().then(|| {
        quote! {
            impl #p::StepQueueRoutes for #mod_ident::#ident {
                const ROUTES: &'static [(#mod_ident::Step, &'static str)] = &[];
            }
        }
    });
    let deployment = default_deployment(flow);
    quote! {
        #module
        #reexport
        #deployment
        impl #p::Flow for #mod_ident::#ident {
            const SLUG: &'static str = #slug;
            type Input = #input;
            type Output = #p::serde_json::Value;
            type Step = #mod_ident::Step;
            fn shape() -> #p::serde_json::Value { ::core::panic!("flow `{}` has compile errors", #slug) }
            fn dispatch(_: Self::Step, _: #p::serde_json::Value, _: #p::StepContext<Self>)
                -> #p::BoxFuture<'static, #p::Result<#p::serde_json::Value, #p::StepError>> {
                ::core::panic!("flow `{}` has compile errors", #slug)
            }
        }
        #routes
    }
}
