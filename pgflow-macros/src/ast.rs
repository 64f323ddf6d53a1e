//! The flow as the macro sees it: the module, its attributes, and one item per step holding the
//! step's parsed attributes, its handler signature and what the checks work out about it.
//!
//! Reading finds, parses and removes the `#[step]` attributes and reads the handler signatures;
//! `check` then validates and fills in the resolved parts (dependencies, conditions, routes).

use heck::ToUpperCamelCase;
use proc_macro2::{Span, TokenStream};
use serde_json::Value;
use syn::spanned::Spanned;
use syn::{
    Attribute, FnArg, GenericArgument, Ident, Item, ItemMod, Meta, Pat, Path, PathArguments,
    ReturnType, Signature, Type,
};

use crate::attr::{parse_step_attr, FlowAttr, Mode, StepAttr};
use crate::ctxt::Ctxt;

/// A slug with the token it comes from (a `slug = ".."` literal, or the module or function name).
pub(crate) struct Slug {
    pub(crate) value: String,
    pub(crate) span: Span,
}

/// The flow: the `#[flow(...)]` arguments, the module and its steps in source order.
pub(crate) struct Flow {
    pub(crate) attrs: FlowAttr,
    /// The module, with every `#[step]` attribute removed.
    pub(crate) module: ItemMod,
    pub(crate) slug: Slug,
    /// The generated flow type (`name = ..`, or the module name in UpperCamelCase).
    pub(crate) ident: Ident,
    /// Where `pgflow_runtime` lives (`crate = ".."`).
    pub(crate) krate: Path,
    pub(crate) steps: Vec<Step>,
    /// Every step's queue, in step order; set by `check` for a valid flow with `step_queues`.
    pub(crate) routes: Option<Vec<String>>,
}

/// Single or map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Single,
    Map,
}

/// Where a map step's array comes from.
#[derive(Debug, Clone, Copy)]
pub(crate) enum MapFrom {
    /// A root map over the flow input; the span of the `map` keyword.
    FlowInput(Span),
    /// `map = dep`; the dependency index and the span of `dep`.
    Dep(usize, Span),
}

/// A resolved dependency: the index of the step depended on, and the name as written.
pub(crate) struct Dep {
    pub(crate) index: usize,
    pub(crate) ident: Ident,
}

/// One `#[step]` function: its attributes and handler, and what `check` works out about it.
pub(crate) struct Step {
    pub(crate) attrs: StepAttr,
    pub(crate) handler: Handler,
    pub(crate) slug: Slug,
    /// The variant of the generated `Step` enum.
    pub(crate) variant: Ident,
    /// Resolved dependencies (from `depends_on`, or the source of `map = dep`).
    pub(crate) deps: Vec<Dep>,
    pub(crate) map_from: Option<MapFrom>,
    /// The `if` pattern with top-level keys as dependency slugs.
    pub(crate) if_value: Option<Value>,
    /// The `if_not` pattern with top-level keys as dependency slugs.
    pub(crate) if_not_value: Option<Value>,
    /// May be skipped while dependents still run (dependents take `Option`).
    pub(crate) skippable: bool,
    /// May be skipped together with its dependents (own or inherited `skip_cascade`).
    pub(crate) cascaded: bool,
}

impl Step {
    pub(crate) fn fn_name(&self) -> String {
        self.handler.fn_name()
    }

    pub(crate) fn kind(&self) -> Kind {
        if self.attrs.map.is_set() {
            Kind::Map
        } else {
            Kind::Single
        }
    }

    pub(crate) fn has_condition(&self) -> bool {
        self.attrs.if_pattern.is_set() || self.attrs.if_not_pattern.is_set()
    }

    /// `when_unmet`, default `skip`.
    pub(crate) fn when_unmet(&self) -> Mode {
        self.attrs.when_unmet.get().copied().unwrap_or(Mode::Skip)
    }

    /// `when_exhausted`, default `fail`.
    pub(crate) fn when_exhausted(&self) -> Mode {
        self.attrs
            .when_exhausted
            .get()
            .copied()
            .unwrap_or(Mode::Fail)
    }

    /// May be missing from the run output (own skip, or an ancestor's cascade).
    pub(crate) fn may_be_absent(&self) -> bool {
        self.skippable || self.cascaded
    }

