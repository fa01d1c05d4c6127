//! What a statement's code does with the names it mentions, read from its
//! syntax: which identifiers it mentions, which it moves, which it assigns,
//! and which a pattern binds.
//!
//! The macro has no types, so "moves" is syntactic: an identifier in a
//! by-value position (an operand of arithmetic, an argument, a tuple or
//! struct field, a `let` value, `?`, a `for` loop's iterable). A `Copy`
//! value in such a position is copied, not moved, and moving it is harmless;
//! a method receiver (`h.exp()`) is never counted, so a method that takes
//! `self` is a move the macro does not see.

use proc_macro2::{Span, TokenStream, TokenTree};
use quote::ToTokens;
use syn::punctuated::Punctuated;
use syn::visit::Visit;
use syn::{Expr, Ident, Pat};

/// Identifiers an expression mentions, in order, with the span of their first
/// use: paths of one segment, identifiers inside macro invocations, and
/// inline arguments of format strings (`"{x}"`).
pub(crate) fn mentions(expr: &Expr) -> Vec<(String, Span)> {
    struct Collect(Vec<(String, Span)>);
    impl Collect {
        fn add(&mut self, name: String, span: Span) {
            if !self
                .0
                .iter()
                .any(|(n, s)| *n == name && crate::hygiene::same(*s, span))
            {
                self.0.push((name, span));
            }
        }
        fn tokens(&mut self, ts: TokenStream) {
            for tt in ts {
                match tt {
                    TokenTree::Ident(i) => self.add(i.to_string(), i.span()),
                    TokenTree::Group(g) => self.tokens(g.stream()),
                    TokenTree::Literal(l) => {
                        if let Ok(s) = syn::parse2::<syn::LitStr>(l.to_token_stream()) {
                            for name in format_args(&s.value()) {
                                self.add(name, l.span());
                            }
                        }
                    }
                    TokenTree::Punct(_) => {}
                }
            }
        }
    }
    impl<'ast> Visit<'ast> for Collect {
        fn visit_expr_path(&mut self, p: &'ast syn::ExprPath) {
            if p.qself.is_none() && p.path.segments.len() == 1 {
                let seg = &p.path.segments[0];
                self.add(seg.ident.to_string(), seg.ident.span());
            }
            syn::visit::visit_expr_path(self, p);
        }
        fn visit_macro(&mut self, m: &'ast syn::Macro) {
            self.tokens(m.tokens.clone());
        }
    }
    let mut c = Collect(Vec::new());
    c.visit_expr(expr);
    c.0
}

/// Inline arguments of a format string: `{x}`, `{x:?}`, `{x:>8}`.
pub(crate) fn format_args(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = s;
    while let Some(open) = rest.find('{') {
        rest = &rest[open + 1..];
        if rest.starts_with('{') {
            rest = &rest[1..];
            continue;
        }
        let end = rest.find(['}', ':']).unwrap_or(rest.len());
        let name = &rest[..end];
        if !name.is_empty()
            && name.chars().all(|c| c.is_alphanumeric() || c == '_')
            && !name.chars().next().is_some_and(|c| c.is_ascii_digit())
        {
            out.push(name.to_string());
        }
    }
    out
}

/// The identifiers a pattern binds, and whether each is `mut`.
pub(crate) fn bound(pat: &Pat) -> Vec<(Ident, bool)> {
    struct Collect(Vec<(Ident, bool)>);
    impl<'ast> Visit<'ast> for Collect {
        fn visit_pat_ident(&mut self, p: &'ast syn::PatIdent) {
            self.0.push((p.ident.clone(), p.mutability.is_some()));
            syn::visit::visit_pat_ident(self, p);
        }
    }
    let mut c = Collect(Vec::new());
    c.visit_pat(pat);
    c.0
}

/// The single identifier a pattern binds (`x`, `mut x`, `x: T`), if it is one.
pub(crate) fn single(pat: &Pat) -> Option<&Ident> {
    match pat {
        Pat::Ident(p) if p.subpat.is_none() => Some(&p.ident),
        Pat::Type(t) => single(&t.pat),
        _ => None,
    }
}

/// Identifiers (paths of one segment) in by-value positions of `expr`, with
/// the span of their first such use.
pub(crate) fn moved(expr: &Expr) -> Vec<(String, Span)> {
    let mut m = Moves {
        by_value: false,
        out: Vec::new(),
    };
    m.visit_expr(expr);
    m.out
}

struct Moves {
    /// Whether the expression being visited is in a by-value position.
    by_value: bool,
    out: Vec<(String, Span)>,
}

