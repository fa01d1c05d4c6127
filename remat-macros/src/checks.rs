//! The refusals that read the parsed block, one pass in source order:
//! what the signature cannot be (async, `&mut`, borrowed trait objects, no
//! `Result`), and what the replay could not run faithfully, at the
//! statement it is written in (`return` in the middle, annotations below
//! the top level, on expressions and on the block's result, no result).
//! The refusals that need the dataflow (names, assignments, reads of
//! forward-only bindings) are the analysis's (`analyse`).

use syn::spanned::Spanned;
use syn::visit::Visit;
use syn::{Attribute, Expr, FnArg, Signature, Type};

use crate::attributes::expr_attrs;
use crate::errors::Errors;
use crate::model::{Annotation, AnnotationKind, Block, StmtKind};
use crate::parse::option_ref;

/// Every refusal of this file for `block`.
pub(crate) fn check(block: &Block, errors: &mut Errors) {
    signature(&block.func.sig, errors);
    for stmt in &block.statements {
        match &stmt.kind {
            StmtKind::Let { init, .. } => {
                check_nested(init, errors);
                check_return(init, errors, false);
            }
            StmtKind::Expr(expr) => check_statement_expr(expr, stmt.annotation.as_ref(), errors),
            StmtKind::Item(_) => {}
        }
    }
    match &block.tail {
        Some(tail) => {
            check_tail_annotation(block.tail_annotation.as_ref(), errors);
            check_nested(tail, errors);
            check_return(tail, errors, true);
        }
        None => errors.push(
            block.func.block.brace_token.span.close(),
            "a remat! block must end with a tail expression giving its result (`Ok(y)`); the \
             replay runs the block to its end",
        ),
    }
}

/// The function's signature: not async, no `&mut`, parameters the region
/// can copy, a `Result`.
fn signature(sig: &Signature, errors: &mut Errors) {
    if let Some(a) = &sig.asyncness {
        errors.push(
            a.span(),
            "a remat! function cannot be async: its replay runs inside candle's backward",
        );
    }
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
            FnArg::Receiver(_) => {}
            FnArg::Typed(t) => match &*t.ty {
                Type::Reference(r) if r.mutability.is_some() => errors.push_spanned(
                    r,
                    "a remat! block cannot take `&mut` parameters: it runs twice (forward and \
                     replay), so mutation would happen twice; pass what the block reads by `&` \
                     and change it outside the block from what the block returns (a KV cache: \
                     return the new keys and values and append them after the call). Do not \
                     clone it inside the block: the writes would land in the copy, silently",
                ),
                Type::Reference(r) => check_copyable(&r.elem, errors),
                ty => {
                    if let Some(elem) = option_ref(ty) {
                        check_copyable(&elem, errors);
                    }
                }
            },
        }
    }
    match &sig.output {
        syn::ReturnType::Type(_, ty) => check_result_type(ty, errors),
        syn::ReturnType::Default => errors.push(
            sig.ident.span(),
            "a remat! function must return a `Result` (for example `candle_core::Result<Tensor>`)",
        ),
    }
}

fn check_statement_expr(expr: &Expr, annotation: Option<&Annotation>, errors: &mut Errors) {
    if let Some(a) = annotation {
        if a.kind != AnnotationKind::ForwardOnly {
            errors.push_spanned(
                &a.tokens,
                format!(
                    "{} goes on a `let` statement: a statement's name and outputs come from its \
                     binding; write `{} let y = ...;`",
                    a.kind.attr(),
                    a.kind.attr()
                ),
            );
        }
    }
    check_nested(expr, errors);
    check_return(expr, errors, false);
}

/// Annotations anywhere below the top level.
fn check_nested(expr: &Expr, errors: &mut Errors) {
    struct Nested<'a> {
        errors: &'a mut Errors,
    }
    impl Nested<'_> {
        fn check(&mut self, attrs: &[Attribute]) {
            for attr in attrs {
                let Some(ident) = attr.path().get_ident() else {
                    continue;
                };
                if let Some(kind) = AnnotationKind::from_ident(&ident.to_string()) {
                    self.errors.push_spanned(
                        attr,
                        format!(
                            "{} is only allowed on top-level statements of a remat! block: a \
                             statement inside a loop, branch, closure or inner block can run zero \
                             or many times, so one name would not identify one record and the \
                             replay could not match it; move it to the top level, or make the \
                             inner code a region of its own",
                            kind.attr()
                        ),
                    );
                }
            }
        }
    }
    impl<'ast> Visit<'ast> for Nested<'_> {
        fn visit_local(&mut self, l: &'ast syn::Local) {
            self.check(&l.attrs);
            syn::visit::visit_local(self, l);
        }
        fn visit_stmt_macro(&mut self, m: &'ast syn::StmtMacro) {
            self.check(&m.attrs);
            syn::visit::visit_stmt_macro(self, m);
        }
        fn visit_expr(&mut self, e: &'ast Expr) {
            self.check(expr_attrs(e));
            syn::visit::visit_expr(self, e);
        }
    }
    // The statement's own attributes were taken off before; anything found
    // here is nested.
    Nested { errors }.visit_expr(expr);
}

/// `return` outside closures and async blocks.
fn check_return(expr: &Expr, errors: &mut Errors, in_tail: bool) {
    struct Returns<'a> {
        errors: &'a mut Errors,
        in_tail: bool,
    }
    impl<'ast> Visit<'ast> for Returns<'_> {
        fn visit_expr_return(&mut self, r: &'ast syn::ExprReturn) {
            // `return Err(..)` (and `bail!`) aborts the region on bad input:
            // there is nothing to replay, so it is safe.
            if returns_err(r) {
                return;
            }
            let msg = if self.in_tail {
                "`return` in a remat! block: give the result as the tail expression instead"
            } else {
                "`return` in the middle of a remat! block: the replay must run every statement \
                 the forward ran; compute the result in the tail expression"
            };
            self.errors.push_spanned(r, msg);
        }
        fn visit_expr_closure(&mut self, _: &'ast syn::ExprClosure) {}
        fn visit_expr_async(&mut self, _: &'ast syn::ExprAsync) {}
        fn visit_item(&mut self, _: &'ast syn::Item) {}
    }
    Returns { errors, in_tail }.visit_expr(expr);
}

/// `return Err(..)`.
fn returns_err(r: &syn::ExprReturn) -> bool {
    let Some(value) = &r.expr else { return false };
    let Expr::Call(call) = &**value else {
        return false;
    };
    matches!(&*call.func, Expr::Path(p) if p.path.segments.last().is_some_and(|s| s.ident == "Err"))
}

/// An annotation on the block's result (its tail expression).
fn check_tail_annotation(annotation: Option<&Annotation>, errors: &mut Errors) {
    if let Some(a) = annotation {
        let attr = a.kind.attr();
        errors.push_spanned(
            &a.tokens,
            format!(
                "{attr} on the block's result: the result is not a statement of its own; bind \
                 it first, `{attr} let y = ...;`, and end the block with `Ok(y)`"
            ),
        );
    }
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