    /// Whether the handler takes the flow input or one array element rather than dependencies.
    pub(crate) fn takes_one_value(&self) -> bool {
        self.kind() == Kind::Map || (self.deps.is_empty() && !self.attrs.depends_on.is_set())
    }
}

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
        let n = unraw(&self.name);
        n.strip_prefix('_').map(str::to_owned).unwrap_or(n)
    }
}

/// An identifier as a string, without `r#`.
pub(crate) fn unraw(ident: &Ident) -> String {
    syn::ext::IdentExt::unraw(ident).to_string()
}

/// A step function's signature.
pub(crate) struct Handler {
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
        unraw(&self.ident)
    }

    /// The parameters that carry values (all but the `StepContext`), with their positions.
    pub(crate) fn value_params(&self) -> impl Iterator<Item = (usize, &Param)> {
        self.params.iter().enumerate().filter(|(_, p)| !p.is_ctx)
    }
}

impl Flow {
    /// Reads the module: finds and strips the `#[step]` attributes and reads every step.
    pub(crate) fn read(cx: &Ctxt, attrs: FlowAttr, mut module: ItemMod) -> Flow {
        let steps = read_steps(cx, &mut module);
        let slug = match attrs.slug.get() {
            Some(l) => Slug {
                value: l.value(),
                span: l.span(),
            },
            None => Slug {
                value: module.ident.to_string(),
                span: module.ident.span(),
            },
        };
        let ident = attrs.name.get().cloned().unwrap_or_else(|| {
            Ident::new(
                &module.ident.to_string().to_upper_camel_case(),
                module.ident.span(),
            )
        });
        let krate = attrs
            .krate
            .get()
            .cloned()
            .unwrap_or_else(|| syn::parse_quote!(::pgflow_runtime));
        Flow {
            attrs,
            module,
            slug,
            ident,
            krate,
            steps,
            routes: None,
        }
    }

    /// The index of the step whose function has this name.
    pub(crate) fn step_by_fn(&self, name: &str) -> Option<usize> {
        self.steps.iter().position(|s| s.fn_name() == name)
    }
}

/// Finds the `#[step]` functions in `module`, strips their attributes, and reads them.
fn read_steps(cx: &Ctxt, module: &mut ItemMod) -> Vec<Step> {
    let mut steps = Vec::new();
    let Some((_, items)) = module.content.as_mut() else {
        return steps;
    };
    for item in items.iter_mut() {
        let step_attrs = take_step_attrs(item);
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
        steps.push(read_step(cx, f, &step_attrs));
    }
    steps
}