impl Moves {
    fn visit(&mut self, e: &Expr, by_value: bool) {
        let outer = std::mem::replace(&mut self.by_value, by_value);
        self.visit_expr(e);
        self.by_value = outer;
    }
}

impl<'ast> Visit<'ast> for Moves {
    fn visit_expr(&mut self, e: &'ast Expr) {
        use syn::{BinOp, UnOp};
        let v = self.by_value;
        match e {
            Expr::Path(p) if p.qself.is_none() && p.path.segments.len() == 1 => {
                let ident = &p.path.segments[0].ident;
                let name = ident.to_string();
                if v && !self
                    .out
                    .iter()
                    .any(|(n, s)| *n == name && crate::hygiene::same(*s, ident.span()))
                {
                    self.out.push((name, ident.span()));
                }
            }
            Expr::Binary(b) => {
                let operands = matches!(
                    b.op,
                    BinOp::Add(_)
                        | BinOp::Sub(_)
                        | BinOp::Mul(_)
                        | BinOp::Div(_)
                        | BinOp::Rem(_)
                        | BinOp::BitXor(_)
                        | BinOp::BitAnd(_)
                        | BinOp::BitOr(_)
                        | BinOp::Shl(_)
                        | BinOp::Shr(_)
                );
                let assigning = crate::usage::is_compound_assign(&b.op);
                self.visit(&b.left, operands);
                self.visit(&b.right, operands || assigning);
            }
            Expr::Unary(u) => self.visit(&u.expr, !matches!(u.op, UnOp::Deref(_))),
            Expr::Reference(r) => self.visit(&r.expr, false),
            Expr::MethodCall(m) => {
                self.visit(&m.receiver, false);
                m.args.iter().for_each(|a| self.visit(a, true));
            }
            Expr::Call(c) => {
                self.visit(&c.func, false);
                c.args.iter().for_each(|a| self.visit(a, true));
            }
            Expr::Tuple(t) => t.elems.iter().for_each(|a| self.visit(a, true)),
            Expr::Array(a) => a.elems.iter().for_each(|a| self.visit(a, true)),
            Expr::Struct(s) => {
                s.fields.iter().for_each(|f| self.visit(&f.expr, true));
                if let Some(rest) = &s.rest {
                    self.visit(rest, true);
                }
            }
            Expr::Paren(p) => self.visit(&p.expr, v),
            Expr::Group(g) => self.visit(&g.expr, v),
            Expr::Try(t) => self.visit(&t.expr, true),
            Expr::Cast(c) => self.visit(&c.expr, true),
            Expr::Assign(a) => {
                self.visit(&a.left, false);
                self.visit(&a.right, true);
            }
            Expr::ForLoop(f) => {
                self.visit(&f.expr, true);
                self.visit_block(&f.body);
            }
            Expr::Return(r) => {
                if let Some(e) = &r.expr {
                    self.visit(e, true);
                }
            }
            Expr::Break(b) => {
                if let Some(e) = &b.expr {
                    self.visit(e, true);
                }
            }
            Expr::Block(b) => self.visit_block_value(&b.block, v),
            Expr::Unsafe(b) => self.visit_block_value(&b.block, v),
            Expr::If(i) => {
                self.visit(&i.cond, false);
                self.visit_block_value(&i.then_branch, v);
                if let Some((_, e)) = &i.else_branch {
                    self.visit(e, v);
                }
            }
            Expr::Match(m) => {
                self.visit(&m.expr, false);
                for arm in &m.arms {
                    if let Some((_, g)) = &arm.guard {
                        self.visit(g, false);
                    }
                    self.visit(&arm.body, v);
                }
            }
            Expr::Macro(_) => {}
            other => {
                let outer = std::mem::replace(&mut self.by_value, false);
                syn::visit::visit_expr(self, other);
                self.by_value = outer;
            }
        }
    }

    fn visit_local(&mut self, l: &'ast syn::Local) {
        if let Some(init) = &l.init {
            self.visit(&init.expr, true);
            if let Some((_, e)) = &init.diverge {
                self.visit(e, false);
            }
        }
    }

    fn visit_stmt(&mut self, s: &'ast syn::Stmt) {
        match s {
            syn::Stmt::Expr(e, _) => self.visit(e, false),
            other => syn::visit::visit_stmt(self, other),
        }
    }
}

impl Moves {
    /// A block whose value is used `by_value` (its tail expression).
    fn visit_block_value(&mut self, b: &syn::Block, by_value: bool) {
        let n = b.stmts.len();
        for (i, s) in b.stmts.iter().enumerate() {
            match s {
                syn::Stmt::Expr(e, None) if i + 1 == n => self.visit(e, by_value),
                other => self.visit_stmt(other),
            }
        }
    }
}

