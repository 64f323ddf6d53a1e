//! Validates a `#[deployment]` function, one function per rule, and fills in the parameter and the
//! route map. Errors are collected. Which steps exist and whether every step has a route are left
//! to rustc: the expansion keeps the user's `match`, so an unknown step is rustc's error on the
//! user's pattern and a missing route is rustc's non-exhaustive-match error on the user's `match`.

use proc_macro2::Span;
use quote::ToTokens;
use syn::spanned::Spanned;
use syn::{Expr, ExprMatch, FnArg, Item, Pat, Path, ReturnType, Signature, Stmt};

use crate::ctxt::Ctxt;
use crate::deployment::ast::{Deployment, Param, RouteMap};
use pgflow_sql::names::{self, SlugError};

/// Runs every rule and fills in what the expansion needs.
pub(crate) fn check(cx: &Ctxt, dep: &mut Deployment) {
    alias(cx, dep);
    let param = signature(cx, dep);
    dep.routes = route_map(cx, dep, param.as_ref());
    dep.param = param;
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// `alias = ".."` is given and is a valid slug (SQL `pgflow.is_valid_slug`).
fn alias(cx: &Ctxt, dep: &Deployment) {
    let Some(lit) = dep.attrs.alias.get() else {
        cx.error(
            Span::call_site(),
            "missing `alias = \"...\"` in `#[deployment(...)]`: the stable name producers start this flow by, e.g. `alias = \"communityThreads\"`",
        );
        return;
    };
    let value = lit.value();
    let Err(problem) = names::check_slug(&value) else {
        return;
    };
    let fix = match &problem {
        SlugError::TooLong { len, .. } => {
            let over = len - names::MAX_SLUG_LEN;
            format!("; remove at least {over} character{}", plural(over))
        }
        SlugError::BadStart { .. } | SlugError::BadCharacter { .. } => {
            let fixed: String = value
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '_' {
                        c
                    } else {
                        '_'
                    }
                })
                .collect();
            if names::is_valid_slug(&fixed) {
                format!("; write `{fixed}`")
            } else {
                String::new()
            }
        }
        _ => String::new(),
    };
    cx.error(lit.span(), format!("invalid alias: {problem}{fix}"));
}

/// A plain `fn` with one parameter, a name typed as the flow's step enum, and no return type.
fn signature(cx: &Ctxt, dep: &Deployment) -> Option<Param> {
    let sig = &dep.func.sig;
    check_plain_fn(cx, sig);
    step_param(cx, sig)
}

