//! Validates the parsed flow and builds the model the expansion reads. All errors are collected.

use std::collections::HashMap;

use heck::ToUpperCamelCase;
use proc_macro2::Span;
use serde_json::{Map, Value};
use syn::{Ident, ItemMod, Path};

use crate::ast::Handler;
use crate::attr::{FlowAttr, IntOpt, Mode};
use crate::ctxt::{did_you_mean, Ctxt};
use crate::queue_names;

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

/// One validated step.
pub(crate) struct StepModel {
    pub(crate) slug: String,
    pub(crate) slug_span: Span,
    pub(crate) variant: Ident,
    pub(crate) kind: Kind,
    pub(crate) deps: Vec<usize>,
    pub(crate) map_from: Option<MapFrom>,
    pub(crate) if_value: Option<Value>,
    pub(crate) if_not_value: Option<Value>,
    pub(crate) when_unmet: Mode,
    pub(crate) when_exhausted: Mode,
    /// May be skipped while dependents still run (dependents take `Option`).
    pub(crate) skippable: bool,
    /// May be missing from the run output (own skip, or an ancestor's cascade).
    pub(crate) may_be_absent: bool,
    /// May be skipped together with its dependents (own or inherited `skip_cascade`).
    pub(crate) cascaded: bool,
    pub(crate) options: Map<String, Value>,
}

/// The validated flow.
pub(crate) struct Model {
    pub(crate) slug: String,
    pub(crate) slug_span: Span,
    pub(crate) flow_ident: Ident,
    pub(crate) krate: Path,
    pub(crate) options: Map<String, Value>,
    pub(crate) steps: Vec<StepModel>,
}

/// The same rules as SQL `pgflow.is_valid_slug`.
pub(crate) fn slug_problem(s: &str) -> Option<String> {
    let len = s.chars().count();
    if s.is_empty() {
        return Some("slug is empty".into());
    }
    if len > 128 {
        return Some(format!("slug is {len} characters; at most 128 are allowed"));
    }
    if s == "run" {
        return Some("slug `run` is reserved; choose another name".into());
    }
    let first = s.chars().next().unwrap_or('_');
    if !(first.is_ascii_alphabetic() || first == '_') {
        return Some(format!("slug `{s}` must start with an ASCII letter or `_`"));
    }
    if let Some(bad) = s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '_'))
    {
        return Some(format!(
            "slug `{s}` contains `{bad}`; slugs use only ASCII letters, digits and `_` (`^[a-zA-Z_][a-zA-Z0-9_]*$`)"
        ));
    }
    None
}

fn option(
    cx: &Ctxt,
    out: &mut Map<String, Value>,
    key: &str,
    name: &str,
    opt: Option<IntOpt>,
    min: i64,
) {
    let Some(o) = opt else { return };
    if o.value < min {
        let rule = if min == 0 {
            "at least 0"
        } else {
            "greater than 0"
        };
        cx.error(
            o.span,
            format!(
                "`{name}` must be {rule} (a database CHECK), found {}",
                o.value
            ),
        );
    } else if o.value > i64::from(i32::MAX) {
        cx.error(
            o.span,
            format!(
                "`{name}` must fit an `int` (at most 2147483647), found {}",
                o.value
            ),
        );
    }
    out.insert(key.into(), Value::from(o.value));
}