/// Identifiers assigned in `expr` (`x = ...`, `x += ...`, `x.f = ...`,
/// `x[i] = ...`: the root of the place), with the span of the assignment's
/// left side.
pub(crate) fn assigned(expr: &Expr) -> Vec<(String, Span)> {
    struct Collect(Vec<(String, Span)>);
    fn root(e: &Expr) -> Option<&Ident> {
        match e {
            Expr::Path(p) if p.qself.is_none() => p.path.get_ident(),
            Expr::Field(f) => root(&f.base),
            Expr::Index(i) => root(&i.expr),
            Expr::Paren(p) => root(&p.expr),
            _ => None,
        }
    }
    impl<'ast> Visit<'ast> for Collect {
        fn visit_expr_assign(&mut self, a: &'ast syn::ExprAssign) {
            if let Some(i) = root(&a.left) {
                self.0.push((i.to_string(), i.span()));
            }
            syn::visit::visit_expr_assign(self, a);
        }
        fn visit_expr_binary(&mut self, b: &'ast syn::ExprBinary) {
            if is_compound_assign(&b.op) {
                if let Some(i) = root(&b.left) {
                    self.0.push((i.to_string(), i.span()));
                }
            }
            syn::visit::visit_expr_binary(self, b);
        }
    }
    let mut c = Collect(Vec::new());
    c.visit_expr(expr);
    c.0
}

/// `+=`, `-=`, ...
pub(crate) fn is_compound_assign(op: &syn::BinOp) -> bool {
    use syn::BinOp::*;
    matches!(
        op,
        AddAssign(_)
            | SubAssign(_)
            | MulAssign(_)
            | DivAssign(_)
            | RemAssign(_)
            | BitXorAssign(_)
            | BitAndAssign(_)
            | BitOrAssign(_)
            | ShlAssign(_)
            | ShrAssign(_)
    )
}

/// Names bound anywhere inside `expr` (`let`, closure parameters, `for`
/// and `match` patterns): an assignment to one of these is local.
pub(crate) fn locals(expr: &Expr) -> Vec<String> {
    struct Collect(Vec<String>);
    impl<'ast> Visit<'ast> for Collect {
        fn visit_pat_ident(&mut self, p: &'ast syn::PatIdent) {
            self.0.push(p.ident.to_string());
            syn::visit::visit_pat_ident(self, p);
        }
    }
    let mut c = Collect(Vec::new());
    c.visit_expr(expr);
    c.0
}

/// Whether a pattern binds `mut` names.
pub(crate) fn binds_mut(pat: &Pat) -> bool {
    bound(pat).iter().any(|(_, mutable)| *mutable)
}

/// Methods that read a tensor's shape, dtype or device, or give a value
/// that carries no gradient from it (`detach`, `zeros_like`): a binding
/// that a statement mentions only as the receiver of these is read without
/// gradient.
const WITHOUT_GRADIENT: &[&str] = &[
    "shape",
    "dims",
    "dim",
    "dims0",
    "dims1",
    "dims2",
    "dims3",
    "dims4",
    "dims5",
    "rank",
    "elem_count",
    "dtype",
    "device",
    "layout",
    "stride",
    "is_contiguous",
    "is_variable",
    "track_op",
    "id",
    "detach",
    "zeros_like",
    "ones_like",
    "rand_like",
    "randn_like",
    // Of an `Option` or a list of tensors: whether there is one, how many.
    "is_some",
    "is_none",
    "len",
    "is_empty",
];

/// The identifiers `expr` mentions for their values, where a gradient can
/// flow: every mention but the receiver of a method in
/// [`WITHOUT_GRADIENT`] (`x.shape()`, `x.dims4()?`, `x.detach()`) and what
/// a `.detach()` is called on (`x.to_dtype(..)?.detach()`). Nothing,
/// when the statement's whole value is detached (`... .detach()` last): the
/// cut is stated.
pub(crate) fn read_for_value(expr: &Expr) -> Vec<String> {
    let (whole, parts) = value_reads(expr);
    whole.into_iter().chain(parts).collect()
}

/// Of the identifiers `expr` mentions for their values
/// ([`read_for_value`]), those it reads only in part: every such mention
/// is indexed (`parts[0]`, `xs[i]`), a tuple's field (`pair.0`), or the
/// receiver of [`IN_PART`] (`xs.first()`). A value of
/// several tensors read so may leave some of them unread.
pub(crate) fn read_in_part(expr: &Expr) -> Vec<String> {
    let (whole, parts) = value_reads(expr);
    let mut out: Vec<String> = parts.into_iter().filter(|p| !whole.contains(p)).collect();
    out.dedup();
    out
}