/// Removes the `#[step]` attributes of an item and returns them (none for an item that cannot carry any).
fn take_step_attrs(item: &mut Item) -> Vec<Attribute> {
    let attrs = match item {
        Item::Fn(f) => &mut f.attrs,
        Item::Struct(s) => &mut s.attrs,
        Item::Enum(e) => &mut e.attrs,
        Item::Const(c) => &mut c.attrs,
        Item::Static(s) => &mut s.attrs,
        Item::Impl(i) => &mut i.attrs,
        Item::Mod(m) => &mut m.attrs,
        Item::Type(t) => &mut t.attrs,
        _ => return Vec::new(),
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
    step_attrs
}

/// Reads one step: its `#[step(...)]` options (`step_attrs`, at least one) and its handler.
fn read_step(cx: &Ctxt, f: &syn::ItemFn, step_attrs: &[Attribute]) -> Step {
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
    let attrs = parse_step_attr(cx, tokens);
    let handler = read_handler(cx, f);
    let slug = match attrs.slug.get() {
        Some(l) => Slug {
            value: l.value(),
            span: l.span(),
        },
        None => Slug {
            value: handler.fn_name(),
            span: handler.ident.span(),
        },
    };
    let variant = Ident::new(
        &handler.fn_name().to_upper_camel_case(),
        handler.ident.span(),
    );
    Step {
        attrs,
        handler,
        slug,
        variant,
        deps: Vec::new(),
        map_from: None,
        if_value: None,
        if_not_value: None,
        skippable: false,
        cascaded: false,
    }
}

/// Reads a handler's signature, reporting every shape the macro cannot use.
fn read_handler(cx: &Ctxt, f: &syn::ItemFn) -> Handler {
    let sig = &f.sig;
    let mut sig_ok = check_fn_shape(cx, sig);
    let mut params = Vec::new();
    for arg in &sig.inputs {
        match read_param(cx, arg) {
            Some(param) => params.push(param),
            None => sig_ok = false,
        }
    }
    sig_ok &= check_ctx_position(cx, &params);
    let (output, error) = match read_output(cx, sig) {
        Some((output, error, output_ok)) => {
            sig_ok &= output_ok;
            (Some(output), error)
        }
        None => {
            sig_ok = false;
            (None, None)
        }
    };
    Handler {
        ident: sig.ident.clone(),
        params,
        output,
        error,
        sig_ok,
    }
}

/// Checks that a handler is an `async fn` that is neither generic nor variadic.
fn check_fn_shape(cx: &Ctxt, sig: &Signature) -> bool {
    let mut ok = true;
    if sig.asyncness.is_none() {
        cx.error(
            sig.fn_token.span,
            format!("step handler `{}` must be an `async fn`", sig.ident),
        );
        ok = false;
    }
    if !sig.generics.params.is_empty() || sig.generics.where_clause.is_some() {
        cx.error(
            sig.generics.span(),
            "step handlers cannot be generic; the flow needs concrete types",
        );
        ok = false;
    }
    if let Some(v) = &sig.variadic {
        cx.error(v.span(), "step handlers cannot be variadic");
        ok = false;
    }
    ok
}

/// Reads one handler parameter: a plain name with a type taken by value or by `&`. `None` after reporting
/// any other shape.
fn read_param(cx: &Ctxt, arg: &FnArg) -> Option<Param> {
    let pt = match arg {
        FnArg::Receiver(r) => {
            cx.error(r.span(), "step handlers are free functions; remove `self`");
            return None;
        }
        FnArg::Typed(pt) => pt,
    };
    let name = match &*pt.pat {
        Pat::Ident(pi) if pi.by_ref.is_none() && pi.subpat.is_none() => pi.ident.clone(),
        other => {
            cx.error(
                other.span(),
                "step handler parameters must be plain names: the name says which dependency (or input) the value comes from",
            );
            return None;
        }
    };
    let (ty, by_ref) = match &*pt.ty {
        Type::Reference(r) if r.mutability.is_none() => ((*r.elem).clone(), true),
        Type::Reference(r) => {
            cx.error(
                r.span(),
                "a step handler cannot take `&mut`; take the value or `&T`",
            );
            return None;
        }
        other => (other.clone(), false),
    };
    let is_ctx = last_segment_is(&ty, "StepContext");
    Some(Param {
        name,
        ty,
        by_ref,
        is_ctx,
    })
}

/// Checks that a handler takes at most one `StepContext`, as its last parameter.
fn check_ctx_position(cx: &Ctxt, params: &[Param]) -> bool {
    let mut ok = true;
    let ctx_positions = params
        .iter()
        .enumerate()
        .filter(|(_, p)| p.is_ctx)
        .map(|(i, _)| i);
    for (n, i) in ctx_positions.enumerate() {
        if n > 0 {
            cx.error(
                params[i].ty.span(),
                "a step handler takes at most one `StepContext`",
            );
            ok = false;
        } else if i + 1 != params.len() {
            cx.error(
                params[i].ty.span(),
                "the `StepContext` parameter must be the last parameter",
            );
            ok = false;
        }
    }
    ok
}

/// Reads `T` and `E` of a handler's `Result<T, E>` (or `StepResult<T>`) return type, and whether `T` is
/// spelled out. `None` after reporting a return type the macro cannot read.
fn read_output(cx: &Ctxt, sig: &Signature) -> Option<(Type, Option<Type>, bool)> {
    let ty = match &sig.output {
        ReturnType::Default => {
            cx.error(
                sig.paren_token.span.close(),
                "a step handler must return `Result<T, E>` (for example `Result<MyOutput, StepError>`); add `-> Result<(), StepError>` for no output",
            );
            return None;
        }
        ReturnType::Type(_, ty) => ty,
    };
    let Some((t, e)) = result_args(ty) else {
        cx.error(
            ty.span(),
            "a step handler must return `Result<T, E>` or `StepResult<T>` written out, so the macro can read the output type `T`",
        );
        return None;
    };
    let spelled_out = !matches!(t, Type::ImplTrait(_) | Type::Infer(_));
    if !spelled_out {
        cx.error(t.span(), "the step output type must be spelled out: the macro reads it to type the dependents' parameters and the run output");
    }
    Some((t, e, spelled_out))
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
