//! Error collection (serde's `Ctxt` idea) and "did you mean" suggestions.

use std::cell::RefCell;
use std::fmt::Display;

use proc_macro2::{Span, TokenStream};

/// Collects every error of one expansion so a single build reports them all.
#[derive(Default)]
pub(crate) struct Ctxt {
    errors: RefCell<Vec<syn::Error>>,
}

impl Ctxt {
    pub(crate) fn push(&self, e: syn::Error) {
        self.errors.borrow_mut().push(e);
    }

    pub(crate) fn error(&self, span: Span, msg: impl Display) {
        self.push(syn::Error::new(span, msg));
    }

    /// An error over every token of `tokens` (first to last).
    pub(crate) fn spanned(&self, tokens: impl quote::ToTokens, msg: impl Display) {
        self.push(syn::Error::new_spanned(tokens, msg));
    }

    pub(crate) fn has_errors(&self) -> bool {
        !self.errors.borrow().is_empty()
    }

    /// All errors as `compile_error!` invocations.
    pub(crate) fn into_compile_errors(self) -> TokenStream {
        let mut all: Option<syn::Error> = None;
        for e in self.errors.into_inner() {
            match &mut all {
                Some(a) => a.combine(e),
                None => all = Some(e),
            }
        }
        all.map(|e| e.to_compile_error()).unwrap_or_default()
    }
}

fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// `"; did you mean `x`?"` for the closest candidate, or an empty string.
pub(crate) fn did_you_mean<'a>(
    name: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> String {
    let lower = name.to_lowercase();
    let best = candidates
        .into_iter()
        .filter(|c| *c != name)
        .map(|c| {
            let d = if c.to_lowercase() == lower {
                0
            } else {
                distance(&lower, &c.to_lowercase())
            };
            (d, c)
        })
        .min_by_key(|(d, _)| *d);
    match best {
        Some((d, c)) if d <= (name.chars().count() / 3).max(2) => {
            format!("; did you mean `{c}`?")
        }
        _ => String::new(),
    }
}
