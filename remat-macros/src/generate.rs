//! The code of a checkpointed block: one call of the runtime's
//! `rt::BlockValue::run(rt::region::<R>(name, errors), names, args, body)`,
//! in which every top-level statement
//! is one call `rt::StatementValue::run(ctx, name, names, policy, reads,
//! code)`.
//!
//! What a statement reads is handed over as `rt::read(&x).arg()` (the
//! runtime picks how by the value's type) and seen again by its code as a
//! closure parameter of the same name. Every check that can fail on the
//! user's code is spanned at the user's tokens and written as a cast to a
//! `remat_runtime::rules` trait, whose message rustc reports.
//!
//! The names the expansion introduces (`ctx`, `value`) are hygienic: they
//! never clash with the user's; `rt` is the runtime's support module.

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{Ident, Type};

use crate::analyse::{Analysis, Borrowed, Read, StatementAnalysis};
use crate::fields::FieldRead;
use crate::host::HostValue;
use crate::model::{AnnotationKind, Block, Param, Passing, Statement, StmtKind};

/// A name of the expansion's own, invisible to the user's code.
fn own(name: &str) -> Ident {
    Ident::new(name, Span::mixed_site())
}

/// `[T]` or `str`: a borrowed parameter of a type that is not `Clone`
/// itself, whose own copy is its `ToOwned` (`Vec<T>`, `String`).
fn unsized_type(ty: &Type) -> bool {
    match ty {
        Type::Slice(_) => true,
        Type::Path(p) => p.qself.is_none() && p.path.is_ident("str"),
        Type::Paren(p) => unsized_type(&p.elem),
        _ => false,
    }
}

/// `Tensor` or `Var`: clearly `Clone`, no check written.
fn tensor_type(ty: &Type) -> bool {
    match ty {
        Type::Path(p) => {
            p.path.segments.last().is_some_and(|s| {
                s.arguments.is_empty() && (s.ident == "Tensor" || s.ident == "Var")
            })
        }
        _ => false,
    }
}

/// How a value read by a statement (or the region) is handed over, how the
/// code sees it again (a closure parameter's pattern), and what the code
/// does first with it (`Option<&T>` parameters: `.as_ref()` again).
struct Handover {
    arg: TokenStream,
    pat: TokenStream,
    view: TokenStream,
}

/// Who a value is handed over to.
#[derive(Clone, Copy)]
enum Taker {
    /// The region, a parameter of the function: it makes its own copy
    /// here (statements read the region's), and reads it for its value.
    Region,
    /// A statement: `mutable` when it may change the binding (`mut`),
    /// `for_value` when it reads its values (else only its shape, or
    /// detached), `in_part` when only some of them (`parts[0]`),
    /// `on_branch` when only on some branches (`if skip { (h + x)? } ...`).
    Statement {
        mutable: bool,
        for_value: bool,
        in_part: bool,
        on_branch: bool,
    },
}

