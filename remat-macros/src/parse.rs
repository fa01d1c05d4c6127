//! From tokens to the model of a `remat!` block, collecting syntax errors.

use proc_macro2::Span;
use proc_macro2::TokenStream;
use syn::parse::{Parse, ParseStream};
use syn::spanned::Spanned;
use syn::{Expr, FnArg, ItemFn, Pat, Stmt, Type};

use crate::attributes::{annotations, expr_attrs, strip_attrs};
use crate::checks::{check_nested, check_return, check_statement_expr, check_tail_annotation};
use crate::errors::Errors;
use crate::model::{Block, Param, Passing, Statement, StmtKind};

struct Items(Vec<ItemFn>);

impl Parse for Items {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let mut items = Vec::new();
        while !input.is_empty() {
            items.push(input.parse()?);
        }
        Ok(Items(items))
    }
}

pub(crate) fn parse(input: TokenStream, errors: &mut Errors) -> syn::Result<Vec<Block>> {
    let Items(items) = syn::parse2(input)?;
    if items.is_empty() {
        return Err(syn::Error::new(
            Span::call_site(),
            "remat! expects one or more functions: `remat! { fn block(x: &Tensor) -> Result<Tensor> { ... } }`",
        ));
    }
    Ok(items.into_iter().map(|f| parse_fn(f, errors)).collect())
}

fn parse_fn(mut func: ItemFn, errors: &mut Errors) -> Block {
    let before = errors.len();
    let mut receiver = None;
    if func.sig.receiver().is_some() {
        crate::receiver::rename_self(&mut func.block);
    }
    let sig = &func.sig;
    if let Some(a) = &sig.asyncness {
        errors.push(
            a.span(),
            "a remat! function cannot be async: its replay runs inside candle's backward",
        );
    }
    let mut params = Vec::new();
    for arg in &sig.inputs {
        match arg {
            FnArg::Receiver(r) if r.reference.is_some() && r.mutability.is_some() => errors
                .push_spanned(
                    r,
                    "a remat! method takes `&self`, not `&mut self`: the block runs twice (the \
                     forward, and its replay in the backward), so a change to `self` would happen \
                     twice. State that must change once per step (running statistics, a counter, \
                     a cache) goes in a shared field (`Arc<Mutex<..>>`, an atomic in an `Arc`) \
                     changed by a `#[forward_only]` statement, which the replay skips",
                ),
            FnArg::Receiver(r) => {
                let span = r.self_token.span;
                let this = crate::receiver::this(span);
                let passing = match &r.reference {
                    Some(_) => Passing::Ref(syn::parse_quote_spanned!(span=> Self)),
                    None => Passing::Value,
                };
                params.push(Param {
                    ident: this.clone(),
                    mutable: r.mutability.is_some(),
                    passing,
                });
                receiver = Some(this);
            }
            FnArg::Typed(t) => {
                let (ident, mutable) = match &*t.pat {
                    Pat::Ident(p) if p.by_ref.is_none() && p.subpat.is_none() => {
                        (p.ident.clone(), p.mutability.is_some())
                    }
                    other => {
                        errors.push(
                            other.span(),
                            "remat! parameters must be plain names (`x: &Tensor`); destructure \
                             inside the block",
                        );
                        continue;
                    }
                };
                let passing = match &*t.ty {
                    Type::Reference(r) if r.mutability.is_some() => {
                        errors.push_spanned(
                            r,
                            "a remat! block cannot take `&mut` parameters: it runs twice (forward \
                             and replay), so mutation would happen twice; pass what the block \
                             reads by `&` and change it outside the block from what the block \
                             returns (a KV cache: return the new keys and values and append them \
                             after the call). Do not clone it inside the block: the writes would \
                             land in the copy, silently",
                        );
                        Passing::Value
                    }
                    Type::Reference(r) => Passing::Ref((*r.elem).clone()),
                    ty => match option_ref(ty) {
                        Some(elem) => Passing::OptionRef(elem),
                        None => Passing::Value,
                    },
                };
                if let Passing::Ref(ty) | Passing::OptionRef(ty) = &passing {
                    check_copyable(ty, errors);
                }
                params.push(Param {
                    ident,
                    mutable,
                    passing,
                });
            }
        }
    }
    let ret = match &sig.output {
        syn::ReturnType::Type(_, ty) => {
            check_result_type(ty, errors);
            (**ty).clone()
        }
        syn::ReturnType::Default => {
            errors.push(
                sig.ident.span(),
                "a remat! function must return a `Result` (for example `candle_core::Result<Tensor>`)",
            );
            syn::parse_quote!(())
        }
    };
    let mut statements = Vec::new();
    let mut tail = None;
    let n = func.block.stmts.len();
    for (i, stmt) in func.block.stmts.iter().enumerate() {
        let last = i + 1 == n;
        match stmt {
            Stmt::Expr(e, None) if last => {
                let (annotation, _) = annotations(expr_attrs(e), errors);
                check_tail_annotation(annotation.as_ref(), errors);
                let mut e = e.clone();
                strip_attrs(&mut e);
                let e = &e;
                check_nested(e, errors);
                check_return(e, errors, true);
                tail = Some(e.clone());
            }
            other => {
                if let Some(s) = parse_statement(other, errors) {
                    statements.push(s);
                }
            }
        }
    }
    if tail.is_none() {
        errors.push(
            func.block.brace_token.span.close(),
            "a remat! block must end with a tail expression giving its result (`Ok(y)`); the \
             replay runs the block to its end",
        );
    }
    Block {
        failed: errors.len() > before,
        receiver,
        func,
        params,
        statements,
        tail,
        ret,
    }
}

