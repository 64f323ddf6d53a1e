//! Validates the flow, one function per rule, and fills in what the expansion needs (resolved
//! dependencies, conditions keyed by slug, skip behaviour, per-step queues). Errors are collected.

use std::collections::HashMap;

use proc_macro2::Span;
use serde_json::{Map, Value};
use syn::Ident;

use crate::ast::{unraw, Dep, Flow, Kind, MapFrom, Step};
use crate::attr::{Attr, IntOpt, Mode, RunOptions};
use crate::ctxt::{did_you_mean, Ctxt};
use crate::pattern::Pattern;
use pgflow_sql::names::{self, QueueNameError, MAX_QUEUE_NAME_LEN};

/// Runs every rule. The expansion reads what they resolve; on any error it emits the fallback.
pub(crate) fn check(cx: &Ctxt, flow: &mut Flow) {
    let slugs_ok = slugs(cx, flow);
    input(cx, flow);
    let unique = duplicates(cx, flow);
    dependencies(cx, flow);
    map_sources(cx, flow);
    conditions(cx, flow);
    options(cx, flow);
    parameters(cx, flow);
    if slugs_ok && unique {
        queue_routes(cx, flow);
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// Flow and step slugs follow SQL's `pgflow.is_valid_slug`, and the flow's single queue
/// `lower(flow_slug)` fits PGMQ's limit. Returns whether every slug is usable.
fn slugs(cx: &Ctxt, flow: &Flow) -> bool {
    let mut ok = true;
    let slug = &flow.slug;
    if let Err(problem) = names::check_slug(&slug.value) {
        cx.error(slug.span, format!("invalid flow {problem}"));
        ok = false;
    } else {
        let queue = names::default_queue_name(&slug.value);
        let len = names::name_len(&queue);
        if len > MAX_QUEUE_NAME_LEN {
            let over = len - MAX_QUEUE_NAME_LEN;
            cx.error(
                slug.span,
                format!(
                    "flow slug `{}` is {len} characters, but its queue name `{queue}` must be at most {MAX_QUEUE_NAME_LEN} characters (the PGMQ limit); shorten the slug by at least {over} character{}",
                    slug.value,
                    plural(over)
                ),
            );
            ok = false;
        }
    }
    for step in &flow.steps {
        if let Err(problem) = names::check_slug(&step.slug.value) {
            cx.error(step.slug.span, format!("invalid step {problem}"));
            ok = false;
        }
    }
    ok
}

/// `input = Type` is required.
fn input(cx: &Ctxt, flow: &Flow) {
    if !flow.attrs.input.is_set() {
        cx.error(
            Span::call_site(),
            "missing `input = Type` in `#[flow(...)]`: the type of the run input (use `serde_json::Value` for untyped input)",
        );
    }
}

/// Step slugs differ in more than letter case, and functions map to distinct enum variants.
/// Returns whether the slugs are unique.
fn duplicates(cx: &Ctxt, flow: &Flow) -> bool {
    let mut unique = true;
    let mut seen_slugs: HashMap<String, usize> = HashMap::new();
    let mut seen_variants: HashMap<String, usize> = HashMap::new();
    for (index, step) in flow.steps.iter().enumerate() {
        let slug = &step.slug.value;
        if names::is_valid_slug(slug) {
            if let Some(&prev) = seen_slugs.get(&slug.to_lowercase()) {
                let prev = &flow.steps[prev];
                let msg = if prev.slug.value == *slug {
                    format!(
                        "duplicate step slug `{slug}` (already used by `{}`)",
                        prev.fn_name()
                    )
                } else {
                    format!(
                        "step slug `{slug}` equals `{}` when lowercased; queue names are lowercase, so slugs must differ in more than case",
                        prev.slug.value
                    )
                };
                cx.error(step.slug.span, msg);
                unique = false;
            } else {
                seen_slugs.insert(slug.to_lowercase(), index);
            }
        }
        let variant = step.variant.to_string();
        if let Some(&prev) = seen_variants.get(&variant) {
            cx.error(
                step.handler.ident.span(),
                format!(
                    "`{}` and `{}` both become the step variant `Step::{variant}`; rename one",
                    flow.steps[prev].fn_name(),
                    step.fn_name()
                ),
            );
        } else {
            seen_variants.insert(variant, index);
        }
    }
    unique
}

/// Finds the earlier step a dependency names; reports unknown, self and later steps.
fn resolve(cx: &Ctxt, flow: &Flow, index: usize, dep: &Ident) -> Option<usize> {
    let name = unraw(dep);
    let step = &flow.steps[index];
    match flow.step_by_fn(&name) {
        None => {
            let by_slug = flow
                .steps
                .iter()
                .find(|o| o.attrs.slug.get().is_some_and(|s| s.value() == name));
            let hint = match by_slug {
                Some(o) => format!(
                    "; `{name}` is the slug of `{}`, and dependencies are named by function",
                    o.fn_name()
                ),
                None => {
                    let fn_names: Vec<String> = flow.steps.iter().map(Step::fn_name).collect();
                    did_you_mean(&name, fn_names.iter().map(String::as_str))
                }
            };
            cx.error(
                dep.span(),
                format!("unknown dependency `{name}`: no `#[step]` function with that name in this flow{hint}"),
            );
            None
        }
        Some(i) if i == index => {
            cx.error(dep.span(), format!("step `{name}` cannot depend on itself"));
            None
        }
        Some(i) if i > index => {
            cx.error(
                dep.span(),
                format!(
                    "dependency `{name}` is declared after `{}`; declare a dependency before its dependents (source order is step order, which also rules out cycles)",
                    step.fn_name()
                ),
            );
            None
        }
        Some(i) => Some(i),
    }
}

/// `depends_on` names earlier steps, each once, and is neither empty nor combined with `map`.
fn dependencies(cx: &Ctxt, flow: &mut Flow) {
    for index in 0..flow.steps.len() {
        let step = &flow.steps[index];
        let (Some(key), Some(list)) = (step.attrs.depends_on.key(), step.attrs.depends_on.get())
        else {
            continue;
        };
        if list.is_empty() {
            cx.error(
                key.span(),
                "`depends_on = []` is empty; remove it for a root step",
            );
        }
        if let Some(source) = step.attrs.map.get() {
            cx.error(
                key.span(),
                format!(
                    "a map step has exactly one source: write `map = dep` instead of `depends_on`{}",
                    if source.is_none() {
                        ""
                    } else {
                        " (remove `depends_on`)"
                    }
                ),
            );
        }
        let mut deps: Vec<Dep> = Vec::new();
        for (n, dep) in list.iter().enumerate() {
            if list[..n].contains(dep) {
                cx.error(dep.span(), format!("duplicate dependency `{dep}`"));
                continue;
            }
            if let Some(i) = resolve(cx, flow, index, dep) {
                deps.push(Dep {
                    index: i,
                    ident: dep.clone(),
                });
            }
        }
        flow.steps[index].deps = deps;
    }
}

/// `map` iterates the flow input; `map = dep` iterates an earlier step's output.
fn map_sources(cx: &Ctxt, flow: &mut Flow) {
    for index in 0..flow.steps.len() {
        let step = &flow.steps[index];
        let (Some(keyword), Some(source)) = (step.attrs.map.key(), step.attrs.map.get()) else {
            continue;
        };
        let Some(source) = source.clone() else {
            flow.steps[index].map_from = Some(MapFrom::FlowInput(keyword.span()));
            continue;
        };
        let Some(i) = resolve(cx, flow, index, &source) else {
            continue;
        };
        let step = &mut flow.steps[index];
        if !step.attrs.depends_on.is_set() {
            step.deps.push(Dep {
                index: i,
                ident: source.clone(),
            });
        }
        step.map_from = Some(MapFrom::Dep(i, source.span()));
    }
}

/// `when_unmet` needs a condition; conditions are objects, and a dependent step's top-level keys
/// are its dependencies (rewritten to their slugs). Works out which steps may be skipped.
fn conditions(cx: &Ctxt, flow: &mut Flow) {
    for index in 0..flow.steps.len() {
        let step = &flow.steps[index];
        if let (Some(key), false) = (step.attrs.when_unmet.key(), step.has_condition()) {
            cx.error(key.span(), "`when_unmet` needs a condition: add `if = {..}` or `if_not = {..}`, or remove `when_unmet`");
        }
        let if_value = step
            .attrs
            .if_pattern
            .get()
            .map(|p| condition(cx, flow, step, p, "if"));
        let if_not_value = step
            .attrs
            .if_not_pattern
            .get()
            .map(|p| condition(cx, flow, step, p, "if_not"));
        let has_condition = step.has_condition();
        let (unmet, exhausted) = (step.when_unmet(), step.when_exhausted());
        let skippable = (has_condition && unmet == Mode::Skip) || exhausted == Mode::Skip;
        let own_cascade =
            (has_condition && unmet == Mode::SkipCascade) || exhausted == Mode::SkipCascade;
        let cascaded = own_cascade || step.deps.iter().any(|d| flow.steps[d.index].cascaded);
        let step = &mut flow.steps[index];
        step.if_value = if_value;
        step.if_not_value = if_not_value;
        step.skippable = skippable;
        step.cascaded = cascaded;
    }
}

/// One condition pattern as stored in the shape.
fn condition(cx: &Ctxt, flow: &Flow, step: &Step, pattern: &Pattern, what: &str) -> Value {
    let Value::Object(obj) = &pattern.value else {
        cx.error(
            pattern.span,
            format!(
                "`{what}` must be an object pattern like `{{ key: value }}` (a database CHECK)"
            ),
        );
        return pattern.value.clone();
    };
    if step.deps.is_empty() && !step.attrs.map.is_set() {
        return pattern.value.clone();
    }
    // A dependent step's condition tests `{dep_slug: output}`: keys must be dependencies.
    let mut out = Map::new();
    for (key, span) in &pattern.top_keys {
        let value = obj.get(key).cloned().unwrap_or(Value::Null);
        let found = step
            .deps
            .iter()
            .map(|d| &flow.steps[d.index])
            .find(|d| d.fn_name() == *key || d.slug.value == *key);
        match found {
            Some(dep) => {
                out.insert(dep.slug.value.clone(), value);
            }
            None => {
                let names: Vec<String> = step
                    .deps
                    .iter()
                    .map(|d| flow.steps[d.index].fn_name())
                    .collect();
                cx.error(
                    *span,
                    format!(
                        "condition key `{key}` is not a dependency of `{}`: a dependent step's condition tests the object of its dependencies' outputs, so top-level keys must be dependencies ({}){}",
                        step.fn_name(),
                        names.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", "),
                        did_you_mean(key, names.iter().map(String::as_str))
                    ),
                );
                out.insert(key.clone(), value);
            }
        }
    }
    Value::Object(out)
}

/// Retry and timing options satisfy the database CHECKs and fit an `int`.
fn options(cx: &Ctxt, flow: &Flow) {
    run_options(cx, &flow.attrs.options);
    for step in &flow.steps {
        run_options(cx, &step.attrs.options);
    }
}

fn run_options(cx: &Ctxt, options: &RunOptions) {
    let RunOptions {
        max_attempts,
        base_delay,
        timeout,
        start_delay,
    } = options;
    in_range(cx, "max_attempts", max_attempts, 0);
    in_range(cx, "base_delay", base_delay, 0);
    in_range(cx, "timeout", timeout, 1);
    in_range(cx, "start_delay", start_delay, 0);
}

fn in_range(cx: &Ctxt, name: &str, opt: &Attr<IntOpt>, min: i64) {
    let Some(o) = opt.get() else { return };
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
}

/// Root and map steps take one value; dependent steps take one parameter per dependency, named
/// like it.
fn parameters(cx: &Ctxt, flow: &Flow) {
    for step in &flow.steps {
        if step.attrs.depends_on.get().is_some_and(Vec::is_empty) {
            continue; // `depends_on = []` is already reported
        }
        if step.takes_one_value() {
            one_value(cx, step);
        } else {
            one_per_dependency(cx, flow, step);
        }
    }
}

fn one_value(cx: &Ctxt, step: &Step) {
    let h = &step.handler;
    let what = if step.kind() == Kind::Map {
        "one array element"
    } else {
        "the flow input"
    };
    let values: Vec<_> = h.value_params().collect();
    match values.as_slice() {
        [] if h.sig_ok => cx.error(
            h.ident.span(),
            format!(
                "step `{}` takes {what} as its first parameter; add one",
                h.fn_name()
            ),
        ),
        [] | [_] => {}
        [_, extra @ ..] => {
            for (_, p) in extra {
                cx.error(
                    p.name.span(),
                    format!(
                        "step `{}` takes only {what} (plus an optional `StepContext` last); remove `{}`",
                        h.fn_name(),
                        p.name
                    ),
                );
            }
        }
    }
}

fn one_per_dependency(cx: &Ctxt, flow: &Flow, step: &Step) {
    let h = &step.handler;
    let listed: Vec<String> = step
        .attrs
        .depends_on
        .get()
        .into_iter()
        .flatten()
        .map(unraw)
        .collect();
    let dep_names: Vec<String> = step
        .deps
        .iter()
        .map(|d| flow.steps[d.index].fn_name())
        .collect();
    let mut taken = vec![false; step.deps.len()];
    for (_, p) in h.value_params() {
        let name = p.dep_name();
        match dep_names.iter().position(|n| *n == name) {
            Some(i) if taken[i] => {
                cx.error(p.name.span(), format!("dependency `{name}` is taken twice"));
            }
            Some(i) => taken[i] = true,
            // An unresolved dependency was already reported; the parameter likely meant it.
            None if listed.contains(&name) || listed.len() > step.deps.len() => {}
            None => {
                let list = dep_names
                    .iter()
                    .map(|n| format!("`{n}`"))
                    .collect::<Vec<_>>()
                    .join(", ");
                let hint = did_you_mean(&name, dep_names.iter().map(String::as_str));
                let extra = if flow.step_by_fn(&name).is_some() {
                    format!("; add `{name}` to `depends_on` to receive its output")
                } else {
                    String::new()
                };
                cx.error(
                    p.name.span(),
                    format!(
                        "parameter `{}` names no dependency of `{}`: parameters are named like the dependencies ({list}){hint}{extra}",
                        p.name,
                        h.fn_name()
                    ),
                );
            }
        }
    }
    for (dep, taken) in step.deps.iter().zip(taken) {
        if !taken {
            let ident = &dep.ident;
            cx.error(
                ident.span(),
                format!(
                    "dependency `{ident}` has no parameter in `{}`: add a parameter named `{ident}` (or `_{ident}` if unused) of its output type",
                    h.fn_name()
                ),
            );
        }
    }
}

/// With `step_queues`, every step gets its own queue: the readable name, else the index
/// fallback, else the flow does not compile (the same resolver SQL runs at deployment).
fn queue_routes(cx: &Ctxt, flow: &mut Flow) {
    if !flow.attrs.step_queues.is_set() {
        return;
    }
    let slugs: Vec<&str> = flow.steps.iter().map(|s| s.slug.value.as_str()).collect();
    let err = match names::resolve_step_queues(&flow.slug.value, &slugs) {
        Ok(routes) => {
            flow.routes = Some(routes);
            return;
        }
        Err(e) => e,
    };
    let remove = "or remove `step_queues` to run every step on the flow's single queue";
    match &err {
        QueueNameError::Flow(e) => {
            let first = e.first_step.as_ref().map_or_else(String::new, |s| {
                format!(
                    " (step `{}` at index 0 would need `{}`, {} characters)",
                    s.step_slug, s.readable_name, s.readable_len
                )
            });
            cx.error(
                flow.slug.span,
                format!(
                    "flow slug `{}` is too long for per-step queues: even the shortest queue name `{}` is {} characters, and PGMQ allows at most {MAX_QUEUE_NAME_LEN}{first}; shorten the flow slug by at least {} character{}, {remove}",
                    e.flow_slug,
                    e.fallback_name,
                    e.fallback_len,
                    e.excess(),
                    plural(e.excess())
                ),
            );
        }
        QueueNameError::EmptyFlow { flow_slug } => cx.error(
            flow.slug.span,
            format!(
                "flow `{flow_slug}` has no steps, so it cannot use per-step queues; add a `#[step]` function, or remove `step_queues`"
            ),
        ),
        QueueNameError::Step(_) => {
            // Report every step whose names are too long, not only the first.
            for (index, step) in flow.steps.iter().enumerate() {
                if let Err(e) = names::resolve_step_queue(&flow.slug.value, &step.slug.value, index) {
                    let (step_over, flow_over) = (e.step_slug_excess(), e.flow_slug_excess());
                    cx.error(
                        step.slug.span,
                        format!(
                            "step `{}` (index {index}) of flow `{}` has no queue name of at most {MAX_QUEUE_NAME_LEN} characters: the readable name `{}` is {} characters and the index fallback `{}` is {}; shorten the step slug by at least {step_over} character{} or the flow slug by at least {flow_over}, {remove}",
                            e.step_slug,
                            e.flow_slug,
                            e.readable_name,
                            e.readable_len,
                            e.fallback_name,
                            e.fallback_len,
                            plural(step_over)
                        ),
                    );
                }
            }
        }
        QueueNameError::Duplicate {
            flow_slug,
            queue,
            first_step,
            first_index,
            second_step,
            second_index,
        } => cx.error(
            flow.steps[*second_index].slug.span,
            format!(
                "steps `{first_step}` (index {first_index}) and `{second_step}` (index {second_index}) of flow `{flow_slug}` both resolve to the queue `{queue}`; rename one so the slugs differ by more than letter case"
            ),
        ),
        // Invalid slugs are reported by `slugs`, which gates this rule; `QueueNameError` may grow.
        _ => cx.error(flow.slug.span, err.to_string()),
    }
}
