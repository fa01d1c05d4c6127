//! The code of a checkpointed block: a function that runs its body as a
//! `remat_runtime::Region`, every top-level statement a runtime statement.
//!
//! Everything rustc type-checks is written out here (no helper macros), and
//! every check that can fail on the user's code is spanned at the user's
//! tokens: see `remat_runtime::__private` for the dispatch and the checks.

use proc_macro2::Span;
use proc_macro2::TokenStream;
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::Ident;

use crate::analyse::{Analysis, Read, StatementAnalysis};
use crate::model::{AnnotationKind, Block, Param, Passing, StmtKind};

const PRIVATE: &str = "::remat_runtime::__private";

fn private() -> TokenStream {
    PRIVATE.parse().expect("a path")
}

/// The region's own copy of a borrowed parameter (hidden from the body).
fn owned(ident: &Ident) -> Ident {
    format_ident!("__remat_owned_{}", ident, span = Span::mixed_site())
}

/// `let #ident = <the view of the region's own copy>;` for a borrowed
/// parameter: `&T` or `Option<&T>` again.
fn view(param: &Param, ident: &Ident, copy: &Ident) -> TokenStream {
    match &param.passing {
        Passing::Ref(ty) => quote! {
            #[allow(unused_variables)]
            let #ident: &#ty = ::core::borrow::Borrow::borrow(&#copy);
        },
        Passing::OptionRef(ty) => quote! {
            #[allow(unused_variables)]
            let #ident: ::core::option::Option<&#ty> =
                ::core::option::Option::as_ref(&#copy).map(::core::borrow::Borrow::borrow);
        },
        Passing::Value => quote! {},
    }
}

/// The reads of a statement in the order it declares them: those read for
/// their values first, then those read only for their shapes or detached.
fn declared_order(reads: &[Read]) -> Vec<Read> {
    let (values, others): (Vec<Read>, Vec<Read>) = reads.iter().cloned().partition(|r| r.for_value);
    values.into_iter().chain(others).collect()
}

/// The statement (or region) inputs of `reads`: their tensors, in order,
/// with the check that each owned one can be read, spanned at its mention (a
/// borrowed parameter's copy is `Clone`: `ToOwned` said so, or reported it).
/// A statement's also say how many of the first are read for their values.
fn inputs(reads: &[Read], statement: bool) -> TokenStream {
    let p = private();
    let mut out = TokenStream::new();
    let values = reads.iter().filter(|r| r.for_value).count();
    for (k, r) in reads.iter().enumerate() {
        if statement && k == values && values < reads.len() {
            out.extend(quote! { let __remat_values = __remat_inputs.len(); });
        }
        let ident = &r.ident;
        let span = ident.span();
        match r.borrowed_param {
            Some(_) => {
                let copy = owned(ident);
                out.extend(quote_spanned! {span=>
                    (&&&&#p::Probe(&#copy)).tensors(&mut __remat_inputs);
                });
            }
            None => out.extend(quote_spanned! {span=>
                let _: &dyn ::remat_runtime::rules::Readable = (&&&&#p::Probe(&#ident)).tensors(&mut __remat_inputs);
            }),
        }
    }
    let result = match (statement, values < reads.len()) {
        (false, _) => quote!(__remat_inputs),
        (true, true) => quote!((__remat_inputs, __remat_values)),
        (true, false) => quote!((__remat_inputs, ::core::primitive::usize::MAX)),
    };
    quote! {{
        #[allow(unused_mut)]
        let mut __remat_inputs = ::std::vec::Vec::new();
        #out
        #result
    }}
}

/// Inside a statement: each name it reads rebound to the value rebuilt from
/// the tensors the runtime handed the statement.
fn rebinds(reads: &[Read], params: &[Param]) -> TokenStream {
    let p = private();
    let mut out = quote! {
        #[allow(unused_mut, unused_variables)]
        let mut __remat_it = __remat_args.iter().cloned();
    };
    for r in reads {
        let ident = &r.ident;
        match r.borrowed_param {
            Some(i) => {
                let copy = owned(ident);
                let view = view(&params[i], ident, &copy);
                out.extend(quote! {
                    let #copy = (&&&&#p::Probe(&#copy)).rebuild(&mut __remat_it)?;
                    #view
                });
            }
            None => {
                let mutability = r.mutable.then(|| quote!(mut));
                out.extend(quote! {
                    #[allow(unused_mut, unused_variables)]
                    let #mutability #ident = (&&&&#p::Probe(&#ident)).rebuild(&mut __remat_it)?;
                });
            }
        }
    }
    out
}

/// A statement computing `body` (which ends by giving `__remat_value`) from
/// `reads`, through the statement method `method`; the closure's result is
/// `__remat_value` and the `mut` bindings it gives back.
fn statement_call(
    span: Span,
    method: &str,
    name: &str,
    reads: &[Read],
    params: &[Param],
    ret: &syn::Type,
    body: TokenStream,
) -> TokenStream {
    let p = private();
    let method = Ident::new(method, Span::call_site());
    let reads = declared_order(reads);
    let inputs = inputs(&reads, true);
    let rebinds = rebinds(&reads, params);
    // The closure fails with the block's own error type, so that `?`,
    // `bail!` and `return Err(..)` in a statement work as in the function.
    quote_spanned! {span=>
        <_ as ::remat_runtime::rules::StatementValue>::run(
            __remat_ctx,
            #p::Method::#method,
            #name,
            #inputs,
            |__remat_args| -> ::core::result::Result<_, #p::ErrorOf<#ret>> {
                #rebinds
                #body
            },
        )?
    }
}

fn method(statement: &StatementAnalysis) -> &'static str {
    match statement.kind {
        Some(AnnotationKind::Save) => "Save",
        Some(AnnotationKind::Offload) => "Offload",
        Some(AnnotationKind::Recompute) => "Recompute",
        _ => "Open",
    }
}

/// Drops bindings after their last reader, or where the statement moved
/// them (the ident is spanned there: a later read is rustc's "use of moved
/// value", pointing at the move).
fn releases(idents: &[Ident]) -> TokenStream {
    quote! { #(let _ = { #idents };)* }
}

/// `Ok(value)` or `Ok((value, given back...))`.
fn give(value: TokenStream, inouts: &[Ident]) -> TokenStream {
    if inouts.is_empty() {
        quote! { ::core::result::Result::Ok(#value) }
    } else {
        quote! { ::core::result::Result::Ok((#value, #(#inouts),*)) }
    }
}

/// The statement's value checks, spanned at its code: not a `Result`, and
/// (for `#[save]`/`#[offload]`) holding a tensor.
fn value_checks(span: Span, statement: &StatementAnalysis) -> TokenStream {
    let p = private();
    let mut out = quote_spanned! {span=>
        let _: &dyn ::remat_runtime::rules::Unwrapped = (&&#p::Probe(&__remat_value)).unwrapped();
    };
    if matches!(
        statement.kind,
        Some(AnnotationKind::Save | AnnotationKind::Offload)
    ) {
        out.extend(quote_spanned! {span=>
            let _: &dyn ::remat_runtime::rules::HoldsTensors = (&&#p::Probe(&__remat_value)).saveable();
        });
    }
    out
}

pub(crate) fn generate(block: &Block, analysis: &Analysis) -> TokenStream {
    let p = private();
    let func = &block.func;
    let (attrs, vis, sig) = (&func.attrs, &func.vis, &func.sig);
    let name = sig.ident.to_string();
    // A method's region is named after its type too (`DecoderLayer::forward`).
    let (region, receiver) = match &block.receiver {
        Some(this) => (
            quote! { &#p::method_region::<Self>(#name) },
            quote! { let #this = self; },
        ),
        None => (quote! { #name }, quote! {}),
    };
    let params = &block.params;

    // The region keeps its own copy of every parameter (the body runs again
    // in the backward, after this call returned): owned ones are moved in,
    // borrowed ones copied with `ToOwned`. Its inputs are their tensors,
    // collected and rebuilt as a statement's reads are.
    let mut copies = TokenStream::new();
    for param in params {
        let (ident, copy) = (&param.ident, owned(&param.ident));
        match &param.passing {
            Passing::Value => {}
            Passing::Ref(ty) => copies.extend(quote_spanned! {ty.span()=>
                let #copy = <#ty as ::std::borrow::ToOwned>::to_owned(#ident);
            }),
            Passing::OptionRef(ty) => copies.extend(quote_spanned! {ty.span()=>
                let #copy = #ident.map(<#ty as ::std::borrow::ToOwned>::to_owned);
            }),
        }
    }
    let param_reads: Vec<Read> = params
        .iter()
        .enumerate()
        .map(|(i, param)| Read {
            ident: param.ident.clone(),
            borrowed_param: param.borrowed().then_some(i),
            mutable: param.mutable,
            for_value: true,
        })
        .collect();
    let region_inputs = inputs(&param_reads, false);
    let region_rebinds = rebinds(&param_reads, params);

    let mut body = TokenStream::new();
    for (i, (stmt, sa)) in block
        .statements
        .iter()
        .zip(&analysis.statements)
        .enumerate()
    {
        let attrs = &stmt.attrs;
        let name = sa.name.as_str();
        let release = releases(&sa.releases);
        let value = format_ident!("__remat_s{}", i + 1);
        let inouts = &sa.inouts;
        let allow_mut = (!inouts.is_empty()).then(|| quote!(#[allow(unused_mut)]));
        match (&stmt.kind, sa.kind) {
            (StmtKind::Item(item), _) => body.extend(quote! { #item }),
            (StmtKind::Let { pat, init }, Some(AnnotationKind::Plain)) => body.extend(quote! {
                #(#attrs)* let #pat = #init;
                #release
            }),
            (StmtKind::Let { pat, init }, Some(AnnotationKind::ForwardOnly)) => {
                body.extend(quote! {
                    if !__remat_ctx.is_replay() {
                        #(#attrs)* let #pat = #init;
                    }
                    #release
                })
            }
            (StmtKind::Expr(e), Some(AnnotationKind::ForwardOnly)) => body.extend(quote! {
                if !__remat_ctx.is_replay() {
                    #(#attrs)* #e;
                }
                #release
            }),
            (StmtKind::Let { pat, init }, _) => {
                let span = init.span();
                let checks = value_checks(span, sa);
                // `let x: T = ...`: the value is a `T` (it may be what
                // decides an `.into()`).
                let annotation = match pat {
                    syn::Pat::Type(t) => {
                        let ty = &t.ty;
                        quote!(: #ty)
                    }
                    _ => quote!(),
                };
                let give = give(quote!(__remat_value), inouts);
                let call = statement_call(
                    span,
                    method(sa),
                    name,
                    &sa.reads,
                    params,
                    &block.ret,
                    quote_spanned! {span=>
                        let __remat_value #annotation = #init;
                        #checks
                        #give
                    },
                );
                let allow_pat_mut =
                    crate::usage::binds_mut(pat).then(|| quote!(#[allow(unused_mut)]));
                body.extend(if inouts.is_empty() && sa.releases.is_empty() {
                    quote! {
                        #allow_pat_mut
                        #(#attrs)* let #pat = #call;
                    }
                } else if inouts.is_empty() {
                    quote! {
                        let #value = #call;
                        #release
                        #allow_pat_mut
                        #(#attrs)* let #pat = #value;
                    }
                } else {
                    quote! {
                        let #value = #call;
                        #release
                        #allow_mut
                        let (__remat_value, #(mut #inouts),*) = #value;
                        #allow_pat_mut
                        #(#attrs)* let #pat = __remat_value;
                    }
                });
            }
            (StmtKind::Expr(e), _) => {
                let given = match inouts.len() {
                    0 => quote! { ::core::result::Result::Ok(()) },
                    1 => quote! { ::core::result::Result::Ok(#(#inouts)*) },
                    _ => quote! { ::core::result::Result::Ok((#(#inouts),*)) },
                };
                let call = statement_call(
                    e.span(),
                    method(sa),
                    name,
                    &sa.reads,
                    params,
                    &block.ret,
                    quote! { #(#attrs)* #e; #given },
                );
                body.extend(match inouts.len() {
                    0 => quote! { let () = #call; #release },
                    1 => quote! { let #value = #call; #release #allow_mut let #(mut #inouts)* = #value; },
                    _ => quote! { let #value = #call; #release #allow_mut let (#(mut #inouts),*) = #value; },
                });
            }
        }
    }
    let ret = &block.ret;
    let result = match &block.tail {
        Some(tail) => match &analysis.tail_passthrough {
            Some(ident) => quote! { ::core::result::Result::Ok(#ident) },
            None => {
                let call = statement_call(
                    tail.span(),
                    "Open",
                    "(return)",
                    &analysis.tail_reads,
                    params,
                    &block.ret,
                    quote! {
                        let __remat_value: #ret = #tail;
                        __remat_value
                    },
                );
                quote! { ::core::result::Result::Ok(#call) }
            }
        },
        None => quote! { ::core::unreachable!() },
    };

    let body = braces(
        block,
        quote! {
            #[allow(unused_imports)]
            use #p::{
                CheckPlain as _, CheckTensors as _, CheckUnwrapped as _, CheckValue as _,
                Unreadable as _, ViaClone as _, ViaResult as _, ViaTensor as _,
            };
            #receiver
            #copies
            let __remat_inputs = #region_inputs;
            // Statement bodies are wrapped as `Ok(body)`, and bodies end in `?`.
            #[allow(clippy::needless_question_mark)]
            let __remat_out = #p::region(#region).run(
                __remat_inputs,
                move |__remat_ctx, __remat_args| {
                    #region_rebinds
                    #body
                    #result
                },
            )?;
            ::core::result::Result::Ok(__remat_out)
        },
    );
    quote! {
        #(#attrs)*
        #vis #sig #body
    }
}

/// `{ inner }` with the span of the user's braces: the function is then the
/// user's item to rustc's lints (an unused block is dead code, as any fn).
fn braces(block: &Block, inner: TokenStream) -> proc_macro2::Group {
    let mut g = proc_macro2::Group::new(proc_macro2::Delimiter::Brace, inner);
    g.set_span(block.func.block.brace_token.span.join());
    g
}

/// What a block with errors expands to: its signature with a body that never
/// runs, so that callers still type-check.
pub(crate) fn stub(block: &Block) -> TokenStream {
    let func = &block.func;
    let (attrs, vis, sig) = (&func.attrs, &func.vis, &func.sig);
    let body = braces(
        block,
        quote! { ::core::unreachable!("remat! reported errors for this block") },
    );
    quote! {
        #(#attrs)*
        #[allow(unused_variables, unreachable_code)]
        #vis #sig #body
    }
}