/// `refs`: references taken of a reference (`let xr = &x;` with `x: &T`):
/// read through, and taken again in the statement's view.
/// `kept`: the reference kept before a later `let` took the name, to read
/// it through (what a closure the statement calls borrows).
fn handover(
    ident: &Ident,
    passing: Option<&Passing>,
    taker: Taker,
    refs: usize,
    kept: Option<&Ident>,
) -> Handover {
    let span = ident.span();
    let derefs = std::iter::repeat_n(quote!(*), refs);
    let target = quote!(#(#derefs)* #ident);
    // A method's receiver: `(*m).cloned()`.
    let receiver = if refs == 0 {
        quote!(#ident)
    } else {
        quote!((#target))
    };
    let (region, mutable, for_value, in_part, on_branch) = match taker {
        Taker::Region => (true, false, true, false, false),
        Taker::Statement {
            mutable,
            for_value,
            in_part,
            on_branch,
        } => (false, mutable, for_value, in_part, on_branch),
    };
    let mutability = mutable.then(|| quote!(mut));
    let (read, pat, view) = match passing {
        Some(Passing::Ref(ty)) if region && unsized_type(ty) => (
            quote_spanned!(span=> rt::param(&<#ty as ::std::borrow::ToOwned>::to_owned(#ident))),
            quote!(ref #ident),
            quote!(),
        ),
        Some(Passing::Ref(_)) if region => (
            quote_spanned!(span=> rt::param(#ident)),
            quote!(ref #ident),
            quote!(),
        ),
        Some(Passing::Ref(_)) => (
            match kept {
                Some(kept) => quote_spanned!(span=> rt::read(*#kept)),
                None => quote_spanned!(span=> rt::read(#target)),
            },
            quote!(ref #ident),
            quote!(),
        ),
        Some(Passing::OptionRef(ty)) => (
            if region && unsized_type(ty) {
                quote_spanned!(span=> rt::param(&#ident.map(<#ty as ::std::borrow::ToOwned>::to_owned)))
            } else if region {
                quote_spanned!(span=> rt::param(&#ident.cloned()))
            } else {
                match kept {
                    Some(kept) => quote_spanned!(span=> rt::read(&(*#kept).cloned())),
                    None => quote_spanned!(span=> rt::read(&#receiver.cloned())),
                }
            },
            quote!(#ident),
            quote! { let #ident = #ident.as_ref(); },
        ),
        Some(Passing::Value) | None if region => (
            quote_spanned!(span=> rt::param(&#ident)),
            quote!(#mutability #ident),
            quote!(),
        ),
        Some(Passing::Value) | None => (
            match kept {
                Some(kept) => quote_spanned!(span=> rt::read(#kept)),
                None => quote_spanned!(span=> rt::read(&#ident)),
            },
            quote!(#mutability #ident),
            quote!(),
        ),
    };
    let refs = std::iter::repeat_n(quote!(&), refs);
    let view = if passing.is_some() && refs.len() > 0 {
        quote! { #view let #ident = #(#refs)* #ident; }
    } else {
        view
    };
    let arg = match (for_value, in_part, on_branch) {
        (true, _, true) => quote!(#read.arg().on_branch()),
        (true, false, false) => quote!(#read.arg()),
        (true, true, false) => quote!(#read.arg().partly()),
        (false, _, _) => quote!(#read.arg().without_grad()),
    };
    Handover { arg, pat, view }
}

/// `(a, b, ...)` with a trailing comma for one element, nested by twelve
/// (the runtime's tuples of reads go to twelve).
fn tuple(items: Vec<TokenStream>) -> TokenStream {
    if items.len() > 12 {
        let chunks: Vec<TokenStream> = items.chunks(12).map(|c| tuple(c.to_vec())).collect();
        return tuple(chunks);
    }
    match items.len() {
        1 => {
            let item = &items[0];
            quote!((#item,))
        }
        _ => quote!((#(#items),*)),
    }
}

/// What a statement reads, handed over.
struct Reads {
    /// The tuple of handovers.
    args: TokenStream,
    /// The closure's pattern for them.
    pats: TokenStream,
    /// `let x = x.as_ref();` for `Option<&T>` parameters.
    views: TokenStream,
    /// The `Readable` checks of reads of plain code's bindings.
    checks: TokenStream,
    /// `&["q", "k"]`: the names of those read for their values, as errors
    /// name them.
    names: TokenStream,
}

/// The reads of a statement in the order it hands them over: those read
/// for their values first, then those read only for their shapes or
/// detached. Each as its handover; plus the `Readable` checks of reads of
/// plain code's bindings (a closure may not be `Clone`).
/// `changes`: the `mut` bindings the statement may change.
fn reads(reads: &[Read], changes: &[Ident], params: &[Param]) -> Reads {
    let (values, others): (Vec<&Read>, Vec<&Read>) = reads.iter().partition(|r| r.for_value);
    // A method's `self` is read as the macro's `self_`.
    let names = values.iter().map(|r| match r.ident.to_string() {
        name if name == "self_" => "self".to_string(),
        name => name,
    });
    let names = quote!(&[#(#names),*]);
    let (mut args, mut pats, mut views, mut checks) =
        (vec![], vec![], TokenStream::new(), TokenStream::new());
    for r in values.into_iter().chain(others) {
        let reference = Passing::Ref(syn::parse_quote!(_));
        let passing = r.borrowed.map(|b| match b {
            Borrowed::Param(i) => &params[i].passing,
            Borrowed::Binding => &reference,
        });
        let taker = Taker::Statement {
            mutable: r.mutable && changes.contains(&r.ident),
            for_value: r.for_value,
            in_part: r.in_part,
            on_branch: r.on_branch,
        };
        let h = handover(&r.ident, passing, taker, r.refs, r.source.as_ref());
        args.push(h.arg);
        pats.push(h.pat);
        views.extend(h.view);
        if r.plain_code {
            let ident = &r.ident;
            let read = match &r.source {
                Some(kept) => quote!(#kept),
                None => quote!(&#ident),
            };
            checks.extend(quote_spanned! {ident.span()=>
                let _: &dyn rt::Readable = #read;
            });
        }
    }
    Reads {
        args: tuple(args),
        pats: tuple(pats),
        views,
        checks,
        names,
    }
}

fn declared(statement: &StatementAnalysis) -> TokenStream {
    match statement.kind {
        Some(AnnotationKind::Save) => quote!(rt::Save),
        Some(AnnotationKind::Offload) => quote!(rt::Offload),
        Some(AnnotationKind::Recompute) => quote!(rt::Recompute),
        _ => quote!(rt::Open),
    }
}

/// Before a statement that reads plain values computed on the host
/// (`Tensor::new(&w, ..)`, `(h * w as f64)?`): for each, `ctx.host_data(name,
/// "w", &w, sources);`, which refuses floats computed on the host from
/// values that need gradients, should the statement make a float tensor.
fn host_data(name: &str, values: &[HostValue]) -> TokenStream {
    let ctx = own("ctx");
    values
        .iter()
        .map(|v| {
            let (ident, fields, sources) = (&v.ident, &v.fields, &v.sources);
            let label = v.label();
            quote! { #ctx.host_data(#name, #label, &#ident #(.#fields)*, &[#(#sources),*]); }
        })
        .collect()
}

/// One statement: `rt::StatementValue::run(ctx, name, names, policy,
/// reads, |reads| code)`, spanned at the user's code (so that a value no
/// statement can give is reported there); the checks of what it reads
/// come before it.
struct StatementCall {
    checks: TokenStream,
    call: TokenStream,
}

fn statement_call(
    span: Span,
    sa: &StatementAnalysis,
    params: &[Param],
    code: TokenStream,
) -> StatementCall {
    let ctx = own("ctx");
    let (name, declared) = (sa.name.as_str(), declared(sa));
    let changes = &sa.changes;
    let Reads {
        args,
        pats,
        views,
        checks,
        names,
    } = reads(&sa.reads, changes, params);
    // A `mut` binding the statement may change (a method call on it) but
    // does not.
    let pats = if changes.is_empty() {
        pats
    } else {
        quote!(#[allow(unused_mut)] #pats)
    };
    let closures = &sa.closures;
    let code = if views.is_empty() && closures.is_empty() {
        code
    } else {
        quote!({ #views #(#closures)* #code })
    };
    // The `?` too: a value of another type than the binding's is reported
    // at the statement.
    let call = quote_spanned! {span=>
        rt::StatementValue::run(#ctx, #name, #names, #declared, #args, |#pats| #code)?
    };
    StatementCall { checks, call }
}

/// Drops bindings after their last reader, or where the statement moved
/// them (the ident is spanned there: a later read is rustc's "use of moved
/// value", pointing at the move).
fn releases(idents: &[Ident]) -> TokenStream {
    quote! { #(rt::drop(#idents);)* }
}

/// A changed `mut` binding given back with the statement's value.
fn give(ident: &Ident) -> TokenStream {
    quote!(rt::Given(rt::read(&#ident).how(), #ident))
}

/// The binding a given-back value is bound to again.
fn given(ident: &Ident) -> TokenStream {
    quote!(rt::Given(_, #ident))
}

/// The check that a `#[save]`/`#[offload]` statement's value holds a
/// tensor, on the binding of `let NAME = ...` (a tuple always passes).
fn saved_check(pat: &syn::Pat, init_span: Span) -> TokenStream {
    let ident = match pat {
        syn::Pat::Ident(i) => &i.ident,
        syn::Pat::Type(t) => match &*t.pat {
            syn::Pat::Ident(i) => &i.ident,
            _ => return quote!(),
        },
        _ => return quote!(),
    };
    quote_spanned! {init_span=>
        let _: &dyn rt::HoldsTensors = (&&rt::Probe(&#ident)).saveable();
    }
}

pub(crate) fn generate(block: &Block, analysis: &Analysis) -> TokenStream {
    let func = &block.func;
    let (attrs, vis, sig) = (&func.attrs, &func.vis, &func.sig);
    let name = sig.ident.to_string();
    let ctx = own("ctx");
    // A method's region is named after its type too (`DecoderLayer::forward`).
    // `self` as the signature wrote it: inside a `macro_rules!` template,
    // a `self` of another expansion is not this method's (rustc's E0424).
    let (region, receiver) = match (&block.receiver, sig.receiver()) {
        (Some(this), Some(r)) => {
            let receiver = syn::Token![self](r.self_token.span);
            (
                quote! { rt::method_region::<Self>(#name) },
                quote! { let #this = #receiver; },
            )
        }
        _ => (quote! { #name }, quote! {}),
    };
    let Parameters {
        checks,
        names: inputs,
        args,
        pats,
        views,
    } = parameters(&block.params);
    let fields = fields(&analysis.fields);
    let mut body = TokenStream::new();
    for (stmt, sa) in block.statements.iter().zip(&analysis.statements) {
        body.extend(statement(stmt, sa, &block.params));
    }
    let result = tail(block, analysis);
    let imports = imports(block, analysis);
    let names = registered_names(analysis);
    let ret = &block.ret;
    // The block's error type is checked here, at its result.
    let errors = quote_spanned!(ret.span()=> rt::BlockError::errors());
    // So is its value, where the region runs: the call is spanned there.
    let run = quote_spanned! {ret.span()=>
        rt::BlockValue::run(
            rt::region::<#ret>(#region, #errors)#fields,
            #inputs,
            #args,
            move |#ctx, #pats| {
                #views
                #body
                #result
            },
        )
    };
    let body = braces(
        block,
        quote! {
            // Statements are `Ok(code)`, and their code ends in `?`.
            #![allow(clippy::needless_question_mark)]
            use ::remat_runtime::__private::{self as rt, #imports};
            #names
            #receiver
            #checks
            rt::Ok(#run?)
        },
    );
    // The function only lends its parameters to the region, which binds
    // its own: a `mut` parameter's `mut` is the block's, not the function's.
    let mut sig = sig.clone();
    for arg in &mut sig.inputs {
        if let syn::FnArg::Typed(t) = arg {
            if matches!(&*t.pat, syn::Pat::Ident(p) if p.mutability.is_some()) {
                t.attrs.push(syn::parse_quote!(#[allow(unused_mut)]));
            }
        }
    }
    quote! {
        #(#attrs)*
        #vis #sig #body
    }
}

/// `rt::names!("h", "o");`: the names a plan may use for the block's
/// statements, known to plans before the block first runs.
fn registered_names(analysis: &Analysis) -> TokenStream {
    let names: Vec<&str> = analysis
        .statements
        .iter()
        .filter(|s| !s.plain && !s.name.is_empty())
        .map(|s| s.name.as_str())
        .collect();
    if names.is_empty() {
        return quote!();
    }
    quote! { rt::names!(#(#names),*); }
}

/// The function's parameters as the region takes them: the `Readable`
/// checks of those it clones, and their handover.
struct Parameters {
    checks: TokenStream,
    /// Their names (`&["x", "p"]`), which errors about inputs give.
    names: TokenStream,
    args: TokenStream,
    pats: TokenStream,
    views: TokenStream,
}

/// The region keeps its own copy of every parameter (the body runs again
/// in the backward, after this call returned): checked `Clone` where it is
/// declared, handed over as a statement's reads are.
fn parameters(params: &[Param]) -> Parameters {
    let mut checks = TokenStream::new();
    let (mut args, mut pats, mut views) = (vec![], vec![], TokenStream::new());
    let mut names = Vec::new();
    for param in params {
        let ident = &param.ident;
        // A method's `self` is the macro's `self_`.
        names.push(match ident.to_string() {
            name if name == "self_" => "self".to_string(),
            name => name,
        });
        match &param.passing {
            Passing::Ref(ty) if !unsized_type(ty) && !tensor_type(ty) => {
                checks.extend(quote_spanned! {ty.span()=> let _: &dyn rt::Parameter = #ident; })
            }
            Passing::Value => checks.extend(quote_spanned! {ident.span()=>
                let _: &dyn rt::Parameter = &#ident;
            }),
            _ => {}
        }
        let h = handover(ident, Some(&param.passing), Taker::Region, 0, None);
        args.push(h.arg);
        pats.push(h.pat);
        views.extend(h.view);
    }
    Parameters {
        checks,
        names: quote!(&[#(#names),*]),
        args: tuple(args),
        pats: tuple(pats),
        views,
    }
}

/// The tensors of the parameters' fields the statements read in place,
/// handed to the region before it runs (`.fields((rt::read(&self.mask)
/// .field("self.mask", "s"),))`: none when a field holds no tensor), which
/// checks them for changes in place between the forward and the backward.
fn fields(fields: &[(FieldRead, String)]) -> TokenStream {
    if fields.is_empty() {
        return quote!();
    }
    let reads: Vec<TokenStream> = fields
        .iter()
        .map(|(f, statement)| {
            let (place, label) = (&f.place, &f.label);
            quote!(rt::read(&#place).field(#label, #statement))
        })
        .collect();
    let reads = tuple(reads);
    quote!(.fields(#reads))
}

/// One top-level statement of the block, by its kind: an item as it is;
/// plain code (`let` of a value that needs no tape) as it is; a
/// `#[forward_only]` statement skipped in the replay; any other statement
/// one call of the runtime.
fn statement(stmt: &Statement, sa: &StatementAnalysis, params: &[Param]) -> TokenStream {
    let keeps = sa
        .keeps
        .iter()
        .map(|(kept, name)| quote! { let #kept = &#name; });
    let keeps = quote!(#(#keeps)*);
    let code = statement_code(stmt, sa, params);
    quote!(#keeps #code)
}

fn statement_code(stmt: &Statement, sa: &StatementAnalysis, params: &[Param]) -> TokenStream {
    let ctx = own("ctx");
    let attrs = &stmt.attrs;
    let release = releases(&sa.releases);
    match (&stmt.kind, sa.kind) {
        (StmtKind::Item(item), _) => quote! { #item },
        (StmtKind::Let { .. }, _) if sa.inlined => release,
        (StmtKind::Let { pat, init }, _) if sa.plain => {
            // `let mut h = x.clone();`: changed by later statements,
            // each on its own copy.
            let allow_mut = crate::usage::binds_mut(pat).then(|| quote!(#[allow(unused_mut)]));
            quote! {
                #allow_mut
                #(#attrs)* let #pat = #init;
                #release
            }
        }
        (StmtKind::Let { pat, init }, Some(AnnotationKind::ForwardOnly)) => quote! {
            if !#ctx.is_replay() {
                #(#attrs)* let #pat = #init;
            }
            #release
        },
        (StmtKind::Expr(e), Some(AnnotationKind::ForwardOnly)) => quote! {
            if !#ctx.is_replay() {
                #(#attrs)* #e;
            }
            #release
        },
        (StmtKind::Let { pat, init }, _) => recorded_let(attrs, pat, init, sa, params),
        (StmtKind::Expr(e), _) => recorded_expr(attrs, e, sa, params),
    }
}

/// `let PAT = INIT;` as a statement of the tape: its value, and the `mut`
/// bindings it changes given back beside it and bound again.
fn recorded_let(
    attrs: &[syn::Attribute],
    pat: &syn::Pat,
    init: &syn::Expr,
    sa: &StatementAnalysis,
    params: &[Param],
) -> TokenStream {
    let value = own("value");
    let release = releases(&sa.releases);
    let inouts = &sa.inouts;
    let span = init.span();
    let gives: Vec<TokenStream> = inouts.iter().map(give).collect();
    let givens: Vec<TokenStream> = inouts.iter().map(given).collect();
    let code = if let (true, syn::Pat::Type(t)) = (inouts.is_empty(), pat) {
        // `let g: Tensor = h.dims2()?;`: the type checked at the code, as
        // rustc checks it without the macro.
        let ty = &t.ty;
        quote_spanned!(span=> rt::Ok::<#ty, _>(#init))
    } else if inouts.is_empty() {
        quote_spanned!(span=> rt::Ok(#init))
    } else {
        quote_spanned!(span=> rt::Ok((#init, #(#gives),*)))
    };
    let StatementCall { checks, call } = statement_call(span, sa, params, code);
    let saved = match sa.kind {
        Some(AnnotationKind::Save | AnnotationKind::Offload) => saved_check(pat, span),
        _ => quote!(),
    };
    // `let mut h = ...`: the binding is changed by later statements, each
    // on its own copy.
    let allow_mut = crate::usage::binds_mut(pat).then(|| quote!(#[allow(unused_mut)]));
    // A binding read for the last time and bound again by the pattern
    // (`let h = h.tanh()?;`) is dropped before the new one is bound.
    let rebound = crate::usage::bound(pat)
        .iter()
        .any(|(b, _)| sa.releases.contains(b));
    let bind = if inouts.is_empty() && !rebound {
        quote! {
            #allow_mut
            #(#attrs)* let #pat = #call;
            #release
        }
    } else if inouts.is_empty() {
        quote! {
            let #value = #call;
            #release
            #allow_mut
            #(#attrs)* let #pat = #value;
        }
    } else if let syn::Pat::Type(_) = pat {
        quote! {
            let #value = #call;
            #release
            let (#value, #(#givens),*) = #value;
            #allow_mut
            #(#attrs)* let #pat = #value;
        }
    } else {
        quote! {
            let #value = #call;
            #release
            #allow_mut
            #(#attrs)* let (#pat, #(#givens),*) = #value;
        }
    };
    let host = host_data(&sa.name, &sa.host_data);
    quote! { #host #checks #bind #saved }
}

/// An expression statement (`x.backward_hook()?;`, an assignment, a loop)
/// as a statement of the tape: the `mut` bindings it changes given back and
/// bound again.
fn recorded_expr(
    attrs: &[syn::Attribute],
    e: &syn::Expr,
    sa: &StatementAnalysis,
    params: &[Param],
) -> TokenStream {
    let value = own("value");
    let release = releases(&sa.releases);
    let inouts = &sa.inouts;
    let gives: Vec<TokenStream> = inouts.iter().map(give).collect();
    let givens: Vec<TokenStream> = inouts.iter().map(given).collect();
    let given = match inouts.len() {
        0 => quote! { rt::Ok(()) },
        1 => quote! { rt::Ok(#(#gives)*) },
        _ => quote! { rt::Ok((#(#gives),*)) },
    };
    let StatementCall { checks, call } =
        statement_call(e.span(), sa, params, quote! {{ #(#attrs)* #e; #given }});
    let host = host_data(&sa.name, &sa.host_data);
    let bind = match inouts.len() {
        0 => quote! { #call; #release },
        1 => quote! { let #value = #call; #release let #(#givens)* = #value; },
        _ => quote! { let #value = #call; #release let (#(#givens),*) = #value; },
    };
    quote! { #host #checks #bind }
}

/// What the region's body gives: the tail expression as the statement
/// `(return)`, or a binding it returns as it is.
fn tail(block: &Block, analysis: &Analysis) -> TokenStream {
    let Some(tail) = &block.tail else {
        return quote! { ::core::unreachable!() };
    };
    if let Some(ident) = &analysis.tail_passthrough {
        return quote! { rt::Ok(#ident) };
    }
    let ctx = own("ctx");
    let (name, declared) = ("(return)", quote!(rt::Open));
    let Reads {
        args,
        pats,
        views,
        checks,
        names,
    } = reads(&analysis.tail_reads, &[], &block.params);
    let closures = &analysis.tail_closures;
    let code = if views.is_empty() && closures.is_empty() {
        quote!(#tail)
    } else {
        quote!({ #views #(#closures)* #tail })
    };
    let host = host_data(name, &analysis.tail_host_data);
    let call = quote_spanned! {tail.span()=>
        rt::StatementValue::run(#ctx, #name, #names, #declared, #args, |#pats| #code)
    };
    quote! { #checks #host #call }
}

/// The dispatch and check traits the expansion calls methods of, imported
/// only where used (an unused import would warn in the user's crate).
fn imports(block: &Block, analysis: &Analysis) -> TokenStream {
    let reads = || {
        analysis
            .statements
            .iter()
            .flat_map(|s| &s.reads)
            .chain(&analysis.tail_reads)
    };
    let params = (!block.params.is_empty())
        .then(|| quote!(ParamClone as _, ParamFailed as _, ParamTensors as _,));
    let dispatch = reads()
        .next()
        .is_some()
        .then(|| quote!(ByClone as _, ByTensors as _, FromResult as _, NotClone as _,));
    let arg_methods = reads()
        .any(|r| !r.for_value || r.in_part || r.on_branch)
        .then(|| quote!(Arg as _,));
    let saves = analysis
        .statements
        .iter()
        .any(|s| matches!(s.kind, Some(AnnotationKind::Save | AnnotationKind::Offload)));
    let save_checks = saves.then(|| quote!(CheckPlain as _, CheckTensors as _,));
    quote! { #params #dispatch #arg_methods #save_checks }
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