/// Of the identifiers `expr` mentions for their values
/// ([`read_for_value`]), those it reads only through named fields
/// (`routed.states`) and parts: a statement's value of a struct of the
/// user's own (`#[derive(Outputs)]`) read so may leave some of its tensors
/// unread, and so may a parameter's (`p.a`, `p.b` read by two statements).
pub(crate) fn read_through_fields(expr: &Expr) -> Vec<String> {
    let (whole, parts) = reads_of(expr, false, true);
    let mut out: Vec<String> = parts.into_iter().filter(|p| !whole.contains(p)).collect();
    out.sort();
    out.dedup();
    out
}

/// Of the identifiers `expr` mentions for their values
/// ([`read_for_value`]), those it reads only on some of its branches: in
/// one arm of an `if` or `match` and not in another (`if skip { (h + x)? }
/// else { h }` reads `x` so). The statement's graph need not reach them:
/// on the branch it took, it may not have read them.
pub(crate) fn read_on_branch(expr: &Expr) -> Vec<String> {
    let (whole, parts) = value_reads(expr);
    let (every, every_part) = reads_of(expr, true, false);
    let mut out: Vec<String> = whole
        .into_iter()
        .chain(parts)
        .filter(|n| !every.contains(n) && !every_part.contains(n))
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Methods that read one element of a collection.
const IN_PART: &[&str] = &["first", "last", "get"];

/// A single identifier (`x`), not a path.
fn name_of(e: &Expr) -> Option<String> {
    match e {
        Expr::Path(p) if p.qself.is_none() && p.path.segments.len() == 1 => {
            Some(p.path.segments[0].ident.to_string())
        }
        _ => None,
    }
}

/// The identifiers `expr` reads for their values: those mentioned whole,
/// and those mentioned only as the base of a part (see [`read_in_part`]).
fn value_reads(expr: &Expr) -> (Vec<String>, Vec<String>) {
    reads_of(expr, false, false)
}

/// [`value_reads`], or with `every_branch` only the reads on every branch:
/// of an `if` or `match`, those of all its arms (an `if` without `else`
/// has an empty one). `named_fields`: a name's named field (`r.states`)
/// is a part of it too.
fn reads_of(expr: &Expr, every_branch: bool, named_fields: bool) -> (Vec<String>, Vec<String>) {
    /// Reads whole, reads in part, every branch only, named fields as
    /// parts, inside a cast to a number.
    struct Collect(Vec<String>, Vec<String>, bool, bool, bool);
    impl Collect {
        /// A `match` or `if let` scrutinee: a value a pattern takes apart
        /// (`match cache { Some(c) => .., None => .. }`, `if let Some(e) =
        /// extra.filter(..)`, `match (extra, flag) { (Some(e), true) => ..
        /// }`) is read through the pattern's bindings, in the arms that use
        /// them: in part, and on a branch (an arm, its guard or a branch in
        /// its body may not read it).
        fn scrutinee<'a>(&mut self, e: &Expr, pats: impl Iterator<Item = &'a syn::Pat>) {
            match destructured(e, pats) {
                Some((names, args)) => {
                    if !self.2 {
                        self.1.extend(names);
                    }
                    args.into_iter().for_each(|a| self.visit_expr(a));
                }
                None => self.visit_expr(e),
            }
        }

        /// The reads every arm makes (whole or in part: as read whole).
        fn arms<'a>(&mut self, arms: impl Iterator<Item = Option<&'a Expr>>) {
            let mut common: Option<Vec<String>> = None;
            for arm in arms {
                let mut c = Collect(Vec::new(), Vec::new(), true, self.3, self.4);
                if let Some(e) = arm {
                    c.visit_expr(e);
                }
                let read: Vec<String> = c.0.into_iter().chain(c.1).collect();
                common = Some(match common {
                    None => read,
                    Some(w) => w.into_iter().filter(|n| read.contains(n)).collect(),
                });
            }
            self.0.extend(common.unwrap_or_default());
        }
    }
    impl<'ast> Visit<'ast> for Collect {
        fn visit_expr_if(&mut self, e: &'ast syn::ExprIf) {
            if !self.2 {
                return syn::visit::visit_expr_if(self, e);
            }
            self.visit_expr(&e.cond);
            let then = Expr::Block(syn::ExprBlock {
                attrs: Vec::new(),
                label: None,
                block: e.then_branch.clone(),
            });
            let otherwise = e.else_branch.as_ref().map(|(_, b)| &**b);
            self.arms([Some(&then), otherwise].into_iter());
        }
        fn visit_expr_match(&mut self, m: &'ast syn::ExprMatch) {
            self.scrutinee(&m.expr, m.arms.iter().map(|a| &a.pat));
            if !self.2 {
                for arm in &m.arms {
                    if let Some((_, guard)) = &arm.guard {
                        self.visit_expr(guard);
                    }
                    self.visit_expr(&arm.body);
                }
                return;
            }
            self.arms(m.arms.iter().map(|a| Some(&*a.body)));
        }
        fn visit_expr_let(&mut self, l: &'ast syn::ExprLet) {
            self.scrutinee(&l.expr, std::iter::once(&*l.pat));
        }
        fn visit_expr_method_call(&mut self, m: &'ast syn::ExprMethodCall) {
            if let Some((names, args)) = iterated(m) {
                // A list iterated through adapters that pick some of it
                // (`feats.iter().skip(1)`, `.zip(..)`, `.enumerate()`): read
                // in part.
                self.1.extend(names);
                return args.into_iter().for_each(|a| self.visit_expr(a));
            }
            let receiver = name_of(&m.receiver);
            let method = m.method.to_string();
            // `.detach()` ends every path beneath it: `p.to_dtype(..)?.detach()`.
            let detach = method == "detach";
            // `parts[i].dims()`: the index is read, `parts` only for a shape.
            let element = match &*m.receiver {
                Expr::Index(i) if name_of(&i.expr).is_some() => Some(&*i.index),
                _ => None,
            };
            let field = matches!(&*m.receiver, Expr::Field(f) if name_of(&f.base).is_some());
            let shape_only = WITHOUT_GRADIENT.contains(&method.as_str())
                && (receiver.is_some() || element.is_some() || field);
            if detach || shape_only {
                if let Some(index) = element {
                    self.visit_expr(index);
                }
                for arg in &m.args {
                    self.visit_expr(arg);
                }
            } else if let Some(name) = receiver.filter(|_| IN_PART.contains(&method.as_str())) {
                self.1.push(name);
                for arg in &m.args {
                    self.visit_expr(arg);
                }
            } else {
                syn::visit::visit_expr_method_call(self, m);
            }
        }
        fn visit_expr_index(&mut self, i: &'ast syn::ExprIndex) {
            let part = match &*i.expr {
                Expr::Field(f) => field_root(f).is_some(),
                e => name_of(e).is_some(),
            };
            if self.4 && part {
                return self.visit_expr(&i.index);
            }
            match name_of(&i.expr) {
                Some(name) => {
                    self.1.push(name);
                    self.visit_expr(&i.index);
                }
                None => syn::visit::visit_expr_index(self, i),
            }
        }
        fn visit_expr_cast(&mut self, c: &'ast syn::ExprCast) {
            // Parts of values in a cast to a number (`t.1 as f64`,
            // `(p.grid.h * p.grid.w) as f64`, `dims[0] as f64`) are
            // numbers, not tensors: those values are not read for their
            // values there.
            let outer = std::mem::replace(&mut self.4, true);
            self.visit_expr(&c.expr);
            self.4 = outer;
        }
        fn visit_expr_field(&mut self, f: &'ast syn::ExprField) {
            if self.4 && field_root(f).is_some() {
                return;
            }
            // A tuple's field; a struct's (`p.w1`: a parameter holding no
            // tensors of its own, `self.proj`) is read whole.
            match (name_of(unwrapped(&f.base)), &f.member) {
                (Some(name), syn::Member::Unnamed(_)) => self.1.push(name),
                (Some(name), syn::Member::Named(_)) if self.3 => self.1.push(name),
                _ => syn::visit::visit_expr_field(self, f),
            }
        }
        fn visit_expr_path(&mut self, p: &'ast syn::ExprPath) {
            if let Some(name) = name_of(&Expr::Path(p.clone())) {
                self.0.push(name);
            }
            syn::visit::visit_expr_path(self, p);
        }
        fn visit_macro(&mut self, m: &'ast syn::Macro) {
            // Arguments that parse as expressions (`assert_eq!(h.dims(),
            // r.dims())`, `println!("{}", x.dim(0)?)`) are read as
            // expressions; a format string's inline arguments are host
            // reads. Other tokens: every identifier counts.
            let args = Punctuated::<Expr, syn::Token![,]>::parse_terminated;
            match syn::parse::Parser::parse2(args, m.tokens.clone()) {
                Ok(args) => args.iter().for_each(|a| self.visit_expr(a)),
                Err(_) => {
                    for (name, _) in mentions(&Expr::Macro(syn::ExprMacro {
                        attrs: Vec::new(),
                        mac: m.clone(),
                    })) {
                        self.0.push(name);
                    }
                }
            }
        }
    }
    if detached_whole(expr) {
        return (Vec::new(), Vec::new());
    }
    let mut c = Collect(Vec::new(), Vec::new(), every_branch, named_fields, false);
    c.visit_expr(expr);
    (c.0, c.1)
}

