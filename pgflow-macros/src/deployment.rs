//! `#[deployment]`: a route map from a flow's steps to declared queues, read from a function whose
//! body is one `match` on the step enum. `ast` reads the function, `check` runs one function per
//! rule and fills in the parameter and the route map, `expand` emits the deployment (or, when the
//! route map cannot be read, just enough that code using it compiles).

use proc_macro2::{Span, TokenStream};
use quote::quote;
use syn::ItemFn;

use crate::attr::parse_deployment_attr;
use crate::ctxt::Ctxt;

mod ast;
mod check;
mod expand;

/// Everything that replaces a `#[deployment(...)]` item.
pub(crate) fn expand(args: TokenStream, item: TokenStream) -> TokenStream {
    let cx = Ctxt::default();
    let attrs = parse_deployment_attr(&cx, args);
    let func: ItemFn = match syn::parse2(item.clone()) {
        Ok(f) => f,
        Err(_) => {
            cx.error(
                Span::call_site(),
                "`#[deployment]` goes on a function whose body maps the flow's steps to queues: `fn community_v1(step: community_v1::Step) { match step { .. } }`",
            );
            let errors = cx.into_compile_errors();
            return quote!(#errors #item);
        }
    };
    let mut dep = ast::Deployment::read(attrs, func);
    check::check(&cx, &mut dep);
    let expanded = expand::expand(&dep);
    let errors = cx.into_compile_errors();
    quote!(#errors #expanded)
}