fn parse_statement(stmt: &Stmt, errors: &mut Errors) -> Option<Statement> {
    match stmt {
        Stmt::Local(local) => {
            let (annotation, attrs) = annotations(&local.attrs, errors);
            let Some(init) = &local.init else {
                errors.push(
                    local.span(),
                    "a `let` in a remat! block needs a value: each `let` is a statement that \
                     computes its bindings",
                );
                return None;
            };
            if let Some((else_token, _)) = &init.diverge {
                errors.push(
                    else_token.span(),
                    "`let ... else` is not supported in a remat! block: the replay must run every \
                     statement; match inside the statement instead",
                );
                return None;
            }
            check_nested(&init.expr, errors);
            check_return(&init.expr, errors, false);
            let plain = annotation.is_none() && plain(&local.pat, &init.expr);
            Some(Statement {
                kind: StmtKind::Let {
                    pat: local.pat.clone(),
                    init: (*init.expr).clone(),
                },
                annotation,
                plain,
                attrs,
            })
        }
        Stmt::Expr(expr, _) => {
            let (annotation, attrs) = annotations(expr_attrs(expr), errors);
            let mut expr = expr.clone();
            strip_attrs(&mut expr);
            check_statement_expr(&expr, annotation.as_ref(), errors);
            Some(Statement {
                kind: StmtKind::Expr(expr),
                annotation,
                plain: false,
                attrs,
            })
        }
        Stmt::Macro(m) => {
            let (annotation, attrs) = annotations(&m.attrs, errors);
            let expr = Expr::Macro(syn::ExprMacro {
                attrs: Vec::new(),
                mac: m.mac.clone(),
            });
            check_statement_expr(&expr, annotation.as_ref(), errors);
            Some(Statement {
                kind: StmtKind::Expr(expr),
                annotation,
                plain: false,
                attrs,
            })
        }
        Stmt::Item(item) => Some(Statement {
            kind: StmtKind::Item(item.clone()),
            annotation: None,
            plain: false,
            attrs: Vec::new(),
        }),
    }
}

