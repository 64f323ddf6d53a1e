//! Reads the flow module: finds, parses and removes the `#[step]` attributes, reads handler signatures.

use proc_macro2::TokenStream;
use syn::spanned::Spanned;
use syn::{
    FnArg, GenericArgument, Ident, Item, ItemMod, Meta, Pat, PathArguments, ReturnType, Type,
};

use crate::attr::{parse_step_attr, StepAttr};
use crate::ctxt::Ctxt;

/// One handler parameter.
pub(crate) struct Param {
    /// The name as written (a leading `_` is allowed).
    pub(crate) name: Ident,
    /// The type without a leading `&`.
    pub(crate) ty: Type,
    /// Whether the parameter is taken by reference.
    pub(crate) by_ref: bool,
    /// Whether this is the `StepContext` parameter.
    pub(crate) is_ctx: bool,
}

impl Param {
    /// The name without a leading underscore, as matched against dependencies.
    pub(crate) fn dep_name(&self) -> String {
        let n = self.name.unraw_string();
        n.strip_prefix('_').map(str::to_owned).unwrap_or(n)
    }
}

trait UnrawString {
    fn unraw_string(&self) -> String;
}

impl UnrawString for Ident {
    fn unraw_string(&self) -> String {
        syn::ext::IdentExt::unraw(self).to_string()
    }
}

/// One `#[step]` function.
pub(crate) struct Handler {
    pub(crate) attr: StepAttr,
    pub(crate) ident: Ident,
    pub(crate) params: Vec<Param>,
    /// `T` of `Result<T, E>`.
    pub(crate) output: Option<Type>,
    /// `E` of `Result<T, E>`; `None` for `StepResult<T>` (which means `StepError`).
    pub(crate) error: Option<Type>,
    /// Whether the signature was usable (async, no generics, known return type).
    pub(crate) sig_ok: bool,
}

impl Handler {
    pub(crate) fn fn_name(&self) -> String {
        self.ident.unraw_string()
    }
}

/// Finds the `#[step]` functions in `module`, strips their attributes, and reads them.
pub(crate) fn read_steps(cx: &Ctxt, module: &mut ItemMod) -> Vec<Handler> {
    let mut handlers = Vec::new();
    let Some((_, items)) = module.content.as_mut() else {
        return handlers;
    };
    for item in items.iter_mut() {
        let attrs = match item {
            Item::Fn(f) => &mut f.attrs,
            Item::Struct(s) => &mut s.attrs,
            Item::Enum(e) => &mut e.attrs,
            Item::Const(c) => &mut c.attrs,
            Item::Static(s) => &mut s.attrs,
            Item::Impl(i) => &mut i.attrs,
            Item::Mod(m) => &mut m.attrs,
            Item::Type(t) => &mut t.attrs,
            _ => continue,
        };
        let mut step_attrs = Vec::new();
        attrs.retain(|a| {
            if a.path().is_ident("step") {
                step_attrs.push(a.clone());
                false
            } else {
                true
            }
        });
        if step_attrs.is_empty() {
            continue;
        }
        let Item::Fn(f) = item else {
            cx.error(
                step_attrs[0].span(),
                "`#[step]` goes on an `async fn` inside the flow module",
            );
            continue;
        };
        for extra in &step_attrs[1..] {
            cx.error(
                extra.span(),
                "duplicate `#[step]` attribute; put every option in one `#[step(...)]`",
            );
        }
        let tokens: TokenStream = match &step_attrs[0].meta {
            Meta::Path(_) => TokenStream::new(),
            Meta::List(l) => l.tokens.clone(),
            Meta::NameValue(nv) => {
                cx.error(nv.span(), "expected `#[step]` or `#[step(...)]`");
                TokenStream::new()
            }
        };
        let attr = parse_step_attr(cx, tokens);
        handlers.push(read_handler(cx, attr, f));
    }
    handlers
}