/// Methods of an `Option` (or a `Result`) that give it, or a part of it,
/// back: a pattern on what they give takes the value apart.
const OPTION_ADAPTERS: &[&str] = &[
    "as_ref", "as_deref", "as_mut", "cloned", "copied", "filter", "and_then", "map", "or",
    "or_else", "xor", "and", "zip", "take", "ok", "err", "flatten", "inspect",
];

/// The names `scrutinee` is (`p`, `&p`, `p.as_ref()`, `p.filter(..)`, the
/// elements of a tuple `(p, flag)`), where a pattern of `pats` takes it
/// apart (`Some(c)`, `Pair { a, .. }`, `(Some(e), true)`), with the
/// arguments of the adapters on the way (read as any expression): the
/// bindings the patterns make read parts of them (`match cache { Some(c) =>
/// cat(&[&c.k, &k]), None => k }` reads `cache` in part).
fn destructured<'a, 'e>(
    scrutinee: &'e Expr,
    mut pats: impl Iterator<Item = &'a syn::Pat>,
) -> Option<(Vec<String>, Vec<&'e Expr>)> {
    fn names<'e>(e: &'e Expr, out: &mut Vec<String>, args: &mut Vec<&'e Expr>) -> bool {
        match e {
            Expr::Reference(r) => names(&r.expr, out, args),
            Expr::Paren(p) => names(&p.expr, out, args),
            Expr::Tuple(t) => {
                let before = out.len();
                for e in &t.elems {
                    if !names(e, out, args) {
                        args.push(e);
                    }
                }
                out.len() > before
            }
            Expr::MethodCall(m) if OPTION_ADAPTERS.contains(&m.method.to_string().as_str()) => {
                args.extend(m.args.iter());
                names(&m.receiver, out, args)
            }
            e => match name_of(e) {
                Some(name) => {
                    out.push(name);
                    true
                }
                None => false,
            },
        }
    }
    let apart = |p: &syn::Pat| match p {
        syn::Pat::Ident(i) => i.subpat.is_some(),
        syn::Pat::Wild(_) => false,
        syn::Pat::Or(o) => o
            .cases
            .iter()
            .any(|c| !matches!(c, syn::Pat::Wild(_) | syn::Pat::Ident(_))),
        _ => true,
    };
    let (mut out, mut args) = (Vec::new(), Vec::new());
    (names(scrutinee, &mut out, &mut args) && pats.any(apart)).then_some((out, args))
}

