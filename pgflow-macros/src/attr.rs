//! Parsing of the `#[flow(...)]`, `#[step(...)]`, `#[queue(...)]` and `#[deployment(...)]` arguments
//! into typed slots. Errors are collected.
//!
//! Each attribute has one table of options ([`FLOW_OPTIONS`], [`STEP_OPTIONS`], [`QUEUE_OPTIONS`],
//! [`DEPLOYMENT_OPTIONS`]): the key, how it is written, and which slot its value goes to. The same table drives parsing and the list of keys in
//! the unknown-option error. Each slot ([`Attr`]) reports its own duplicate.

use proc_macro2::{Span, TokenStream};
use syn::ext::IdentExt;
use syn::parse::{ParseStream, Parser};
use syn::punctuated::Punctuated;
use syn::{bracketed, Ident, LitInt, LitStr, Path, Token, Type};

use crate::ctxt::{did_you_mean, Ctxt};
use crate::pattern::{parse_pattern, Pattern};

/// One option's slot: unset, or set once with the key it was written with.
pub(crate) struct Attr<T> {
    set: Option<(Ident, T)>,
}

impl<T> Default for Attr<T> {
    fn default() -> Self {
        Attr { set: None }
    }
}

impl<T> Attr<T> {
    /// Stores the value; a second occurrence of the key is an error on that key.
    fn set(&mut self, key: &Ident, value: T) -> syn::Result<()> {
        if self.set.is_some() {
            return Err(syn::Error::new(
                key.span(),
                format!("duplicate `{key}` option"),
            ));
        }
        self.set = Some((key.clone(), value));
        Ok(())
    }

    /// The value, when the option was given.
    pub(crate) fn get(&self) -> Option<&T> {
        self.set.as_ref().map(|(_, v)| v)
    }

    /// The key as written, when the option was given (for errors about the option as a whole).
    pub(crate) fn key(&self) -> Option<&Ident> {
        self.set.as_ref().map(|(k, _)| k)
    }

    /// Whether the option was given.
    pub(crate) fn is_set(&self) -> bool {
        self.set.is_some()
    }
}

/// An integer option with the span of its value.
#[derive(Debug, Clone, Copy)]
pub(crate) struct IntOpt {
    pub(crate) value: i64,
    pub(crate) span: Span,
}

/// `when_unmet` / `when_exhausted` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Fail,
    Skip,
    SkipCascade,
}

impl Mode {
    pub(crate) fn as_sql(self) -> &'static str {
        match self {
            Mode::Fail => "fail",
            Mode::Skip => "skip",
            Mode::SkipCascade => "skip-cascade",
        }
    }
}

/// The retry and timing options. A flow has all but `start_delay`; a step has all four.
#[derive(Default)]
pub(crate) struct RunOptions {
    pub(crate) max_attempts: Attr<IntOpt>,
    pub(crate) base_delay: Attr<IntOpt>,
    pub(crate) timeout: Attr<IntOpt>,
    pub(crate) start_delay: Attr<IntOpt>,
}

/// The arguments of `#[flow(...)]`.
#[derive(Default)]
pub(crate) struct FlowAttr {
    pub(crate) slug: Attr<LitStr>,
    pub(crate) input: Attr<Type>,
    pub(crate) name: Attr<Ident>,
    pub(crate) krate: Attr<Path>,
    pub(crate) step_queues: Attr<()>,
    pub(crate) options: RunOptions,
}

/// The arguments of one `#[step(...)]`.
#[derive(Default)]
pub(crate) struct StepAttr {
    pub(crate) slug: Attr<LitStr>,
    pub(crate) depends_on: Attr<Vec<Ident>>,
    /// `map` (over the flow input, `None`) or `map = dep` (`Some(dep)`); the key is the keyword.
    pub(crate) map: Attr<Option<Ident>>,
    pub(crate) if_pattern: Attr<Pattern>,
    pub(crate) if_not_pattern: Attr<Pattern>,
    pub(crate) when_unmet: Attr<Mode>,
    pub(crate) when_exhausted: Attr<Mode>,
    pub(crate) options: RunOptions,
}

