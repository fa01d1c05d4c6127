//! The code of a checkpointed block: a function that runs its body as a
//! `remat_runtime::Region`, every top-level statement a runtime statement.

use proc_macro2::Span;
use proc_macro2::TokenStream;
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::Ident;

use crate::analyse::{Analysis, Read, StatementAnalysis};
use crate::model::{AnnotationKind, Block, StmtKind};

/// A call of a runtime statement method computing `body` from `reads`,
/// spanned at the user's statement so that type errors point there.
fn statement_call(
    span: Span,
    method: &str,
    name: &str,
    reads: &[Read],
    body: TokenStream,
) -> TokenStream {
    let method = Ident::new(method, span);
    let reads: Vec<TokenStream> = reads
        .iter()
        .map(|Read { ident, by_ref }| match by_ref {
            true => quote!(ref #ident),
            false => quote!(own #ident),
        })
        .collect();
    if reads.is_empty() {
        return quote_spanned! {span=>
            __remat_ctx.#method(#name, ::std::vec::Vec::new(), |_| { #body })?
        };
    }
    quote_spanned! {span=>
        __remat_ctx.#method(
            #name,
            ::remat_runtime::__remat_inputs![#(#reads),*],
            |__remat_args| {
                ::remat_runtime::__remat_rebind!(__remat_args; #(#reads),*);
                #body
            },
        )?
    }
}

fn method(statement: &StatementAnalysis) -> &'static str {
    match statement.kind {
        Some(AnnotationKind::Save) => "save",
        Some(AnnotationKind::Offload) => "offload",
        Some(AnnotationKind::Recompute) => "recompute",
        _ => "open",
    }
}

fn releases(idents: &[Ident]) -> TokenStream {
    quote! { #(::remat_runtime::__private::release(#idents);)* }
}

pub(crate) fn generate(block: &Block, analysis: &Analysis) -> TokenStream {
    let func = &block.func;
    let (attrs, vis, sig) = (&func.attrs, &func.vis, &func.sig);
    let region = sig.ident.to_string();

    // The region's inputs are the tensors of the parameters; the body owns
    // copies of the `&T` parameters (it runs again in the backward) and sees
    // them as references again.
    let mut inputs = Vec::new();
    let mut copies = TokenStream::new();
    let mut rebinds = Vec::new();
    for p in &block.params {
        let ident = &p.ident;
        if p.by_ref {
            inputs.push(quote!(ref #ident));
            copies.extend(quote! { let #ident = ::core::clone::Clone::clone(#ident); });
            rebinds.push(quote!(as_ref #ident));
        } else {
            inputs.push(quote!(own #ident));
            rebinds.push(match p.mutable {
                true => quote!(own_mut #ident),
                false => quote!(own #ident),
            });
        }
    }

    let mut body = TokenStream::new();
    for (i, (stmt, sp)) in block
        .statements
        .iter()
        .zip(&analysis.statements)
        .enumerate()
    {
        let attrs = &stmt.attrs;
        let name = sp.name.as_str();
        let release = releases(&sp.releases);
        let value = format_ident!("__remat_s{}", i + 1);
        match (&stmt.kind, sp.kind) {
            (StmtKind::Item(item), _) => body.extend(quote! { #item }),
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
                let call = statement_call(
                    init.span(),
                    method(sp),
                    name,
                    &sp.reads,
                    quote_spanned! {init.span()=> ::core::result::Result::Ok(#init) },
                );
                body.extend(if sp.releases.is_empty() {
                    quote! { #(#attrs)* let #pat = #call; }
                } else {
                    quote! {
                        let #value = #call;
                        #release
                        #(#attrs)* let #pat = #value;
                    }
                });
            }
            (StmtKind::Expr(e), _) => {
                let call = statement_call(
                    e.span(),
                    method(sp),
                    name,
                    &sp.reads,
                    quote! { #(#attrs)* #e; ::core::result::Result::Ok(()) },
                );
                body.extend(quote! {
                    let () = #call;
                    #release
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
                    "open",
                    "(return)",
                    &analysis.tail_reads,
                    quote! {
                        let __remat_v: #ret = #tail;
                        ::remat_runtime::__private::tail(__remat_v)
                    },
                );
                quote! { ::core::result::Result::Ok(#call) }
            }
        },
        None => quote! { ::core::unreachable!() },
    };

    quote! {
        #(#attrs)*
        #vis #sig {
            let __remat_inputs = ::remat_runtime::__remat_inputs![#(#inputs),*];
            #copies
            // Statement bodies are wrapped as `Ok(body)`, and bodies end in `?`.
            #[allow(clippy::needless_question_mark)]
            let __remat_out = ::remat_runtime::__private::region(#region).run(
                __remat_inputs,
                move |__remat_ctx, __remat_args| {
                    ::remat_runtime::__remat_rebind!(__remat_args; #(#rebinds),*);
                    #body
                    #result
                },
            )?;
            ::core::result::Result::Ok(__remat_out)
        }
    }
}

/// What a block with errors expands to: its signature with a body that never
/// runs, so that callers still type-check.
pub(crate) fn stub(block: &Block) -> TokenStream {
    let func = &block.func;
    let (attrs, vis, sig) = (&func.attrs, &func.vis, &func.sig);
    quote! {
        #(#attrs)*
        #[allow(unused_variables, unreachable_code)]
        #vis #sig {
            ::core::unreachable!("remat! reported errors for this block")
        }
    }
}
