//! From tokens to the model of a `remat!` block, collecting syntax errors.

use proc_macro2::{Span, TokenStream};
use quote::ToTokens;
use syn::parse::{Parse, ParseStream};
use syn::spanned::Spanned;
use syn::visit::Visit;
use syn::{Attribute, Expr, FnArg, ItemFn, LitStr, Pat, Stmt, Type};

use crate::errors::Errors;

/// The annotations a top-level statement can carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Save,
    Offload,
    Recompute,
    ForwardOnly,
}

impl Kind {
    fn from_ident(name: &str) -> Option<Kind> {
        match name {
            "save" => Some(Kind::Save),
            "offload" => Some(Kind::Offload),
            "recompute" => Some(Kind::Recompute),
            "forward_only" => Some(Kind::ForwardOnly),
            _ => None,
        }
    }

    pub fn attr(self) -> &'static str {
        match self {
            Kind::Save => "#[save]",
            Kind::Offload => "#[offload]",
            Kind::Recompute => "#[recompute]",
            Kind::ForwardOnly => "#[forward_only]",
        }
    }
}

/// Attribute names users plausibly mean when they write one of ours.
const MISTAKES: &[(&str, &str)] = &[
    ("saved", "save"),
    ("keep", "save"),
    ("checkpoint", "save"),
    ("recomputed", "recompute"),
    ("recompute_only", "recompute"),
    ("forward", "forward_only"),
    ("forwardonly", "forward_only"),
    ("offloaded", "offload"),
    ("cpu_offload", "offload"),
    ("offload_to_cpu", "offload"),
];

#[derive(Debug, Clone)]
pub(crate) struct Annotation {
    pub kind: Kind,
    pub name: Option<LitStr>,
    /// The whole attribute, for error spans.
    pub tokens: TokenStream,
}

/// A function parameter of the block.
pub(crate) struct Param {
    pub ident: syn::Ident,
    pub mutable: bool,
    /// `x: &T`: the body sees a reference to its own copy.
    pub by_ref: bool,
}

pub(crate) enum StmtKind {
    /// `let PAT = EXPR;`
    Let { pat: Pat, init: Expr },
    /// `EXPR;` (including macro statements)
    Expr(Expr),
    /// An item defined inside the block.
    Item(syn::Item),
}

pub(crate) struct Statement {
    pub kind: StmtKind,
    pub annotation: Option<Annotation>,
    /// Attributes other than ours, kept on the generated statement.
    pub attrs: Vec<Attribute>,
}

pub(crate) struct Block {
    /// Whether parsing this block reported errors.
    pub failed: bool,
    pub func: ItemFn,
    pub params: Vec<Param>,
    pub statements: Vec<Statement>,
    pub tail: Option<Expr>,
    pub ret: Type,
}

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

fn parse_fn(func: ItemFn, errors: &mut Errors) -> Block {
    let before = errors.len();
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
            FnArg::Receiver(r) => errors.push_spanned(
                r,
                "remat! does not support methods: write the block as a free function taking the \
                 values it needs, and call it from the method",
            ),
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
                let by_ref = match &*t.ty {
                    Type::Reference(r) if r.mutability.is_some() => {
                        errors.push_spanned(
                            r,
                            "a remat! block cannot take `&mut` parameters: it runs twice (forward \
                             and replay), so mutation would happen twice",
                        );
                        true
                    }
                    Type::Reference(_) => true,
                    _ => false,
                };
                params.push(Param {
                    ident,
                    mutable,
                    by_ref,
                });
            }
        }
    }
    let ret = match &sig.output {
        syn::ReturnType::Type(_, ty) => (**ty).clone(),
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
        func,
        params,
        statements,
        tail,
        ret,
    }
}