/// Iterator adapters that may pass over some of what they iterate.
const PICKING: &[&str] = &[
    "skip",
    "take",
    "step_by",
    "zip",
    "filter",
    "filter_map",
    "skip_while",
    "take_while",
    "map_while",
    "enumerate",
    "nth",
    "find",
    "find_map",
    "position",
    "peekable",
    "chunks",
    "windows",
];

/// The lists `m` iterates through an adapter that may pass over some of
/// their elements (`feats.iter().skip(1)`, `xs.iter().zip(ys.iter())`,
/// `feats.iter().enumerate()`, whose index a branch in the loop may test),
/// with every argument of the chain's calls; `None` for any other call.
fn iterated(m: &syn::ExprMethodCall) -> Option<(Vec<String>, Vec<&Expr>)> {
    /// The list a chain iterates (`xs.iter()`, `xs.into_iter()`), and
    /// whether it picks.
    fn root<'e>(e: &'e Expr, args: &mut Vec<&'e Expr>, picks: &mut bool) -> Option<String> {
        match e {
            Expr::MethodCall(m) => {
                let method = m.method.to_string();
                if ["iter", "into_iter", "iter_mut"].contains(&method.as_str()) && m.args.is_empty()
                {
                    if let Some(name) = name_of(&m.receiver) {
                        return Some(name);
                    }
                }
                *picks |= PICKING.contains(&method.as_str());
                args.extend(m.args.iter());
                root(&m.receiver, args, picks)
            }
            Expr::Paren(p) => root(&p.expr, args, picks),
            _ => None,
        }
    }
    let method = m.method.to_string();
    let mut picks = PICKING.contains(&method.as_str());
    let mut args: Vec<&Expr> = m.args.iter().collect();
    let name = root(&m.receiver, &mut args, &mut picks)?;
    if !picks {
        return None;
    }
    // A list zipped in (`.zip(ys.iter())`) is read in part too.
    let mut names = vec![name];
    let mut rest = Vec::new();
    for a in args {
        let (mut inner, mut p) = (Vec::new(), false);
        match root(a, &mut inner, &mut p) {
            Some(n) => {
                names.push(n);
                rest.extend(inner);
            }
            None => rest.push(a),
        }
    }
    Some((names, rest))
}