/// Checks everything the macro can check and builds the model (possibly partial on errors).
pub(crate) fn check(cx: &Ctxt, attr: &FlowAttr, module: &ItemMod, handlers: &[Handler]) -> Model {
    let (slug, slug_span) = match &attr.slug {
        Some(l) => (l.value(), l.span()),
        None => (module.ident.to_string(), module.ident.span()),
    };
    if let Some(p) = slug_problem(&slug) {
        cx.error(slug_span, format!("invalid flow {p}"));
    } else if let Some(len) = queue_names::default_queue_too_long(&slug) {
        cx.error(
            slug_span,
            format!(
                "flow slug `{slug}` is {len} characters, but its queue name `{}` must be at most {} characters (the PGMQ limit); shorten the slug by at least {} character{}",
                queue_names::default_queue_name(&slug),
                queue_names::MAX_QUEUE_NAME_LEN,
                len - queue_names::MAX_QUEUE_NAME_LEN,
                if len - queue_names::MAX_QUEUE_NAME_LEN == 1 { "" } else { "s" }
            ),
        );
    }
    if attr.input.is_none() {
        cx.error(
            Span::call_site(),
            "missing `input = Type` in `#[flow(...)]`: the type of the run input (use `serde_json::Value` for untyped input)",
        );
    }
    let mut options = Map::new();
    option(
        cx,
        &mut options,
        "maxAttempts",
        "max_attempts",
        attr.max_attempts,
        0,
    );
    option(
        cx,
        &mut options,
        "baseDelay",
        "base_delay",
        attr.base_delay,
        0,
    );
    option(cx, &mut options, "timeout", "timeout", attr.timeout, 1);

    let flow_ident = attr.name.clone().unwrap_or_else(|| {
        Ident::new(
            &module.ident.to_string().to_upper_camel_case(),
            module.ident.span(),
        )
    });
    let krate = attr
        .krate
        .clone()
        .unwrap_or_else(|| syn::parse_quote!(::pgflow_runtime));

    let fn_names: Vec<String> = handlers.iter().map(Handler::fn_name).collect();
    let by_name: HashMap<&str, usize> = fn_names
        .iter()
        .enumerate()
        .map(|(i, n)| (n.as_str(), i))
        .collect();
    let mut steps: Vec<StepModel> = Vec::with_capacity(handlers.len());
    let mut seen_slugs: HashMap<String, usize> = HashMap::new();
    let mut seen_variants: HashMap<String, usize> = HashMap::new();

    for (index, h) in handlers.iter().enumerate() {
        let a = &h.attr;
        let (step_slug, step_span) = match &a.slug {
            Some(l) => (l.value(), l.span()),
            None => (h.fn_name(), h.ident.span()),
        };
        let slug_ok = match slug_problem(&step_slug) {
            Some(p) => {
                cx.error(step_span, format!("invalid step {p}"));
                false
            }
            None => true,
        };
        let lower = step_slug.to_lowercase();
        if !slug_ok {
        } else if let Some(&prev) = seen_slugs.get(&lower) {
            let prev_slug = &steps[prev].slug;
            if *prev_slug == step_slug {
                cx.error(
                    step_span,
                    format!(
                        "duplicate step slug `{step_slug}` (already used by `{}`)",
                        fn_names[prev]
                    ),
                );
            } else {
                cx.error(
                    step_span,
                    format!("step slug `{step_slug}` equals `{prev_slug}` when lowercased; queue names are lowercase, so slugs must differ in more than case"),
                );
            }
        } else {
            seen_slugs.insert(lower, index);
        }
        let variant_name = h.fn_name().to_upper_camel_case();
        if let Some(&prev) = seen_variants.get(&variant_name) {
            cx.error(
                h.ident.span(),
                format!(
                    "`{}` and `{}` both become the step variant `Step::{variant_name}`; rename one",
                    fn_names[prev],
                    h.fn_name()
                ),
            );
        } else {
            seen_variants.insert(variant_name.clone(), index);
        }
        let variant = Ident::new(&variant_name, h.ident.span());

        // Dependencies.
        let resolve = |dep: &Ident| -> Option<usize> {
            let name = syn::ext::IdentExt::unraw(dep).to_string();
            match by_name.get(name.as_str()) {
                None => {
                    let slug_hint = handlers
                        .iter()
                        .position(|o| o.attr.slug.as_ref().is_some_and(|s| s.value() == name))
                        .map(|i| format!("; `{name}` is the slug of `{}`, and dependencies are named by function", fn_names[i]))
                        .unwrap_or_else(|| did_you_mean(&name, fn_names.iter().map(String::as_str)));
                    cx.error(dep.span(), format!("unknown dependency `{name}`: no `#[step]` function with that name in this flow{slug_hint}"));
                    None
                }
                Some(&i) if i == index => {
                    cx.error(dep.span(), format!("step `{name}` cannot depend on itself"));
                    None
                }
                Some(&i) if i > index => {
                    cx.error(
                        dep.span(),
                        format!("dependency `{name}` is declared after `{}`; declare a dependency before its dependents (source order is step order, which also rules out cycles)", h.fn_name()),
                    );
                    None
                }
                Some(&i) => Some(i),
            }
        };
        let mut deps: Vec<usize> = Vec::new();
        let mut dep_idents: Vec<(usize, Ident)> = Vec::new();
        let mut map_from = None;
        if let Some((key, list)) = &a.depends_on {
            if list.is_empty() {
                cx.error(
                    key.span(),
                    "`depends_on = []` is empty; remove it for a root step",
                );
            }
            if let Some(m) = &a.map {
                cx.error(
                    key.span(),
                    format!("a map step has exactly one source: write `map = dep` instead of `depends_on`{}", if m.source.is_none() { "" } else { " (remove `depends_on`)" }),
                );
            }
            for d in list {
                if dep_idents.iter().any(|(_, o)| o == d) {
                    cx.error(d.span(), format!("duplicate dependency `{d}`"));
                    continue;
                }
                if let Some(i) = resolve(d) {
                    deps.push(i);
                    dep_idents.push((i, d.clone()));
                }
            }
        }
        let kind = if a.map.is_some() {
            Kind::Map
        } else {
            Kind::Single
        };
        if let Some(m) = &a.map {
            match &m.source {
                None => map_from = Some(MapFrom::FlowInput(m.keyword.span())),
                Some(src) => {
                    if let Some(i) = resolve(src) {
                        if a.depends_on.is_none() {
                            deps.push(i);
                            dep_idents.push((i, src.clone()));
                        }
                        map_from = Some(MapFrom::Dep(i, src.span()));
                    }
                }
            }
        }

        // Conditions and modes.
        let has_condition = a.if_pattern.is_some() || a.if_not_pattern.is_some();
        if let (Some((_, key)), false) = (&a.when_unmet, has_condition) {
            cx.error(key.span(), "`when_unmet` needs a condition: add `if = {..}` or `if_not = {..}`, or remove `when_unmet`");
        }
        let when_unmet = a.when_unmet.as_ref().map_or(Mode::Skip, |(m, _)| *m);
        let when_exhausted = a.when_exhausted.as_ref().map_or(Mode::Fail, |(m, _)| *m);
        let check_pattern = |p: &crate::pattern::Pattern, what: &str| -> Value {
            let Value::Object(obj) = &p.value else {
                cx.error(p.span, format!("`{what}` must be an object pattern like `{{ key: value }}` (a database CHECK)"));
                return p.value.clone();
            };
            if deps.is_empty() && a.map.is_none() {
                return p.value.clone();
            }
            // A dependent step's condition tests `{dep_slug: output}`: keys must be dependencies.
            let mut out = Map::new();
            for (key, span) in &p.top_keys {
                let value = obj.get(key).cloned().unwrap_or(Value::Null);
                let found = deps
                    .iter()
                    .find(|&&d| fn_names[d] == *key || slug_of(handlers, d) == *key);
                match found {
                    Some(&d) => {
                        out.insert(slug_of(handlers, d), value);
                    }
                    None => {
                        let names: Vec<&str> = deps.iter().map(|&d| fn_names[d].as_str()).collect();
                        cx.error(
                            *span,
                            format!(
                                "condition key `{key}` is not a dependency of `{}`: a dependent step's condition tests the object of its dependencies' outputs, so top-level keys must be dependencies ({}){}",
                                h.fn_name(),
                                names.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", "),
                                did_you_mean(key, names.iter().copied())
                            ),
                        );
                        out.insert(key.clone(), value);
                    }
                }
            }
            Value::Object(out)
        };
        let if_value = a.if_pattern.as_ref().map(|p| check_pattern(p, "if"));
        let if_not_value = a
            .if_not_pattern
            .as_ref()
            .map(|p| check_pattern(p, "if_not"));

        let mut step_options = Map::new();
        option(
            cx,
            &mut step_options,
            "maxAttempts",
            "max_attempts",
            a.max_attempts,
            0,
        );
        option(
            cx,
            &mut step_options,
            "baseDelay",
            "base_delay",
            a.base_delay,
            0,
        );
        option(cx, &mut step_options, "timeout", "timeout", a.timeout, 1);
        option(
            cx,
            &mut step_options,
            "startDelay",
            "start_delay",
            a.start_delay,
            0,
        );

        let skippable = (has_condition && when_unmet == Mode::Skip) || when_exhausted == Mode::Skip;
        let own_cascade = (has_condition && when_unmet == Mode::SkipCascade)
            || when_exhausted == Mode::SkipCascade;
        let cascaded = own_cascade || deps.iter().any(|&d| steps[d].cascaded);
        steps.push(StepModel {
            slug: step_slug,
            slug_span: step_span,
            variant,
            kind,
            deps,
            map_from,
            if_value,
            if_not_value,
            when_unmet,
            when_exhausted,
            skippable,
            may_be_absent: skippable || cascaded,
            cascaded,
            options: step_options,
        });
        check_params(cx, h, &steps[index], handlers, &dep_idents);
    }
    Model {
        slug,
        slug_span,
        flow_ident,
        krate,
        options,
        steps,
    }
}

