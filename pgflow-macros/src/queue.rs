//! `#[queue("name")]`: a unit struct that names one shared PGMQ queue.
//!
//! The name is checked while the attribute expands, with `pgflow_sql::names::check_queue_name`
//! (the rule the SQL core applies to every named route), so a bad name is an error on the literal.
//! The struct is always emitted, with its `Queue` impl when it can have one, so a mistake here
//! causes no follow-on errors where the queue is used.

use heck::ToSnakeCase;
use proc_macro2::{Span, TokenStream};
use quote::quote;
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{Fields, Item, ItemStruct, LitStr, Path, Token};

use crate::attr::parse_queue_attr;
use crate::ctxt::Ctxt;
use pgflow_sql::names::{self, InvalidQueueNameError, MAX_QUEUE_NAME_LEN};

/// The derives a marker type needs, by name and absolute path.
const DERIVES: &[(&str, &str)] = &[
    ("Debug", "::core::fmt::Debug"),
    ("Clone", "::core::clone::Clone"),
    ("Copy", "::core::marker::Copy"),
    ("Default", "::core::default::Default"),
    ("PartialEq", "::core::cmp::PartialEq"),
    ("Eq", "::core::cmp::Eq"),
    ("Hash", "::core::hash::Hash"),
];

/// Everything that replaces a `#[queue(...)]` item.
pub(crate) fn expand(args: TokenStream, item: TokenStream) -> TokenStream {
    let cx = Ctxt::default();
    let attr = parse_queue_attr(&cx, args);
    if let Some(name) = &attr.name {
        name_rule(&cx, name);
    }
    let krate: Path = attr
        .krate
        .get()
        .cloned()
        .unwrap_or_else(|| syn::parse_quote!(::pgflow_runtime));
    let name = attr.name.as_ref().map(LitStr::value).unwrap_or_default();
    let expanded = match syn::parse2::<Item>(item.clone()) {
        Ok(Item::Struct(s)) => {
            let unit = unit_struct(&cx, &s);
            let derives = unit.then(|| derives(&cx, &s));
            let ident = &s.ident;
            let queue_impl = s.generics.params.is_empty().then(|| {
                quote! {
                    impl #krate::__private::Queue for #ident {
                        const NAME: &'static str = #name;
                    }
                }
            });
            quote!(#derives #s #queue_impl)
        }
        Ok(other) => {
            cx.error(
                keyword_span(&other),
                "`#[queue]` goes on a unit struct: `#[queue(\"classify_threads\")] pub struct ClassifyThreads;`",
            );
            item
        }
        Err(_) => {
            cx.error(
                Span::call_site(),
                "`#[queue]` goes on a unit struct: `#[queue(\"classify_threads\")] pub struct ClassifyThreads;`",
            );
            item
        }
    };
    let errors = cx.into_compile_errors();
    quote!(#errors #expanded)
}

/// The queue name is a lowercase identifier of 1 to 47 characters (`check_queue_name`).
fn name_rule(cx: &Ctxt, lit: &LitStr) {
    let name = lit.value();
    let Err(e) = names::check_queue_name(&name) else {
        return;
    };
    let found = match &e {
        InvalidQueueNameError::BadStart { .. } => name
            .chars()
            .next()
            .map_or_else(String::new, |c| format!(", not `{c}`")),
        _ => String::new(),
    };
    let fix = match &e {
        InvalidQueueNameError::Empty => {
            "name the queue, e.g. `#[queue(\"classify_threads\")]`".to_owned()
        }
        InvalidQueueNameError::TooLong { len, .. } => {
            let over = len - MAX_QUEUE_NAME_LEN;
            format!(
                "remove at least {over} character{}",
                if over == 1 { "" } else { "s" }
            )
        }
        _ => match suggestion(&name) {
            Some(s) => format!("write `{s}`"),
            None => "start with a lowercase ASCII letter or `_` and use only lowercase ASCII letters, digits and `_`".to_owned(),
        },
    };
    cx.error(lit.span(), format!("{e}{found}; {fix}"));
}

/// The snake_case spelling of a name, when that is a valid queue name.
fn suggestion(name: &str) -> Option<String> {
    let s = name.to_snake_case();
    (s != name && names::check_queue_name(&s).is_ok()).then_some(s)
}

/// A queue type is a unit struct without generics. Returns whether it is one.
fn unit_struct(cx: &Ctxt, s: &ItemStruct) -> bool {
    let mut ok = true;
    if !s.generics.params.is_empty() || s.generics.where_clause.is_some() {
        cx.spanned(
            &s.generics,
            "a queue type cannot be generic: it names exactly one queue",
        );
        ok = false;
    }
    if !matches!(s.fields, Fields::Unit) {
        cx.error(
            s.fields.span(),
            format!(
                "a queue type is a unit struct: remove the fields (`pub struct {};`)",
                s.ident
            ),
        );
        ok = false;
    }
    ok
}

/// `#[derive(..)]` of the marker derives. One the user derives too (in a `#[derive]` written after
/// `#[queue]`, the only kind the attribute sees) is an error on the user's, and is left out here so
/// that it is the only error.
fn derives(cx: &Ctxt, s: &ItemStruct) -> TokenStream {
    let mut written: Vec<String> = Vec::new();
    for a in s.attrs.iter().filter(|a| a.path().is_ident("derive")) {
        let Ok(paths) = a.parse_args_with(Punctuated::<Path, Token![,]>::parse_terminated) else {
            continue;
        };
        for p in &paths {
            let Some(last) = p.segments.last().map(|s| s.ident.to_string()) else {
                continue;
            };
            if DERIVES.iter().any(|(name, _)| *name == last) {
                cx.spanned(
                    p,
                    format!("`#[queue]` already derives `{last}`; remove it from this `#[derive]`"),
                );
                written.push(last);
            }
        }
    }
    let ours: Vec<Path> = DERIVES
        .iter()
        .filter(|(name, _)| !written.iter().any(|w| w == name))
        .map(|(_, path)| syn::parse_str(path).expect("derive paths parse"))
        .collect();
    quote!(#[derive(#(#ours),*)])
}

/// The span of an item's keyword (`enum`, `fn`, ...), for "wrong kind of item".
fn keyword_span(item: &Item) -> Span {
    match item {
        Item::Enum(i) => i.enum_token.span,
        Item::Fn(i) => i.sig.fn_token.span,
        Item::Union(i) => i.union_token.span,
        Item::Mod(i) => i.mod_token.span,
        Item::Trait(i) => i.trait_token.span,
        Item::Type(i) => i.type_token.span,
        Item::Const(i) => i.const_token.span,
        Item::Static(i) => i.static_token.span,
        Item::Impl(i) => i.impl_token.span,
        _ => Span::call_site(),
    }
}