/// Reports what makes the function more than a route map: qualifiers, an ABI, generics, a variadic
/// parameter, a return type.
fn check_plain_fn(cx: &Ctxt, sig: &Signature) {
    let not_code = |span: Span, what: &str| {
        cx.error(
            span,
            format!(
                "a `#[deployment]` function is a route map, not code that runs: remove `{what}`"
            ),
        );
    };
    if let Some(t) = &sig.constness {
        not_code(t.span, "const");
    }
    if let Some(t) = &sig.asyncness {
        not_code(t.span, "async");
    }
    if let Some(t) = &sig.unsafety {
        not_code(t.span, "unsafe");
    }
    if let Some(abi) = &sig.abi {
        cx.spanned(
            abi,
            "a `#[deployment]` function is a route map, not code that runs: remove the ABI",
        );
    }
    if !sig.generics.params.is_empty() || sig.generics.where_clause.is_some() {
        cx.spanned(
            &sig.generics,
            "a `#[deployment]` function cannot be generic: it deploys one concrete flow",
        );
    }
    if let Some(v) = &sig.variadic {
        cx.error(
            v.span(),
            "a `#[deployment]` function takes only the flow's step enum; remove `...`",
        );
    }
    if let ReturnType::Type(arrow, ty) = &sig.output {
        cx.spanned(
            quote::quote!(#arrow #ty),
            "remove the return type: each `match` arm names a queue type, and the macro turns it into that queue's name",
        );
    }
}

/// The one parameter, a plain name; every other parameter is reported.
fn step_param(cx: &Ctxt, sig: &Signature) -> Option<Param> {
    let mut inputs = sig.inputs.iter();
    let Some(first) = inputs.next() else {
        cx.error(
            sig.paren_token.span.join(),
            format!(
                "a `#[deployment]` function takes the flow's step enum: `fn {}(step: my_flow::Step)`",
                sig.ident
            ),
        );
        return None;
    };
    for extra in inputs {
        cx.spanned(
            extra,
            "a `#[deployment]` function takes only the flow's step enum; remove this parameter",
        );
    }
    match first {
        FnArg::Receiver(r) => {
            cx.spanned(
                r,
                "a `#[deployment]` function takes the flow's step enum, not `self`: `step: my_flow::Step`",
            );
            None
        }
        FnArg::Typed(pt) => match &*pt.pat {
            Pat::Ident(pi) if pi.by_ref.is_none() && pi.subpat.is_none() => Some(Param {
                ident: pi.ident.clone(),
                ty: (*pt.ty).clone(),
            }),
            other => {
                cx.spanned(
                    other,
                    "name the step parameter, e.g. `step`: the body matches on it",
                );
                None
            }
        },
    }
}

/// The body is one `match` on the parameter (after any `use` declarations) whose arms each name a
/// queue type, without guards.
fn route_map(cx: &Ctxt, dep: &Deployment, param: Option<&Param>) -> RouteMap {
    let Some(expr) = body_match(cx, dep, param) else {
        return RouteMap::default();
    };
    let mut routes = RouteMap {
        expr: None,
        queues: Vec::new(),
        arms_ok: true,
    };
    for arm in &expr.arms {
        if let Some((if_token, guard)) = &arm.guard {
            cx.spanned(
                quote::quote!(#if_token #guard),
                "a route cannot have a guard: routes are static, one queue per step; remove `if ...` and match on the step alone",
            );
            routes.arms_ok = false;
        }
        match queue_path(&arm.body) {
            Ok(path) => routes.queues.push(path.clone()),
            Err(msg) => {
                cx.spanned(&arm.body, msg);
                routes.arms_ok = false;
            }
        }
    }
    routes.expr = Some(expr.clone());
    routes
}

/// The body's single `match` (after any `use` declarations), when it matches on the parameter.
fn body_match<'a>(cx: &Ctxt, dep: &'a Deployment, param: Option<&Param>) -> Option<&'a ExprMatch> {
    let shape = "the body of a `#[deployment]` function is one `match` on its parameter, mapping every step to a queue type: `match step { my_flow::Step::Classify => ClassifyThreads, .. }`";
    let block = &dep.func.block;
    let rest: Vec<&Stmt> = block
        .stmts
        .iter()
        .skip_while(|s| matches!(s, Stmt::Item(Item::Use(_))))
        .collect();
    let expr = match rest.as_slice() {
        [Stmt::Expr(Expr::Match(m), _)] => m,
        [] => {
            cx.error(block.brace_token.span.join(), shape);
            return None;
        }
        [Stmt::Expr(other, _)] => {
            cx.spanned(other, shape);
            return None;
        }
        [first, ..] => {
            let not_match = rest
                .iter()
                .find(|s| !matches!(s, Stmt::Expr(Expr::Match(_), _)))
                .unwrap_or(first);
            cx.spanned(not_match, shape);
            return None;
        }
    };
    let param = param?;
    let on_param = match &*expr.expr {
        Expr::Path(p) => p.qself.is_none() && p.path.is_ident(&param.ident),
        _ => false,
    };
    if !on_param {
        cx.spanned(
            &expr.expr,
            format!(
                "match on the step parameter: `match {} {{ .. }}`",
                param.ident
            ),
        );
        return None;
    }
    Some(expr)
}

/// An arm's body: the path of a queue type, or the message saying what to write instead.
fn queue_path(body: &Expr) -> Result<&Path, String> {
    match body {
        Expr::Path(p) if p.qself.is_none() && p.attrs.is_empty() => Ok(&p.path),
        Expr::Lit(l) if matches!(l.lit, syn::Lit::Str(_)) => Err(format!(
            "a route names the queue's type, not its name: declare `#[queue({})] pub struct MyQueue;` once and write `MyQueue` here",
            l.lit.to_token_stream()
        )),
        _ => Err(
            "a route is the path of a queue type declared with `#[queue(\"...\")]`, e.g. `ClassifyThreads`"
                .to_owned(),
        ),
    }
}