/// `e` without the calls that take an `Option` apart (`p.unwrap()`,
/// `p.as_ref().expect("..")`): a field of what they give (`p.unwrap().a`)
/// is a field of `p`.
fn unwrapped(e: &Expr) -> &Expr {
    match e {
        Expr::MethodCall(m)
            if ["unwrap", "expect", "as_ref", "as_deref"]
                .contains(&m.method.to_string().as_str())
                && m.args.iter().all(|a| matches!(a, Expr::Lit(_))) =>
        {
            unwrapped(&m.receiver)
        }
        Expr::Paren(p) => unwrapped(&p.expr),
        e => e,
    }
}

/// The name a chain of fields starts from (`p` of `p.grid.h`).
fn field_root(f: &syn::ExprField) -> Option<String> {
    match &*f.base {
        Expr::Field(inner) => field_root(inner),
        Expr::Paren(p) => match &*p.expr {
            Expr::Field(inner) => field_root(inner),
            e => name_of(e),
        },
        e => name_of(e),
    }
}

/// Whether the value of `expr` is detached last: `(...)?.detach()`.
fn detached_whole(expr: &Expr) -> bool {
    match expr {
        Expr::MethodCall(m) => m.method == "detach",
        Expr::Paren(p) => detached_whole(&p.expr),
        Expr::Group(g) => detached_whole(&g.expr),
        Expr::Try(t) => detached_whole(&t.expr),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn for_value(src: &str) -> Vec<String> {
        let mut names = read_for_value(&syn::parse_str(src).unwrap());
        names.sort();
        names.dedup();
        names
    }

    #[test]
    fn macro_arguments_read_for_their_shapes_are_not_value_reads() {
        assert_eq!(
            for_value("{ debug_assert_eq!(h.dims(), r.dims()); h.exp()? }"),
            ["h"]
        );
        assert_eq!(for_value("{ println!(\"{}\", x.dim(0)?); y }"), ["y"]);
        assert_eq!(for_value("{ println!(\"{x:?}\"); y }"), ["y"]);
        // Tokens that are not expressions: every identifier counts.
        assert_eq!(for_value("m!(a => b)"), ["a", "b"]);
    }

    fn on_branch(src: &str) -> Vec<String> {
        read_on_branch(&syn::parse_str(src).unwrap())
    }

    #[test]
    fn values_read_on_some_branches_only_are_read_on_a_branch() {
        assert_eq!(on_branch("if skip { (&h + x)? } else { h.clone() }"), ["x"]);
        assert_eq!(
            on_branch("if skip { (&h + x)? } else { (&h * 2.0)? }"),
            ["x"]
        );
        assert_eq!(
            on_branch("if c { x.exp()? } else { x.tanh()? }"),
            Vec::<String>::new()
        );
        // Read on a branch and outside it: read.
        assert!(on_branch("(if skip { (&h + x)? } else { h.clone() } + x.sqr()?)?").is_empty());
        // No `else`: an empty branch.
        assert_eq!(
            on_branch("{ let mut y = h.clone(); if skip { y = (y + x)?; } y }"),
            ["x"]
        );
        // A scrutinee a pattern takes apart is read through its bindings,
        // in the arms that use them; one read whole, whatever the arm.
        assert_eq!(
            on_branch("match m { Some(m) => h.broadcast_add(m)?, None => (h * s)? }"),
            ["m", "s"]
        );
        assert_eq!(
            on_branch("match m { n => h.broadcast_add(&n)?, }"),
            Vec::<String>::new()
        );
        assert_eq!(
            on_branch("match e { Some(e) if use_e => (&h + e)?, _ => h.tanh()? }"),
            ["e", "use_e"]
        );
        assert_eq!(
            on_branch("match (e, use_e) { (Some(e), true) => (&h + e)?, _ => h.tanh()? }"),
            ["e", "use_e"]
        );
        assert_eq!(
            on_branch("if let Some(e) = e.filter(|_| u) { (&h + e)? } else { h.tanh()? }"),
            ["e"]
        );
        // Nested: `a` on every branch of the inner `if` (and its
        // condition), which is on one branch of the outer.
        assert_eq!(
            on_branch("if p { if q { a.exp()? } else { a.sin()? } } else { b.exp()? }"),
            ["a", "b", "q"]
        );
        // In part on one branch, whole on the other: on every branch.
        assert!(on_branch("if p { parts[0].exp()? } else { parts.concat() }").is_empty());
        // The condition is read whatever the branch.
        assert!(on_branch(
            "if g.sum_all()?.to_scalar::<f32>()? > 0.0 { g.exp()? } else { g.sin()? }"
        )
        .is_empty());
    }

    #[test]
    fn a_detach_ends_every_path_beneath_it() {
        let src = "p.to_dtype(DType::F32)?.detach().to_vec2::<f32>()?";
        assert!(for_value(src).is_empty());
        assert_eq!(for_value("(a.exp()?.detach() * b)?"), ["b"]);
        assert_eq!(for_value("(a.exp()?.detach() * a)?"), ["a"]);
    }

    #[test]
    fn parts_cast_to_numbers_are_not_read_for_their_values() {
        let read = |src: &str| read_for_value(&syn::parse_str(src).unwrap());
        assert_eq!(read("(y * (t.1 as f64 / n as f64))"), ["y", "n"]);
        assert_eq!(read("(&h * dims[i] as f64)"), ["h", "i"]);
        assert_eq!(read("(x.sum_all()? + (x.dim(0)? + k) as f64)"), ["x", "k"]);
        assert_eq!(read("(y * ((p.grid.h * p.grid.w) as f64))"), ["y"]);
        assert_eq!(
            read("(y * p.sizes[i] as f64 + p.t.exp()?)"),
            ["y", "i", "p"]
        );
    }

    #[test]
    fn named_fields_are_parts_only_where_asked() {
        let fields = |src: &str| read_through_fields(&syn::parse_str(src).unwrap());
        assert_eq!(fields("r.states.matmul(&w)?.add(&p.0)?"), ["p", "r"]);
        assert!(fields("(r.states + r.clone())?").is_empty());
        assert!(read_in_part(&syn::parse_str("r.states.exp()").unwrap()).is_empty());
    }

    #[test]
    fn indexed_names_tuple_fields_and_single_elements_are_read_in_part() {
        let in_part = |src: &str| {
            let mut names = read_in_part(&syn::parse_str(src).unwrap());
            names.sort();
            names
        };
        assert_eq!(in_part("(parts[0].tanh()? * &xs[i])?"), ["parts", "xs"]);
        assert_eq!(
            in_part("(pair.0.exp()? + xs.first().unwrap())?"),
            ["pair", "xs"]
        );
        // Read whole somewhere: whole.
        assert!(
            in_part("Tensor::cat(&[&parts[0], &parts[1]], 1)?.add(&parts.concat())").is_empty()
        );
        assert!(in_part("(parts[0].exp()? + Tensor::stack(&parts, 0)?)").is_empty());
        // A struct's field is the struct read whole; an index read for its
        // shape only is no value read.
        assert!(in_part("x.matmul(&p.w1)?").is_empty());
        assert!(in_part("Tensor::zeros(parts[0].dims(), DType::F32, &dev)").is_empty());
        assert_eq!(for_value("parts[i].exp()"), ["i", "parts"]);
    }

    #[test]
    fn lists_iterated_through_picking_adapters_are_read_in_part() {
        let in_part = |src: &str| {
            let mut names = read_in_part(&syn::parse_str(src).unwrap());
            names.sort();
            names
        };
        let src =
            "{ let mut acc = a.clone(); for f in feats.iter().skip(k) { acc = (acc + f)?; } acc }";
        assert_eq!(in_part(src), ["feats"]);
        assert_eq!(
            in_part("feats.iter().zip(ws.iter()).map(|(f, w)| f * w).collect::<Vec<_>>()"),
            ["feats", "ws"]
        );
        assert_eq!(
            in_part("feats.iter().skip(1).try_fold(z.clone(), |a, f| a + f)?"),
            ["feats"]
        );
        // Every element: read whole.
        assert!(in_part("feats.iter().map(|f| f.exp()).collect::<Vec<_>>()").is_empty());
        assert!(
            in_part("{ let mut a = z.clone(); for f in &feats { a = (a + f)?; } a }").is_empty()
        );
    }
}
