//! Plain code: the unannotated `let`s that run as they are in the forward
//! and in the replay, outside any statement (no record, no name).

use syn::Expr;

use crate::model::{Block, Statement, StmtKind};

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
/// tensor's device, dtype or shape (`let device = xs.device();`), a value
/// built of others without computing anything ([`built`]). A
/// reference (`let residual = xs;`, `let r = &h;`) is plain code too, found
/// by the analysis (`analyse`'s aliases). Annotated statements never are.
pub(crate) fn plain(stmt: &Statement, built: bool) -> bool {
    let StmtKind::Let { pat, init } = &stmt.kind else {
        return false;
    };
    if stmt.annotation.is_some() {
        return false;
    }
    let guard = crate::usage::single(pat).is_some_and(|i| i.to_string().starts_with('_'));
    let closure = matches!(init, Expr::Closure(_)) || built;
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

/// Per statement of `block`: a `let` of a [`built`] value to a binding that
/// is not `mut` (one that statements change is a statement's value, given
/// back). Names bound by earlier such `let`s may be parts of later ones
/// (`..o`): each is defined again where it is read, never moved.
pub(crate) fn built_lets(block: &Block) -> Vec<bool> {
    let mut names: Vec<String> = Vec::new();
    block
        .statements
        .iter()
        .map(|stmt| {
            let StmtKind::Let { pat, init } = &stmt.kind else {
                return false;
            };
            let name = match pat {
                syn::Pat::Ident(p)
                    if p.mutability.is_none() && p.by_ref.is_none() && p.subpat.is_none() =>
                {
                    &p.ident
                }
                syn::Pat::Type(t) => match &*t.pat {
                    syn::Pat::Ident(p)
                        if p.mutability.is_none() && p.by_ref.is_none() && p.subpat.is_none() =>
                    {
                        &p.ident
                    }
                    _ => return false,
                },
                _ => return false,
            };
            let built = stmt.annotation.is_none() && built(init, &names);
            if built {
                names.push(name.to_string());
            }
            built
        })
        .collect()
}

/// A struct literal built of others without computing anything (or a
/// type's default, `LinearCrossEntropy::default()`): its fields (and its
/// base, `..Default::default()`) are literals, constants (`EPS`, `None`),
/// references to places (`&h`, `&self.norm.weight`), names of earlier
/// built values (`built`), tuple structs or enum variants of them
/// (`Some(&b)`), tuples, arrays and struct literals of them, as the
/// options of an op are (`LinearCrossEntropy { bias: Some(&p.b),
/// ..Default::default() }`). Like a closure, it is defined again in each
/// statement that reads it, over that statement's copies of what it
/// borrows; it moves no binding of the block (a field `h` moving a tensor
/// would be moved again by each statement defining it).
fn built(e: &Expr, built: &[String]) -> bool {
    match e {
        Expr::Struct(s) => {
            s.qself.is_none()
                && s.fields.iter().all(|f| part(&f.expr, built))
                && s.rest.as_deref().is_none_or(|r| part(r, built))
        }
        Expr::Call(c) => {
            c.args.is_empty()
                && matches!(&*c.func, Expr::Path(f) if f.qself.is_none()
                    && f.path.segments.len() > 1
                    && f.path.segments.last().is_some_and(|s| s.ident == "default"))
        }
        _ => false,
    }
}

/// A part of a [`built`] value.
fn part(e: &Expr, built: &[String]) -> bool {
    match e {
        Expr::Lit(_) => true,
        // A constant or unit variant (`EPS`, `None`, `DType::F32`), or a
        // built value; not a binding that would be moved.
        Expr::Path(p) => {
            p.qself.is_none()
                && match p.path.get_ident() {
                    Some(i) => {
                        let name = i.to_string();
                        name.starts_with(|c: char| c.is_ascii_uppercase()) || built.contains(&name)
                    }
                    None => true,
                }
        }
        Expr::Reference(r) => place(&r.expr),
        Expr::Field(_) => false,
        Expr::Paren(p) => part(&p.expr, built),
        Expr::Unary(u) => matches!(u.op, syn::UnOp::Neg(_)) && matches!(*u.expr, Expr::Lit(_)),
        Expr::Tuple(t) => t.elems.iter().all(|e| part(e, built)),
        Expr::Array(a) => a.elems.iter().all(|e| part(e, built)),
        Expr::Struct(_) => self::built(e, built),
        // `Some(&b)`, `Pair(&a, &b)`, `Default::default()`.
        Expr::Call(c) => {
            let Expr::Path(f) = &*c.func else {
                return false;
            };
            let last = f.path.segments.last().map(|s| s.ident.to_string());
            let variant = last
                .as_deref()
                .is_some_and(|l| l.starts_with(|ch: char| ch.is_ascii_uppercase()));
            let default = c.args.is_empty() && last.as_deref() == Some("default");
            (variant || default) && c.args.iter().all(|e| part(e, built))
        }
        _ => false,
    }
}
