//! `#[schedule(flow = F, cron = "...")]`: a function whose body is a schedule's input becomes a function
//! returning the `Schedule`. The cron expression is parsed while the attribute expands (with `croner`, as the
//! runtime parses it), so an invalid literal is a compile error that quotes it.

use proc_macro2::{Span, TokenStream};
use quote::quote;
use syn::{ItemFn, LitInt, LitStr, Path};

/// The attribute's options.
#[derive(Default)]
struct Args {
    flow: Option<Path>,
    cron: Option<LitStr>,
    time_zone: Option<LitStr>,
    name: Option<LitStr>,
    catch_up: Option<LitInt>,
    overlap: Option<LitStr>,
    krate: Option<Path>,
}

pub(crate) fn expand(args: TokenStream, item: TokenStream) -> TokenStream {
    match try_expand(args, item) {
        Ok(t) => t,
        Err(e) => e.to_compile_error(),
    }
}

fn try_expand(args: TokenStream, item: TokenStream) -> syn::Result<TokenStream> {
    let mut a = Args::default();
    let parser = syn::meta::parser(|meta| {
        if meta.path.is_ident("flow") {
            a.flow = Some(meta.value()?.parse()?);
        } else if meta.path.is_ident("cron") {
            a.cron = Some(meta.value()?.parse()?);
        } else if meta.path.is_ident("time_zone") {
            a.time_zone = Some(meta.value()?.parse()?);
        } else if meta.path.is_ident("name") {
            a.name = Some(meta.value()?.parse()?);
        } else if meta.path.is_ident("catch_up") {
            a.catch_up = Some(meta.value()?.parse()?);
        } else if meta.path.is_ident("overlap") {
            a.overlap = Some(meta.value()?.parse()?);
        } else if meta.path.is_ident("crate") {
            let lit: LitStr = meta.value()?.parse()?;
            a.krate = Some(lit.parse()?);
        } else {
            return Err(meta.error(
                "unknown `#[schedule]` option; use flow, cron, time_zone, name, catch_up, overlap or crate",
            ));
        }
        Ok(())
    });
    syn::parse::Parser::parse2(parser, args)?;
    let f: ItemFn = syn::parse2(item)?;
    let flow = a.flow.ok_or_else(|| {
        syn::Error::new(Span::call_site(), "`#[schedule]` needs `flow = FlowType`")
    })?;
    let cron = a.cron.ok_or_else(|| {
        syn::Error::new(
            Span::call_site(),
            "`#[schedule]` needs `cron = \"...\"`, e.g. `cron = \"0 3 * * *\"`",
        )
    })?;
    if let Err(e) = croner::Cron::new(cron.value().trim())
        .with_seconds_optional()
        .parse()
    {
        return Err(syn::Error::new(
            cron.span(),
            format!(
                "invalid cron expression \"{}\": {e}; use 5 fields (minute hour day-of-month month day-of-week), 6 with seconds first, or @hourly, @daily...",
                cron.value()
            ),
        ));
    }
    let krate: Path = a
        .krate
        .unwrap_or_else(|| syn::parse_quote!(::pgflow_runtime));
    let missed = match &a.catch_up {
        None => quote!(),
        Some(n) => {
            let v: u32 = n.base10_parse()?;
            if !(1..=1000).contains(&v) {
                return Err(syn::Error::new(
                    n.span(),
                    "`catch_up` is 1 to 1000 missed fires",
                ));
            }
            quote!(.missed(#krate::schedules::Missed::CatchUp(#n)))
        }
    };
    let overlap = match &a.overlap {
        None => quote!(),
        Some(o) if o.value() == "allow" => quote!(.overlap(#krate::schedules::Overlap::Allow)),
        Some(o) if o.value() == "skip" => quote!(.overlap(#krate::schedules::Overlap::Skip)),
        Some(o) => {
            return Err(syn::Error::new(
                o.span(),
                "`overlap` is \"allow\" or \"skip\"",
            ))
        }
    };
    let time_zone = a.time_zone.map(|tz| quote!(.time_zone(#tz)));
    let ident = &f.sig.ident;
    let name = a
        .name
        .unwrap_or_else(|| LitStr::new(&ident.to_string(), ident.span()));
    let vis = &f.vis;
    let attrs = &f.attrs;
    let block = &f.block;
    Ok(quote! {
        #(#attrs)*
        #vis fn #ident() -> #krate::schedules::Schedule {
            let input: <#flow as #krate::Flow>::Input = #block;
            #krate::schedules::Schedule::for_flow::<#flow>(#name, #cron, &input)
                #time_zone #missed #overlap
        }
    })
}
