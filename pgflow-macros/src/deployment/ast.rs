//! The `#[deployment]` function as the macro sees it: the attribute's arguments, the generated
//! struct's name, and the function itself, kept verbatim so that every check and the expansion
//! point at the user's own tokens. `check` fills in the parameter and the route map.

use heck::ToUpperCamelCase;
use syn::{Attribute, ExprMatch, Ident, ItemFn, Path, Type};

use crate::attr::DeploymentAttr;

/// One `#[deployment]` function.
pub(crate) struct Deployment {
    pub(crate) attrs: DeploymentAttr,
    /// Where `pgflow_runtime` lives (`crate = ".."`).
    pub(crate) krate: Path,
    /// The generated struct (`name = ..`, or the function name in UpperCamelCase).
    pub(crate) ident: Ident,
    /// The function as written.
    pub(crate) func: ItemFn,
    /// The step-enum parameter; set by `check` when the signature is usable.
    pub(crate) param: Option<Param>,
    /// The route map; set by `check`, complete only when every arm is a route.
    pub(crate) routes: RouteMap,
}

/// The parameter of the route map: the flow's step enum.
pub(crate) struct Param {
    /// The parameter's name, which the `match` must be on.
    pub(crate) ident: Ident,
    /// The step enum as written.
    pub(crate) ty: Type,
}

/// The `match` of the body and the queue type of every arm.
#[derive(Default)]
pub(crate) struct RouteMap {
    /// The user's `match`, verbatim; `None` when the body is not one `match` on the parameter.
    pub(crate) expr: Option<ExprMatch>,
    /// The queue type each arm names, in arm order; arms that name none are left out.
    pub(crate) queues: Vec<Path>,
    /// Whether every arm is a route (no guard, a queue type as its body).
    pub(crate) arms_ok: bool,
}

impl RouteMap {
    /// The `match` when the route map is complete and can be emitted as a function.
    pub(crate) fn complete(&self) -> Option<&ExprMatch> {
        self.expr.as_ref().filter(|_| self.arms_ok)
    }

    /// Every distinct queue type, in the order of first appearance (compared as written).
    pub(crate) fn distinct_queues(&self) -> Vec<&Path> {
        let mut seen: Vec<String> = Vec::new();
        let mut out = Vec::new();
        for q in &self.queues {
            let key = quote::quote!(#q).to_string();
            if !seen.contains(&key) {
                seen.push(key);
                out.push(q);
            }
        }
        out
    }
}

impl Deployment {
    /// Reads the function; nothing is judged here.
    pub(crate) fn read(attrs: DeploymentAttr, func: ItemFn) -> Deployment {
        let ident = attrs.name.get().cloned().unwrap_or_else(|| {
            Ident::new(
                &syn::ext::IdentExt::unraw(&func.sig.ident)
                    .to_string()
                    .to_upper_camel_case(),
                func.sig.ident.span(),
            )
        });
        let krate = attrs
            .krate
            .get()
            .cloned()
            .unwrap_or_else(|| syn::parse_quote!(::pgflow_runtime));
        Deployment {
            attrs,
            krate,
            ident,
            func,
            param: None,
            routes: RouteMap::default(),
        }
    }

    /// The function's `#[cfg]` attributes, repeated on every generated item.
    pub(crate) fn cfgs(&self) -> impl Iterator<Item = &Attribute> {
        self.func.attrs.iter().filter(|a| a.path().is_ident("cfg"))
    }

    /// Every other attribute of the function (doc comments, lints, ...), carried to the struct.
    pub(crate) fn carried_attrs(&self) -> impl Iterator<Item = &Attribute> {
        self.func.attrs.iter().filter(|a| !a.path().is_ident("cfg"))
    }

    /// Whether the function has doc comments.
    pub(crate) fn has_docs(&self) -> bool {
        self.func.attrs.iter().any(|a| a.path().is_ident("doc"))
    }
}