fn slug_of(handlers: &[Handler], i: usize) -> String {
    handlers[i]
        .attr
        .slug
        .as_ref()
        .map_or_else(|| handlers[i].fn_name(), |s| s.value())
}

/// Parameter names: root and map steps take one value, dependent steps one per dependency.
fn check_params(
    cx: &Ctxt,
    h: &Handler,
    step: &StepModel,
    handlers: &[Handler],
    dep_idents: &[(usize, Ident)],
) {
    let values: Vec<&crate::ast::Param> = h.params.iter().filter(|p| !p.is_ctx).collect();
    let listed: Vec<String> = h
        .attr
        .depends_on
        .iter()
        .flat_map(|(_, l)| l.iter().map(|i| syn::ext::IdentExt::unraw(i).to_string()))
        .collect();
    if h.attr
        .depends_on
        .as_ref()
        .is_some_and(|(_, l)| l.is_empty())
    {
        return; // `depends_on = []` is already reported
    }
    let single_value =
        step.kind == Kind::Map || (step.deps.is_empty() && h.attr.depends_on.is_none());
    if single_value {
        let what = if step.kind == Kind::Map {
            "one array element"
        } else {
            "the flow input"
        };
        match values.as_slice() {
            [] => {
                if h.sig_ok {
                    cx.error(
                        h.ident.span(),
                        format!(
                            "step `{}` takes {what} as its first parameter; add one",
                            h.fn_name()
                        ),
                    );
                }
            }
            [_] => {}
            [_, extra @ ..] => {
                for p in extra {
                    cx.error(
                        p.name.span(),
                        format!("step `{}` takes only {what} (plus an optional `StepContext` last); remove `{}`", h.fn_name(), p.name),
                    );
                }
            }
        }
        return;
    }
    let dep_names: Vec<String> = dep_idents
        .iter()
        .map(|(i, _)| handlers[*i].fn_name())
        .collect();
    let mut taken: Vec<bool> = vec![false; dep_idents.len()];
    for p in &values {
        let name = p.dep_name();
        match dep_names.iter().position(|n| *n == name) {
            Some(i) if taken[i] => {
                cx.error(p.name.span(), format!("dependency `{name}` is taken twice"));
            }
            Some(i) => taken[i] = true,
            // An unresolved dependency was already reported; the parameter likely meant it.
            None if listed.contains(&name) || listed.len() > dep_idents.len() => {}
            None => {
                let listed = dep_names
                    .iter()
                    .map(|n| format!("`{n}`"))
                    .collect::<Vec<_>>()
                    .join(", ");
                let hint = did_you_mean(&name, dep_names.iter().map(String::as_str));
                let known_step = handlers.iter().any(|o| o.fn_name() == name);
                let extra = if known_step {
                    format!("; add `{name}` to `depends_on` to receive its output")
                } else {
                    String::new()
                };
                cx.error(
                    p.name.span(),
                    format!("parameter `{}` names no dependency of `{}`: parameters are named like the dependencies ({listed}){hint}{extra}", p.name, h.fn_name()),
                );
            }
        }
    }
    for ((_, ident), taken) in dep_idents.iter().zip(taken) {
        if !taken {
            cx.error(
                ident.span(),
                format!("dependency `{ident}` has no parameter in `{}`: add a parameter named `{ident}` (or `_{ident}` if unused) of its output type", h.fn_name()),
            );
        }
    }
}
