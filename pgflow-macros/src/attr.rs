//! Parsing of the `#[flow(...)]` and `#[step(...)]` arguments. Errors are collected, not thrown.

use proc_macro2::{Span, TokenStream};
use syn::ext::IdentExt;
use syn::parse::{ParseStream, Parser};
use syn::punctuated::Punctuated;
use syn::{bracketed, Ident, LitInt, LitStr, Path, Token, Type};

use crate::ctxt::{did_you_mean, Ctxt};
use crate::pattern::{parse_pattern, Pattern};

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

/// The arguments of `#[flow(...)]`.
#[derive(Default)]
pub(crate) struct FlowAttr {
    pub(crate) slug: Option<LitStr>,
    pub(crate) input: Option<Type>,
    pub(crate) name: Option<Ident>,
    pub(crate) krate: Option<Path>,
    pub(crate) max_attempts: Option<IntOpt>,
    pub(crate) base_delay: Option<IntOpt>,
    pub(crate) timeout: Option<IntOpt>,
}

/// How a map step gets its array.
#[derive(Debug, Clone)]
pub(crate) struct MapAttr {
    /// The `map` keyword.
    pub(crate) keyword: Ident,
    /// `map = dep`; `None` for a root map over the flow input.
    pub(crate) source: Option<Ident>,
}

/// The arguments of one `#[step(...)]`.
#[derive(Default)]
pub(crate) struct StepAttr {
    pub(crate) slug: Option<LitStr>,
    pub(crate) depends_on: Option<(Ident, Vec<Ident>)>,
    pub(crate) map: Option<MapAttr>,
    pub(crate) if_pattern: Option<Pattern>,
    pub(crate) if_not_pattern: Option<Pattern>,
    pub(crate) when_unmet: Option<(Mode, Ident)>,
    pub(crate) when_exhausted: Option<(Mode, Ident)>,
    pub(crate) max_attempts: Option<IntOpt>,
    pub(crate) base_delay: Option<IntOpt>,
    pub(crate) timeout: Option<IntOpt>,
    pub(crate) start_delay: Option<IntOpt>,
}

const FLOW_KEYS: &[&str] = &[
    "slug",
    "input",
    "name",
    "crate",
    "max_attempts",
    "base_delay",
    "timeout",
];
const STEP_KEYS: &[&str] = &[
    "depends_on",
    "slug",
    "map",
    "if",
    "if_not",
    "when_unmet",
    "when_exhausted",
    "max_attempts",
    "base_delay",
    "timeout",
    "start_delay",
];