/// Methods whose value, bound by a `let` to a binding or a field
/// (`x.device()`), is plain code: a copy, or what a tensor tells of itself
/// (often a reference into it, which no statement could give).
pub(crate) const PLAIN_METHODS: &[&str] = &[
    "clone", "device", "dtype", "shape", "dims", "layout", "stride",
];

/// An unannotated `let` that runs as plain code in the forward and the
/// replay rather than as a statement: one binding a closure (a helper
/// called by later statements), a guard bound to a name starting with `_`
/// (`let _enter = self.span.enter();`, kept to the block's end), a copy
/// (`let mut layer = self.layer.clone();`, `let residual = xs.clone();`:
/// nothing to checkpoint, and the value may be any `Clone` type), or a
/// tensor's device, dtype or shape (`let device = xs.device();`). A
/// reference (`let residual = xs;`, `let r = &h;`) is plain code too, found
/// by the analysis.
fn plain(pat: &Pat, init: &Expr) -> bool {
    let guard = crate::usage::single(pat).is_some_and(|i| i.to_string().starts_with('_'));
    let closure = matches!(init, Expr::Closure(_));
    let copy = match init {
        Expr::MethodCall(m) => {
            PLAIN_METHODS.iter().any(|p| m.method == p) && m.args.is_empty() && place(&m.receiver)
        }
        _ => false,
    };
    guard || closure || copy
}

/// `&dyn Trait` and `&impl Trait` parameters: the region cannot keep its
/// own copy of a value whose type it does not know.
fn check_copyable(ty: &Type, errors: &mut Errors) {
    let what = match ty {
        Type::TraitObject(_) => "`dyn` trait object",
        Type::ImplTrait(_) => "`impl Trait` value",
        Type::Paren(p) => return check_copyable(&p.elem, errors),
        _ => return,
    };
    errors.push_spanned(
        ty,
        format!(
            "a remat! block keeps its own copy of every parameter, to run the block again in the \
             backward after this call returned; a borrowed {what} cannot be copied. Take the \
             layer's own type (`&Linear`, `&Mlp`: a `Clone` type), or a generic `&M` with \
             `M: Module + Clone`, or an `Arc<dyn Module + Send + Sync>` by value"
        ),
    );
}

/// A binding or a field of one (`x`, `self.layer`, `p.w1`, `(*x)`).
fn place(e: &Expr) -> bool {
    match e {
        Expr::Path(p) => p.qself.is_none() && p.path.get_ident().is_some(),
        Expr::Field(f) => place(&f.base),
        Expr::Paren(p) => place(&p.expr),
        Expr::Unary(u) if matches!(u.op, syn::UnOp::Deref(_)) => place(&u.expr),
        _ => false,
    }
}

/// `T` of `Option<&T>` (any path ending in `Option`), lifetime elided.
fn option_ref(ty: &Type) -> Option<Type> {
    let Type::Path(p) = ty else { return None };
    let last = p.path.segments.last()?;
    if last.ident != "Option" {
        return None;
    }
    let syn::PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    match args.args.first()? {
        syn::GenericArgument::Type(Type::Reference(r)) if r.mutability.is_none() => {
            Some((*r.elem).clone())
        }
        _ => None,
    }
}

/// The return type is a `Result` (a path whose last segment ends in
/// `Result`: `Result<T>`, `candle_core::Result<T>`, an alias like
/// `CandleResult<T>`).
fn check_result_type(ty: &Type, errors: &mut Errors) {
    let is_result = match ty {
        Type::Path(p) => p
            .path
            .segments
            .last()
            .is_some_and(|s| s.ident.to_string().ends_with("Result")),
        // `&T` is refused with its own message, by the tail's type check.
        Type::Reference(_) => true,
        _ => false,
    };
    if !is_result {
        errors.push_spanned(
            ty,
            format!(
                "a remat! function must return a `Result`: its statements use `?`, and its \
                 replay in the backward can fail; write `-> Result<{}>` (candle_core::Result)",
                quote::ToTokens::to_token_stream(ty)
            ),
        );
    }
}