/// Splits our annotations from other attributes.
fn annotations(attrs: &[Attribute], errors: &mut Errors) -> (Option<Annotation>, Vec<Attribute>) {
    let mut found: Option<Annotation> = None;
    let mut rest = Vec::new();
    for attr in attrs {
        let Some(ident) = attr.path().get_ident().map(|i| i.to_string()) else {
            rest.push(attr.clone());
            continue;
        };
        if let Some((_, meant)) = MISTAKES.iter().find(|(w, _)| *w == ident) {
            errors.push_spanned(
                attr,
                format!("unknown remat annotation `#[{ident}]`; did you mean `#[{meant}]`? (remat knows `#[save]`, `#[offload]`, `#[recompute]` and `#[forward_only]`)"),
            );
            continue;
        }
        let Some(kind) = Kind::from_ident(&ident) else {
            rest.push(attr.clone());
            continue;
        };
        let name = parse_args(attr, kind, errors);
        if let Some(prev) = &found {
            errors.push_spanned(
                attr,
                format!(
                    "conflicting annotations: this statement is already {}; a statement has one policy",
                    prev.kind.attr()
                ),
            );
            continue;
        }
        found = Some(Annotation {
            kind,
            name,
            tokens: attr.to_token_stream(),
        });
    }
    (found, rest)
}

fn parse_args(attr: &Attribute, kind: Kind, errors: &mut Errors) -> Option<LitStr> {
    if matches!(attr.meta, syn::Meta::Path(_)) {
        return None;
    }
    if kind == Kind::ForwardOnly {
        errors.push(attr.meta.span(), "`#[forward_only]` takes no arguments");
        return None;
    }
    let mut name = None;
    let result = attr.parse_nested_meta(|meta| {
        if meta.path.is_ident("name") {
            let lit: LitStr = meta.value()?.parse()?;
            if lit.value().is_empty() {
                return Err(meta.error("a statement name cannot be empty"));
            }
            if name.is_some() {
                return Err(meta.error("`name` is given twice"));
            }
            name = Some(lit);
            Ok(())
        } else {
            let arg = meta
                .path
                .get_ident()
                .map_or_else(|| "?".to_string(), |i| i.to_string());
            Err(meta.error(format!(
                "unknown argument `{arg}` of {}: the only argument is `name = \"...\"`",
                kind.attr()
            )))
        }
    });
    if let Err(e) = result {
        errors.push_error(e);
    }
    name
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
            Some(Statement {
                kind: StmtKind::Let {
                    pat: local.pat.clone(),
                    init: (*init.expr).clone(),
                },
                annotation,
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
                attrs,
            })
        }
        Stmt::Item(item) => Some(Statement {
            kind: StmtKind::Item(item.clone()),
            annotation: None,
            attrs: Vec::new(),
        }),
    }
}

fn check_statement_expr(expr: &Expr, annotation: Option<&Annotation>, errors: &mut Errors) {
    if let Some(a) = annotation {
        if a.kind != Kind::ForwardOnly {
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
    let assigned = match expr {
        Expr::Assign(a) => Some(a.left.span()),
        Expr::Binary(b) if is_compound_assign(&b.op) => Some(b.left.span()),
        _ => None,
    };
    if let Some(span) = assigned {
        errors.push(
            span,
            "assignment in a remat! block: statements run again in the replay, so the assignment \
             would happen twice; bind a new value with `let` instead",
        );
    }
    check_nested(expr, errors);
    check_return(expr, errors, false);
}

fn is_compound_assign(op: &syn::BinOp) -> bool {
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

/// `expr_attrs` and `expr_attrs_mut`: the outer attributes syn keeps on an
/// expression (an expression statement's attributes live there).
macro_rules! expr_attrs {
    ($($variant:ident),*) => {
        fn expr_attrs(expr: &Expr) -> &[Attribute] {
            match expr {
                $(Expr::$variant(e) => &e.attrs,)*
                _ => &[],
            }
        }

        fn expr_attrs_mut(expr: &mut Expr) -> Option<&mut Vec<Attribute>> {
            match expr {
                $(Expr::$variant(e) => Some(&mut e.attrs),)*
                _ => None,
            }
        }
    };
}

expr_attrs!(
    Array, Assign, Async, Await, Binary, Block, Call, Cast, Closure, Field, ForLoop, If, Index,
    Loop, Macro, Match, MethodCall, Paren, Path, Reference, Return, Try, Tuple, Unary, Unsafe,
    While
);

/// Takes our annotations off an expression statement's expression.
fn strip_attrs(expr: &mut Expr) {
    if let Some(attrs) = expr_attrs_mut(expr) {
        attrs.retain(|a| {
            a.path()
                .get_ident()
                .is_none_or(|i| Kind::from_ident(&i.to_string()).is_none())
        });
    }
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
                if let Some(kind) = Kind::from_ident(&ident.to_string()) {
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