fn read_handler(cx: &Ctxt, attr: StepAttr, f: &syn::ItemFn) -> Handler {
    let sig = &f.sig;
    let mut sig_ok = true;
    if sig.asyncness.is_none() {
        cx.error(
            sig.fn_token.span,
            format!("step handler `{}` must be an `async fn`", sig.ident),
        );
        sig_ok = false;
    }
    if !sig.generics.params.is_empty() || sig.generics.where_clause.is_some() {
        cx.error(
            sig.generics.span(),
            "step handlers cannot be generic; the flow needs concrete types",
        );
        sig_ok = false;
    }
    if let Some(v) = &sig.variadic {
        cx.error(v.span(), "step handlers cannot be variadic");
        sig_ok = false;
    }
    let mut params = Vec::new();
    for arg in &sig.inputs {
        match arg {
            FnArg::Receiver(r) => {
                cx.error(r.span(), "step handlers are free functions; remove `self`");
                sig_ok = false;
            }
            FnArg::Typed(pt) => {
                let name = match &*pt.pat {
                    Pat::Ident(pi) if pi.by_ref.is_none() && pi.subpat.is_none() => {
                        pi.ident.clone()
                    }
                    other => {
                        cx.error(
                            other.span(),
                            "step handler parameters must be plain names: the name says which dependency (or input) the value comes from",
                        );
                        sig_ok = false;
                        continue;
                    }
                };
                let (ty, by_ref) = match &*pt.ty {
                    Type::Reference(r) if r.mutability.is_none() => ((*r.elem).clone(), true),
                    Type::Reference(r) => {
                        cx.error(
                            r.span(),
                            "a step handler cannot take `&mut`; take the value or `&T`",
                        );
                        sig_ok = false;
                        continue;
                    }
                    other => (other.clone(), false),
                };
                let is_ctx = last_segment_is(&ty, "StepContext");
                params.push(Param {
                    name,
                    ty,
                    by_ref,
                    is_ctx,
                });
            }
        }
    }
    let ctx_positions: Vec<usize> = params
        .iter()
        .enumerate()
        .filter(|(_, p)| p.is_ctx)
        .map(|(i, _)| i)
        .collect();
    for (n, &i) in ctx_positions.iter().enumerate() {
        if n > 0 {
            cx.error(
                params[i].ty.span(),
                "a step handler takes at most one `StepContext`",
            );
            sig_ok = false;
        } else if i + 1 != params.len() {
            cx.error(
                params[i].ty.span(),
                "the `StepContext` parameter must be the last parameter",
            );
            sig_ok = false;
        }
    }
    let (output, error) = match &sig.output {
        ReturnType::Default => {
            cx.error(
                sig.paren_token.span.close(),
                "a step handler must return `Result<T, E>` (for example `Result<MyOutput, StepError>`); add `-> Result<(), StepError>` for no output",
            );
            sig_ok = false;
            (None, None)
        }
        ReturnType::Type(_, ty) => match result_args(ty) {
            Some((t, e)) => {
                if matches!(t, Type::ImplTrait(_) | Type::Infer(_)) {
                    cx.error(t.span(), "the step output type must be spelled out: the macro reads it to type the dependents' parameters and the run output");
                    sig_ok = false;
                }
                (Some(t), e)
            }
            None => {
                cx.error(
                    ty.span(),
                    "a step handler must return `Result<T, E>` or `StepResult<T>` written out, so the macro can read the output type `T`",
                );
                sig_ok = false;
                (None, None)
            }
        },
    };
    Handler {
        attr,
        ident: sig.ident.clone(),
        params,
        output,
        error,
        sig_ok,
    }
}

fn last_segment_is(ty: &Type, name: &str) -> bool {
    match ty {
        Type::Path(p) if p.qself.is_none() => {
            p.path.segments.last().is_some_and(|s| s.ident == name)
        }
        _ => false,
    }
}

/// `Result<T, E>` -> `(T, Some(E))`, `StepResult<T>` -> `(T, None)`, `StepResult<T, E>` -> `(T, Some(E))`.
fn result_args(ty: &Type) -> Option<(Type, Option<Type>)> {
    let Type::Path(p) = ty else { return None };
    let seg = p.path.segments.last()?;
    let is_result = seg.ident == "Result";
    if !is_result && seg.ident != "StepResult" {
        return None;
    }
    let PathArguments::AngleBracketed(args) = &seg.arguments else {
        return None;
    };
    let types: Vec<&Type> = args
        .args
        .iter()
        .filter_map(|a| match a {
            GenericArgument::Type(t) => Some(t),
            _ => None,
        })
        .collect();
    match (is_result, types.as_slice()) {
        (true, [t, e]) => Some(((*t).clone(), Some((*e).clone()))),
        (false, [t]) => Some(((*t).clone(), None)),
        (false, [t, e]) => Some(((*t).clone(), Some((*e).clone()))),
        _ => None,
    }
}
