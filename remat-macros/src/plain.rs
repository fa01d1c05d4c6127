//! Plain code: the unannotated `let`s that run as they are in the forward
//! and in the replay, outside any statement (no record, no name).

use syn::Expr;

use crate::model::{Statement, StmtKind};

/// Methods whose value, bound by a `let` to a binding or a field
/// (`x.device()`), is plain code: a copy, or what a tensor tells of itself
/// (often a reference into it, which no statement could give).
const PLAIN_METHODS: &[&str] = &[
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
/// by the analysis (`analyse`'s aliases). Annotated statements never are.
pub(crate) fn plain(stmt: &Statement) -> bool {
    let StmtKind::Let { pat, init } = &stmt.kind else {
        return false;
    };
    if stmt.annotation.is_some() {
        return false;
    }
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

/// Plain code whose value is `Clone` by construction: a copy (`let x =
/// y.clone();`) or what a tensor tells of itself (`let dev = x.device();`).
pub(crate) fn copies(kind: &StmtKind) -> bool {
    matches!(kind, StmtKind::Let { init: Expr::MethodCall(m), .. }
        if PLAIN_METHODS.iter().any(|p| m.method == p))
}