/// The arguments of `#[queue("name", ...)]`.
#[derive(Default)]
pub(crate) struct QueueAttr {
    /// The queue name, the first argument; `None` when it is missing (already reported).
    pub(crate) name: Option<LitStr>,
    pub(crate) krate: Attr<Path>,
}

/// The arguments of `#[deployment(...)]`.
#[derive(Default)]
pub(crate) struct DeploymentAttr {
    pub(crate) alias: Attr<LitStr>,
    pub(crate) name: Attr<Ident>,
    pub(crate) krate: Attr<Path>,
}

/// How an option is written, with the function that parses its value into the attribute.
enum Form<A> {
    /// `key = value`.
    Value(fn(&mut A, &Ident, ParseStream<'_>) -> syn::Result<()>),
    /// `key` alone.
    Flag(fn(&mut A, &Ident) -> syn::Result<()>),
    /// `key` alone or `key = value`.
    FlagOrValue(fn(&mut A, &Ident, Option<ParseStream<'_>>) -> syn::Result<()>),
}

/// One option of an attribute.
struct Opt<A> {
    key: &'static str,
    form: Form<A>,
}

/// Every `#[flow(...)]` option, in the order the unknown-option error lists them.
const FLOW_OPTIONS: &[Opt<FlowAttr>] = &[
    Opt {
        key: "slug",
        form: Form::Value(|a, k, v| a.slug.set(k, v.parse()?)),
    },
    Opt {
        key: "input",
        form: Form::Value(|a, k, v| a.input.set(k, v.parse()?)),
    },
    Opt {
        key: "name",
        form: Form::Value(|a, k, v| a.name.set(k, v.parse()?)),
    },
    Opt {
        key: "crate",
        form: Form::Value(|a, k, v| a.krate.set(k, v.parse::<LitStr>()?.parse()?)),
    },
    Opt {
        key: "max_attempts",
        form: Form::Value(|a, k, v| a.options.max_attempts.set(k, int(v)?)),
    },
    Opt {
        key: "base_delay",
        form: Form::Value(|a, k, v| a.options.base_delay.set(k, int(v)?)),
    },
    Opt {
        key: "timeout",
        form: Form::Value(|a, k, v| a.options.timeout.set(k, int(v)?)),
    },
    Opt {
        key: "step_queues",
        form: Form::Flag(|a, k| a.step_queues.set(k, ())),
    },
];

/// Every `#[step(...)]` option, in the order the unknown-option error lists them.
const STEP_OPTIONS: &[Opt<StepAttr>] = &[
    Opt {
        key: "depends_on",
        form: Form::Value(|a, k, v| a.depends_on.set(k, ident_list(v)?)),
    },
    Opt {
        key: "slug",
        form: Form::Value(|a, k, v| a.slug.set(k, v.parse()?)),
    },
    Opt {
        key: "map",
        form: Form::FlagOrValue(|a, k, v| a.map.set(k, v.map(|v| v.parse()).transpose()?)),
    },
    Opt {
        key: "if",
        form: Form::Value(|a, k, v| a.if_pattern.set(k, parse_pattern(v)?)),
    },
    Opt {
        key: "if_not",
        form: Form::Value(|a, k, v| a.if_not_pattern.set(k, parse_pattern(v)?)),
    },
    Opt {
        key: "when_unmet",
        form: Form::Value(|a, k, v| a.when_unmet.set(k, mode(v)?)),
    },
    Opt {
        key: "when_exhausted",
        form: Form::Value(|a, k, v| a.when_exhausted.set(k, mode(v)?)),
    },
    Opt {
        key: "max_attempts",
        form: Form::Value(|a, k, v| a.options.max_attempts.set(k, int(v)?)),
    },
    Opt {
        key: "base_delay",
        form: Form::Value(|a, k, v| a.options.base_delay.set(k, int(v)?)),
    },
    Opt {
        key: "timeout",
        form: Form::Value(|a, k, v| a.options.timeout.set(k, int(v)?)),
    },
    Opt {
        key: "start_delay",
        form: Form::Value(|a, k, v| a.options.start_delay.set(k, int(v)?)),
    },
];

/// Every `#[queue("name", ...)]` option after the name.
const QUEUE_OPTIONS: &[Opt<QueueAttr>] = &[Opt {
    key: "crate",
    form: Form::Value(|a, k, v| a.krate.set(k, v.parse::<LitStr>()?.parse()?)),
}];

/// Every `#[deployment(...)]` option, in the order the unknown-option error lists them.
const DEPLOYMENT_OPTIONS: &[Opt<DeploymentAttr>] = &[
    Opt {
        key: "alias",
        form: Form::Value(|a, k, v| a.alias.set(k, v.parse()?)),
    },
    Opt {
        key: "name",
        form: Form::Value(|a, k, v| a.name.set(k, v.parse()?)),
    },
    Opt {
        key: "crate",
        form: Form::Value(|a, k, v| a.krate.set(k, v.parse::<LitStr>()?.parse()?)),
    },
];

/// Parses `#[flow(...)]` arguments.
pub(crate) fn parse_flow_attr(cx: &Ctxt, tokens: TokenStream) -> FlowAttr {
    parse_options(cx, tokens, FLOW_OPTIONS, "flow")
}

/// Parses `#[step]` / `#[step(...)]` arguments.
pub(crate) fn parse_step_attr(cx: &Ctxt, tokens: TokenStream) -> StepAttr {
    parse_options(cx, tokens, STEP_OPTIONS, "step")
}

/// Parses `#[deployment(...)]` arguments.
pub(crate) fn parse_deployment_attr(cx: &Ctxt, tokens: TokenStream) -> DeploymentAttr {
    parse_options(cx, tokens, DEPLOYMENT_OPTIONS, "deployment")
}

/// Parses `#[queue("name")]` / `#[queue("name", crate = "..")]` arguments: the name first, as a
/// string literal, then the options.
pub(crate) fn parse_queue_attr(cx: &Ctxt, tokens: TokenStream) -> QueueAttr {
    let mut attr = QueueAttr::default();
    let parser = |input: ParseStream<'_>| -> syn::Result<()> {
        if input.peek(LitStr) {
            attr.name = Some(input.parse()?);
            if input.is_empty() {
                return Ok(());
            }
            input.parse::<Token![,]>()?;
        } else {
            let span = if input.is_empty() {
                Span::call_site()
            } else {
                input.span()
            };
            cx.error(
                span,
                "`#[queue]` takes the queue name first, as a string literal: `#[queue(\"classify_threads\")]`",
            );
            input.parse::<TokenStream>()?;
            return Ok(());
        }
        options_in(cx, &mut attr, input, QUEUE_OPTIONS, "queue");
        Ok(())
    };
    if let Err(e) = parser.parse2(tokens) {
        cx.push(e);
    }
    attr
}

/// Reads `key [= value], ...` against `table`. A bad option is recorded and skipped up to the
/// next comma, so every mistake of one attribute is reported.
fn parse_options<A: Default>(cx: &Ctxt, tokens: TokenStream, table: &[Opt<A>], what: &str) -> A {
    let mut attr = A::default();
    let parser = |input: ParseStream<'_>| -> syn::Result<()> {
        options_in(cx, &mut attr, input, table, what);
        Ok(())
    };
    if let Err(e) = parser.parse2(tokens) {
        cx.push(e);
    }
    attr
}

/// The loop of [`parse_options`], on a stream that may have had a positional argument read first.
fn options_in<A>(cx: &Ctxt, attr: &mut A, input: ParseStream<'_>, table: &[Opt<A>], what: &str) {
    while !input.is_empty() {
        if let Err(e) = parse_one(attr, input, table, what) {
            cx.push(e);
            skip_to_comma(input);
        }
        if input.is_empty() {
            break;
        }
        if let Err(e) = input.parse::<Token![,]>() {
            cx.push(e);
            skip_to_comma(input);
            let _ = input.parse::<Option<Token![,]>>();
        }
    }
}

fn parse_one<A>(
    attr: &mut A,
    input: ParseStream<'_>,
    table: &[Opt<A>],
    what: &str,
) -> syn::Result<()> {
    let key = input.call(Ident::parse_any)?;
    let Some(opt) = table.iter().find(|o| key == o.key) else {
        if input.peek(Token![=]) {
            input.parse::<Token![=]>()?;
        }
        return Err(unknown(&key, table, what));
    };
    let has_value = input.peek(Token![=]);
    if has_value {
        input.parse::<Token![=]>()?;
    }
    match (&opt.form, has_value) {
        (Form::Value(set), true) => set(attr, &key, input),
        (Form::Value(_), false) => Err(syn::Error::new(
            key.span(),
            format!("expected `{key} = ...`"),
        )),
        (Form::Flag(set), false) => set(attr, &key),
        (Form::Flag(_), true) => Err(syn::Error::new(
            key.span(),
            format!("`{key}` takes no value; write just `{key}`"),
        )),
        (Form::FlagOrValue(set), true) => set(attr, &key, Some(input)),
        (Form::FlagOrValue(set), false) => set(attr, &key, None),
    }
}

fn skip_to_comma(input: ParseStream<'_>) {
    while !input.is_empty() && !input.peek(Token![,]) {
        let _ = input.parse::<proc_macro2::TokenTree>();
    }
}

fn unknown<A>(key: &Ident, table: &[Opt<A>], what: &str) -> syn::Error {
    let k = key.to_string();
    let keys: Vec<&str> = table.iter().map(|o| o.key).collect();
    let extra = if what == "flow" && k == "start_delay" {
        "; `start_delay` is a step option, put it on a `#[step(...)]`".to_owned()
    } else {
        did_you_mean(&k, keys.iter().copied())
    };
    syn::Error::new(
        key.span(),
        format!(
            "unknown `#[{what}]` option `{k}`{extra}; expected one of: {}",
            keys.join(", ")
        ),
    )
}

fn ident_list(input: ParseStream<'_>) -> syn::Result<Vec<Ident>> {
    let content;
    bracketed!(content in input);
    let list = Punctuated::<Ident, Token![,]>::parse_terminated(&content)?;
    Ok(list.into_iter().collect())
}

fn int(input: ParseStream<'_>) -> syn::Result<IntOpt> {
    let negative = input.parse::<Option<Token![-]>>()?.is_some();
    let lit: LitInt = input.parse().map_err(|e| {
        syn::Error::new(
            e.span(),
            "expected an integer number of seconds or attempts, e.g. `3`",
        )
    })?;
    let value: i64 = lit.base10_parse::<i64>().map_err(|_| {
        syn::Error::new(
            lit.span(),
            "integer out of range: the database stores an `int` (at most 2147483647)",
        )
    })?;
    Ok(IntOpt {
        value: if negative { -value } else { value },
        span: lit.span(),
    })
}

fn mode(input: ParseStream<'_>) -> syn::Result<Mode> {
    let (text, span) = if input.peek(LitStr) {
        let s: LitStr = input.parse()?;
        (s.value().replace('-', "_"), s.span())
    } else {
        let i = input.call(Ident::parse_any)?;
        (i.to_string(), i.span())
    };
    match text.as_str() {
        "skip" => Ok(Mode::Skip),
        "skip_cascade" => Ok(Mode::SkipCascade),
        "fail" => Ok(Mode::Fail),
        other => Err(syn::Error::new(
            span,
            format!(
                "unknown mode `{other}`; expected `skip`, `skip_cascade` or `fail`{}",
                did_you_mean(other, ["skip", "skip_cascade", "fail"])
            ),
        )),
    }
}
