//! The code of a checkpointed block: a function that runs its body as a
//! `remat_runtime::Region`, every top-level statement a runtime statement.

use proc_macro2::TokenStream;
use quote::{format_ident, quote};
use syn::{Expr, Ident};

use crate::analyse::{Plan, Read, StmtPlan};
use crate::parse::{Block, Kind, StmtKind};

/// `collect` pushes the tensors of a read binding into `__remat_t`;
/// `rebind` rebuilds it from the inputs the runtime hands the statement.
fn collect_and_rebind(reads: &[Read]) -> (TokenStream, TokenStream) {
    let mut collect = TokenStream::new();
    let mut rebind = TokenStream::new();
    for Read { ident, by_ref } in reads {
        if *by_ref {
            let own = format_ident!("__remat_own_{}", ident);
            collect.extend(quote! { (&&__RematProbe(#ident)).__remat_collect(&mut __remat_t); });
            rebind.extend(quote! {
                let #own = (&&__RematProbe(#ident)).__remat_rebuild(&mut __remat_it)?;
                #[allow(unused_variables)]
                let #ident = &#own;
            });
        } else {
            collect.extend(quote! { (&&__RematProbe(&#ident)).__remat_collect(&mut __remat_t); });
            rebind.extend(quote! {
                #[allow(unused_variables)]
                let #ident = (&&__RematProbe(&#ident)).__remat_rebuild(&mut __remat_it)?;
            });
        }
    }
    (collect, rebind)
}

/// A call of a runtime statement method computing `body` from `reads`.
fn statement_call(
    method: TokenStream,
    name: &str,
    reads: &[Read],
    body: TokenStream,
) -> TokenStream {
    if reads.is_empty() {
        return quote! { __remat_ctx.#method(#name, &[], |_| { #body })? };
    }
    let (collect, rebind) = collect_and_rebind(reads);
    quote! {
        {
            let mut __remat_t = ::std::vec::Vec::new();
            #collect
            let __remat_r: ::std::vec::Vec<&::remat_runtime::candle_core::Tensor> =
                __remat_t.iter().collect();
            __remat_ctx.#method(#name, &__remat_r, |__remat_in| {
                let mut __remat_it = __remat_in.iter().cloned();
                #rebind
                #body
            })?
        }
    }
}

fn method(plan: &StmtPlan) -> TokenStream {
    match (plan.kind, plan.kept) {
        (Kind::Save, true) => quote!(save_kept),
        (Kind::Save, false) => quote!(save),
        _ => quote!(recompute),
    }
}

fn releases(idents: &[Ident]) -> TokenStream {
    quote! { #(::remat_runtime::__private::release(#idents);)* }
}

/// `Ok(x)` with `x` an owned binding: returned as it is, no statement needed.
fn plain_ok(tail: &Expr, reads: &[Read]) -> Option<Ident> {
    let Expr::Call(call) = tail else { return None };
    let Expr::Path(f) = &*call.func else {
        return None;
    };
    if !f.path.is_ident("Ok") || call.args.len() != 1 {
        return None;
    }
    let Expr::Path(arg) = &call.args[0] else {
        return None;
    };
    let ident = arg.path.get_ident()?;
    reads
        .iter()
        .any(|r| r.ident == *ident && !r.by_ref)
        .then(|| ident.clone())
}

pub(crate) fn generate(block: &Block, plan: &Plan) -> TokenStream {
    let func = &block.func;
    let (attrs, vis, sig) = (&func.attrs, &func.vis, &func.sig);
    let region = sig.ident.to_string();

    let mut captures = TokenStream::new();
    let mut params = TokenStream::new();
    for p in &block.params {
        let ident = &p.ident;
        let arg = format_ident!("__remat_arg_{}", ident);
        if p.by_ref {
            let own = format_ident!("__remat_own_{}", ident);
            captures.extend(quote! { let #arg = ::core::clone::Clone::clone(#ident); });
            params.extend(quote! {
                let #own = (&&__RematProbe(&#arg)).__remat_rebuild(&mut __remat_it)?;
                #[allow(unused_variables)]
                let #ident = &#own;
            });
        } else {
            let mutability = p.mutable.then(|| quote!(mut));
            captures.extend(quote! { let #arg = #ident; });
            params.extend(quote! {
                #[allow(unused_variables)]
                let #mutability #ident = (&&__RematProbe(&#arg)).__remat_rebuild(&mut __remat_it)?;
            });
        }
        captures.extend(quote! { (&&__RematProbe(&#arg)).__remat_collect(&mut __remat_t); });
    }

    let mut body = TokenStream::new();
    for (i, (stmt, sp)) in block.statements.iter().zip(&plan.statements).enumerate() {
        let attrs = &stmt.attrs;
        let name = sp.name.as_str();
        let release = releases(&sp.releases);
        let value = format_ident!("__remat_s{}", i + 1);
        match (&stmt.kind, sp.kind) {
            (StmtKind::Item(item), _) => body.extend(quote! { #item }),
            (StmtKind::Let { pat, init }, Kind::ForwardOnly) => body.extend(quote! {
                if !__remat_ctx.is_replay() {
                    #(#attrs)* let #pat = #init;
                }
                #release
            }),
            (StmtKind::Expr(e), Kind::ForwardOnly) => body.extend(quote! {
                if !__remat_ctx.is_replay() {
                    #(#attrs)* #e;
                }
                #release
            }),
            (StmtKind::Let { pat, init }, _) => {
                let call = statement_call(
                    method(sp),
                    name,
                    &sp.reads,
                    quote! { ::core::result::Result::Ok(#init) },
                );
                body.extend(quote! {
                    let #value = #call;
                    #release
                    #(#attrs)* let #pat = #value;
                });
            }
            (StmtKind::Expr(e), _) => {
                let call = statement_call(
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
        Some(tail) => match plain_ok(tail, &plan.tail_reads) {
            Some(ident) => quote! { ::core::result::Result::Ok(#ident) },
            None => {
                let call = statement_call(
                    quote!(recompute),
                    "(return)",
                    &plan.tail_reads,
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
            #[allow(unused_imports)]
            use ::remat_runtime::__private::{Probe as __RematProbe, ViaPlain as _, ViaTensor as _};
            let mut __remat_t = ::std::vec::Vec::new();
            #captures
            let __remat_r: ::std::vec::Vec<&::remat_runtime::candle_core::Tensor> =
                __remat_t.iter().collect();
            let __remat_out = ::remat_runtime::Region::new(#region).run(
                &__remat_r,
                move |__remat_ctx, __remat_ins| {
                    let mut __remat_it = __remat_ins.iter().cloned();
                    #params
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
