//! What the replay cannot run faithfully, refused at the statement it is
//! written in: `return` in the middle, annotations below the top level,
//! annotations on expressions and on the block's result.

use syn::visit::Visit;
use syn::{Attribute, Expr};

use crate::attributes::expr_attrs;
use crate::errors::Errors;
use crate::model::{Annotation, AnnotationKind};

pub(crate) fn check_statement_expr(
    expr: &Expr,
    annotation: Option<&Annotation>,
    errors: &mut Errors,
) {
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
pub(crate) fn check_nested(expr: &Expr, errors: &mut Errors) {
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
pub(crate) fn check_return(expr: &Expr, errors: &mut Errors, in_tail: bool) {
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
pub(crate) fn check_tail_annotation(annotation: Option<&Annotation>, errors: &mut Errors) {
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
