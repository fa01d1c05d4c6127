//! Fields of the block's parameters that a statement reads in place
//! (`&self.mask`, `p.cos.narrow(..)`, `self.tables[i]`): tensors held there
//! are neither block inputs nor parameters, so the region is handed them
//! (`rt::read(&self.mask).field("self.mask", "s")`, empty when the field
//! holds no tensor) and checks them for a change in place between the
//! forward and the backward.
//!
//! A field is taken where it is borrowed, indexed, or the receiver of a
//! method other than a module's `forward` (`self.proj.forward(&h)` reads
//! the module's parameters, which are checked as parameters). A field read
//! by value is `Copy` (a number, a flag): it holds no tensor.

use syn::visit::Visit;
use syn::{Expr, ExprField, Ident};

/// A field of a parameter, read in place: the place (`self_.rope.cos`) and
/// how the user wrote it (`self.rope.cos`).
#[derive(Debug, Clone)]
pub(crate) struct FieldRead {
    pub place: ExprField,
    pub label: String,
}

/// Methods of a module called on a field: the module's tensors are
/// parameters.
const MODULE_CALLS: &[&str] = &["forward", "forward_t"];

/// The fields `expr` reads in place whose root is a name `is_param` accepts,
/// each once, in order. `receiver`: the binding a method's `self` became.
pub(crate) fn field_reads(
    expr: &Expr,
    is_param: impl Fn(&Ident) -> bool,
    receiver: Option<&Ident>,
) -> Vec<FieldRead> {
    struct Collect<'a> {
        is_param: &'a dyn Fn(&Ident) -> bool,
        receiver: Option<&'a Ident>,
        out: Vec<FieldRead>,
    }
    impl Collect<'_> {
        /// Takes `e` if it is a field of a parameter; whether it was one.
        fn take(&mut self, e: &Expr) -> bool {
            let Expr::Field(f) = e else { return false };
            let Some((root, members)) = chain(f) else {
                return false;
            };
            if !(self.is_param)(root) {
                return false;
            }
            let root = match self.receiver {
                Some(r) if r == root => "self".to_string(),
                _ => root.to_string(),
            };
            let label = std::iter::once(root)
                .chain(members)
                .collect::<Vec<_>>()
                .join(".");
            if !self.out.iter().any(|r| r.label == label) {
                self.out.push(FieldRead {
                    place: f.clone(),
                    label,
                });
            }
            true
        }
    }
    impl<'ast> Visit<'ast> for Collect<'_> {
        fn visit_expr_reference(&mut self, r: &'ast syn::ExprReference) {
            if !self.take(&r.expr) {
                syn::visit::visit_expr_reference(self, r);
            }
        }
        fn visit_expr_index(&mut self, i: &'ast syn::ExprIndex) {
            if !self.take(&i.expr) {
                self.visit_expr(&i.expr);
            }
            self.visit_expr(&i.index);
        }
        fn visit_expr_method_call(&mut self, m: &'ast syn::ExprMethodCall) {
            let module = MODULE_CALLS.contains(&m.method.to_string().as_str());
            if module || !self.take(&m.receiver) {
                self.visit_expr(&m.receiver);
            }
            for arg in &m.args {
                self.visit_expr(arg);
            }
        }
        fn visit_item(&mut self, _: &'ast syn::Item) {}
    }
    let mut c = Collect {
        is_param: &is_param,
        receiver,
        out: Vec::new(),
    };
    c.visit_expr(expr);
    c.out
}

/// `root.a.b`: the root name and the members, if `f` is a chain of fields
/// of a name.
fn chain(f: &ExprField) -> Option<(&Ident, Vec<String>)> {
    let member = match &f.member {
        syn::Member::Named(n) => n.to_string(),
        syn::Member::Unnamed(i) => i.index.to_string(),
    };
    let (root, mut members) = match &*f.base {
        Expr::Path(p) if p.qself.is_none() && p.path.segments.len() == 1 => {
            (&p.path.segments[0].ident, Vec::new())
        }
        Expr::Field(inner) => chain(inner)?,
        Expr::Paren(p) => match &*p.expr {
            Expr::Field(inner) => chain(inner)?,
            _ => return None,
        },
        _ => return None,
    };
    members.push(member);
    Some((root, members))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(src: &str) -> Vec<String> {
        let expr: Expr = syn::parse_str(src).unwrap();
        let this: Ident = syn::parse_str("self_").unwrap();
        field_reads(&expr, |i| i == "self_" || i == "p", Some(&this))
            .into_iter()
            .map(|f| f.label)
            .collect()
    }

    #[test]
    fn fields_borrowed_indexed_or_called_on_are_read_in_place() {
        assert_eq!(
            labels("x.broadcast_add(&self_.mask)?.matmul(&p.w.t()?)"),
            ["self.mask", "p.w"]
        );
        assert_eq!(
            labels("self_.cos.narrow(0, 0, t)?.mul(&self_.rope.sin)"),
            ["self.cos", "self.rope.sin"]
        );
        assert_eq!(
            labels("match &self_.bias { Some(b) => x.broadcast_add(b), None => Ok(x.clone()) }"),
            ["self.bias"]
        );
        assert_eq!(labels("(&xs[0] + &self_.tables[i])"), ["self.tables"]);
        assert_eq!(labels("pair.0.add(&self_.0)"), ["self.0"]);
    }

    #[test]
    fn modules_numbers_and_other_roots_are_not() {
        // A module's `forward`: its tensors are parameters; but what is
        // passed to it is still read.
        assert_eq!(
            labels("self_.proj.forward(&self_.mask)?.forward_t(&h, true)"),
            ["self.mask"]
        );
        // By value: `Copy`, no tensor.
        assert!(labels("x.reshape((b, t, self_.heads, self_.cfg.dim))").is_empty());
        assert!(labels("(x * p.scale)?").is_empty());
        // Not a parameter, a method call's result, a closure's own.
        assert!(labels("(&h.w + &self_.layer().w)").is_empty());
        // Repeated: once.
        assert_eq!(labels("(&self_.m + &self_.m)?.mul(&self_.m)"), ["self.m"]);
    }
}