/// Runs `each` for every `key [= value]` pair; on a bad value, records it and skips to the next comma.
fn parse_pairs(
    cx: &Ctxt,
    tokens: TokenStream,
    mut each: impl FnMut(&Ident, ParseStream<'_>) -> syn::Result<()>,
) {
    let parser = |input: ParseStream<'_>| -> syn::Result<()> {
        while !input.is_empty() {
            let key = match input.call(Ident::parse_any) {
                Ok(k) => k,
                Err(e) => {
                    cx.push(e);
                    skip_to_comma(input);
                    continue;
                }
            };
            if let Err(e) = each(&key, input) {
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
        Ok(())
    };
    if let Err(e) = parser.parse2(tokens) {
        cx.push(e);
    }
}

fn skip_to_comma(input: ParseStream<'_>) {
    while !input.is_empty() && !input.peek(Token![,]) {
        let _ = input.parse::<proc_macro2::TokenTree>();
    }
}

fn eq(input: ParseStream<'_>, key: &Ident) -> syn::Result<()> {
    if input.peek(Token![=]) {
        input.parse::<Token![=]>()?;
        Ok(())
    } else {
        Err(syn::Error::new(
            key.span(),
            format!("expected `{key} = ...`"),
        ))
    }
}

fn set<T>(slot: &mut Option<T>, key: &Ident, value: T) -> syn::Result<()> {
    if slot.is_some() {
        return Err(syn::Error::new(
            key.span(),
            format!("duplicate `{key}` option"),
        ));
    }
    *slot = Some(value);
    Ok(())
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

fn mode(input: ParseStream<'_>) -> syn::Result<(Mode, Ident)> {
    let ident: Ident = if input.peek(LitStr) {
        let s: LitStr = input.parse()?;
        Ident::new(&s.value().replace('-', "_"), s.span())
    } else {
        input.call(Ident::parse_any)?
    };
    let m = match ident.to_string().as_str() {
        "skip" => Mode::Skip,
        "skip_cascade" => Mode::SkipCascade,
        "fail" => Mode::Fail,
        other => {
            return Err(syn::Error::new(
                ident.span(),
                format!(
                    "unknown mode `{other}`; expected `skip`, `skip_cascade` or `fail`{}",
                    did_you_mean(other, ["skip", "skip_cascade", "fail"])
                ),
            ))
        }
    };
    Ok((m, ident))
}

fn unknown(key: &Ident, known: &[&str], what: &str) -> syn::Error {
    let k = key.to_string();
    let extra = if what == "flow" && k == "start_delay" {
        "; `start_delay` is a step option, put it on a `#[step(...)]`".to_owned()
    } else {
        did_you_mean(&k, known.iter().copied())
    };
    syn::Error::new(
        key.span(),
        format!(
            "unknown `#[{what}]` option `{k}`{extra}; expected one of: {}",
            known.join(", ")
        ),
    )
}

/// Parses `#[flow(...)]` arguments.
pub(crate) fn parse_flow_attr(cx: &Ctxt, tokens: TokenStream) -> FlowAttr {
    let mut a = FlowAttr::default();
    parse_pairs(cx, tokens, |key, input| match key.to_string().as_str() {
        "slug" => {
            eq(input, key)?;
            let v = input.parse()?;
            set(&mut a.slug, key, v)
        }
        "input" => {
            eq(input, key)?;
            let v = input.parse()?;
            set(&mut a.input, key, v)
        }
        "name" => {
            eq(input, key)?;
            let v = input.parse()?;
            set(&mut a.name, key, v)
        }
        "crate" => {
            eq(input, key)?;
            let s: LitStr = input.parse()?;
            let p: Path = s.parse()?;
            set(&mut a.krate, key, p)
        }
        "max_attempts" => {
            eq(input, key)?;
            let v = int(input)?;
            set(&mut a.max_attempts, key, v)
        }
        "base_delay" => {
            eq(input, key)?;
            let v = int(input)?;
            set(&mut a.base_delay, key, v)
        }
        "timeout" => {
            eq(input, key)?;
            let v = int(input)?;
            set(&mut a.timeout, key, v)
        }
        _ => {
            if input.peek(Token![=]) {
                input.parse::<Token![=]>()?;
            }
            Err(unknown(key, FLOW_KEYS, "flow"))
        }
    });
    a
}

/// Parses `#[step]` / `#[step(...)]` arguments.
pub(crate) fn parse_step_attr(cx: &Ctxt, tokens: TokenStream) -> StepAttr {
    let mut a = StepAttr::default();
    parse_pairs(cx, tokens, |key, input| match key.to_string().as_str() {
        "slug" => {
            eq(input, key)?;
            let v = input.parse()?;
            set(&mut a.slug, key, v)
        }
        "depends_on" => {
            eq(input, key)?;
            let content;
            bracketed!(content in input);
            let list = Punctuated::<Ident, Token![,]>::parse_terminated(&content)?;
            set(
                &mut a.depends_on,
                key,
                (key.clone(), list.into_iter().collect()),
            )
        }
        "map" => {
            let source = if input.peek(Token![=]) {
                input.parse::<Token![=]>()?;
                Some(input.parse::<Ident>()?)
            } else {
                None
            };
            let m = MapAttr {
                keyword: key.clone(),
                source,
            };
            set(&mut a.map, key, m)
        }
        "if" => {
            eq(input, key)?;
            let p = parse_pattern(input)?;
            set(&mut a.if_pattern, key, p)
        }
        "if_not" => {
            eq(input, key)?;
            let p = parse_pattern(input)?;
            set(&mut a.if_not_pattern, key, p)
        }
        "when_unmet" => {
            eq(input, key)?;
            let (m, _) = mode(input)?;
            set(&mut a.when_unmet, key, (m, key.clone()))
        }
        "when_exhausted" => {
            eq(input, key)?;
            let (m, _) = mode(input)?;
            set(&mut a.when_exhausted, key, (m, key.clone()))
        }
        "max_attempts" => {
            eq(input, key)?;
            let v = int(input)?;
            set(&mut a.max_attempts, key, v)
        }
        "base_delay" => {
            eq(input, key)?;
            let v = int(input)?;
            set(&mut a.base_delay, key, v)
        }
        "timeout" => {
            eq(input, key)?;
            let v = int(input)?;
            set(&mut a.timeout, key, v)
        }
        "start_delay" => {
            eq(input, key)?;
            let v = int(input)?;
            set(&mut a.start_delay, key, v)
        }
        _ => {
            if input.peek(Token![=]) {
                input.parse::<Token![=]>()?;
            }
            Err(unknown(key, STEP_KEYS, "step"))
        }
    });
    a
}
