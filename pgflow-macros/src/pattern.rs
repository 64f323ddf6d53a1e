//! Condition patterns (`if = { classify: { route: "help" } }`) read from Rust tokens into JSON.

use proc_macro2::Span;
use serde_json::{Map, Number, Value};
use syn::ext::IdentExt;
use syn::parse::{ParseStream, Result};

use syn::{braced, bracketed, token, Ident, Lit, LitStr, Token};

/// A parsed pattern, keeping the spans a later check points at.
#[derive(Debug, Clone)]
pub(crate) struct Pattern {
    /// The JSON value (keys as written; top-level keys may be rewritten to slugs later).
    pub(crate) value: Value,
    /// The whole pattern.
    pub(crate) span: Span,
    /// Top-level keys with their spans (empty when the pattern is not an object).
    pub(crate) top_keys: Vec<(String, Span)>,
}

/// Reads `{...}`, `[...]`, a literal, or a string literal holding JSON text.
pub(crate) fn parse_pattern(input: ParseStream<'_>) -> Result<Pattern> {
    let span = input
        .cursor()
        .token_tree()
        .map(|(tt, _)| tt.span())
        .unwrap_or_else(|| input.span());
    if input.peek(LitStr) {
        let lit: LitStr = input.parse()?;
        let value: Value = serde_json::from_str(&lit.value())
            .map_err(|e| syn::Error::new(lit.span(), format!("invalid JSON pattern: {e}")))?;
        let top_keys = match &value {
            Value::Object(m) => m.keys().map(|k| (k.clone(), lit.span())).collect(),
            _ => Vec::new(),
        };
        return Ok(Pattern {
            value,
            span: lit.span(),
            top_keys,
        });
    }
    let mut top_keys = Vec::new();
    let value = parse_value(input, Some(&mut top_keys))?;
    Ok(Pattern {
        value,
        span,
        top_keys,
    })
}

/// Reads one JSON value; `top_keys` collects the keys (with spans) when the value is an object.
fn parse_value(
    input: ParseStream<'_>,
    top_keys: Option<&mut Vec<(String, Span)>>,
) -> Result<Value> {
    if input.peek(token::Brace) {
        return parse_object(input, top_keys);
    }
    if input.peek(token::Bracket) {
        let content;
        bracketed!(content in input);
        let mut items = Vec::new();
        while !content.is_empty() {
            items.push(parse_value(&content, None)?);
            if content.is_empty() {
                break;
            }
            content.parse::<Token![,]>()?;
        }
        return Ok(Value::Array(items));
    }
    parse_scalar(input)
}

/// Reads `{ key: value, .. }`, refusing a duplicate key.
fn parse_object(
    input: ParseStream<'_>,
    mut keys: Option<&mut Vec<(String, Span)>>,
) -> Result<Value> {
    let content;
    braced!(content in input);
    let mut map = Map::new();
    while !content.is_empty() {
        let (key, span) = if content.peek(LitStr) {
            let s: LitStr = content.parse()?;
            (s.value(), s.span())
        } else if content.peek(Ident::peek_any) {
            let i = content.call(Ident::parse_any)?;
            (i.unraw().to_string(), i.span())
        } else {
            return Err(content.error("expected a key: an identifier or a string literal"));
        };
        content.parse::<Token![:]>()?;
        let v = parse_value(&content, None)?;
        if map.insert(key.clone(), v).is_some() {
            return Err(syn::Error::new(
                span,
                format!("duplicate key `{key}` in pattern"),
            ));
        }
        if let Some(k) = keys.as_deref_mut() {
            k.push((key, span));
        }
        if content.is_empty() {
            break;
        }
        content.parse::<Token![,]>()?;
    }
    Ok(Value::Object(map))
}

/// Reads `null`, `true`, `false`, a string or a number, with an optional leading `-` on a number.
fn parse_scalar(input: ParseStream<'_>) -> Result<Value> {
    let negative = if input.peek(Token![-]) {
        input.parse::<Token![-]>()?;
        true
    } else {
        false
    };
    if input.peek(Ident::peek_any) && !negative {
        let i = input.call(Ident::parse_any)?;
        return match i.to_string().as_str() {
            "null" => Ok(Value::Null),
            "true" => Ok(Value::Bool(true)),
            "false" => Ok(Value::Bool(false)),
            other => Err(syn::Error::new(
                i.span(),
                format!("expected a JSON value, found `{other}`; write strings in double quotes"),
            )),
        };
    }
    let lit: Lit = input.parse()?;
    match &lit {
        Lit::Str(s) if !negative => Ok(Value::String(s.value())),
        Lit::Bool(b) if !negative => Ok(Value::Bool(b.value)),
        Lit::Int(i) => {
            let digits = i.base10_digits();
            let text = if negative { format!("-{digits}") } else { digits.to_owned() };
            if let Ok(n) = text.parse::<i64>() {
                Ok(Value::Number(n.into()))
            } else if let Ok(n) = text.parse::<u64>() {
                Ok(Value::Number(n.into()))
            } else {
                Err(syn::Error::new(i.span(), "integer out of range for JSON"))
            }
        }
        Lit::Float(f) => {
            let v: f64 = f.base10_parse()?;
            let v = if negative { -v } else { v };
            Number::from_f64(v)
                .map(Value::Number)
                .ok_or_else(|| syn::Error::new(f.span(), "not a finite number"))
        }
        _ => Err(syn::Error::new(
            lit.span(),
            "expected a JSON value: an object `{..}`, an array `[..]`, a string, a number, `true`, `false` or `null`",
        )),
    }
}
