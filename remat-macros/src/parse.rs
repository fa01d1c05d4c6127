//! From tokens to the model of a `remat!` block, collecting syntax errors.

use proc_macro2::Span;
use proc_macro2::TokenStream;
use syn::parse::{Parse, ParseStream};
use syn::spanned::Spanned;
use syn::{Expr, FnArg, ItemFn, Pat, Stmt, Type};

use syn::visit_mut::VisitMut;

use crate::attributes::{annotations, expr_attrs, strip_attrs};
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

/// Each function of the macro's input as a block, with the errors of its
/// own that parsing found.
pub(crate) fn parse(input: TokenStream) -> syn::Result<Vec<(Block, Errors)>> {
    let Items(items) = syn::parse2(input)?;
    if items.is_empty() {
        return Err(syn::Error::new(
            Span::call_site(),
            "remat! expects one or more functions: `remat! { fn block(x: &Tensor) -> Result<Tensor> { ... } }`",
        ));
    }
    Ok(items
        .into_iter()
        .map(|f| {
            let mut errors = Errors::default();
            let block = parse_fn(f, &mut errors);
            (block, errors)
        })
        .collect())
}

fn parse_fn(mut func: ItemFn, errors: &mut Errors) -> Block {
    Ungroup.visit_item_fn_mut(&mut func);
    let mut receiver = None;
    if func.sig.receiver().is_some() {
        crate::receiver::rename_self(&mut func.block);
    }
    let mut params = Vec::new();
    for arg in &func.sig.inputs {
        match arg {
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
                    // `&mut T` is refused by `checks`.
                    Type::Reference(r) if r.mutability.is_some() => Passing::Value,
                    Type::Reference(r) => Passing::Ref((*r.elem).clone()),
                    ty => match option_ref(ty) {
                        Some(elem) => Passing::OptionRef(elem),
                        None => Passing::Value,
                    },
                };
                params.push(Param {
                    ident,
                    mutable,
                    passing,
                });
            }
        }
    }
    let ret = match &func.sig.output {
        syn::ReturnType::Type(_, ty) => (**ty).clone(),
        // Refused by `checks`.
        syn::ReturnType::Default => syn::parse_quote!(()),
    };
    let mut statements = Vec::new();
    let mut tail = None;
    let mut tail_annotation = None;
    let n = func.block.stmts.len();
    for (i, stmt) in func.block.stmts.iter().enumerate() {
        let last = i + 1 == n;
        match stmt {
            Stmt::Expr(e, None) if last => {
                let (annotation, _) = annotations(expr_attrs(e), errors);
                let mut e = e.clone();
                strip_attrs(&mut e);
                tail = Some(e);
                tail_annotation = annotation;
            }
            other => {
                if let Some(s) = parse_statement(other, errors) {
                    statements.push(s);
                }
            }
        }
    }
    Block {
        receiver,
        func,
        params,
        statements,
        tail,
        tail_annotation,
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

/// `T` of `Option<&T>` (any path ending in `Option`), lifetime elided.
pub(crate) fn option_ref(ty: &Type) -> Option<Type> {
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

/// Removes the invisible groups a `macro_rules!` template leaves around
/// what it was handed (`$ret:ty`, `$x:expr`), so that the block reads as
/// written: `-> $ret` with `$ret` = `Result<Tensor>` is a `Result`, and
/// `Ok($h)` returns a binding. An expression that is not a single operand
/// is put in parentheses instead: `$e * 2` with `$e` = `a + b` stays
/// `(a + b) * 2`.
struct Ungroup;

impl VisitMut for Ungroup {
    fn visit_type_mut(&mut self, ty: &mut Type) {
        while let Type::Group(g) = ty {
            *ty = (*g.elem).clone();
        }
        syn::visit_mut::visit_type_mut(self, ty);
    }

    fn visit_expr_mut(&mut self, e: &mut Expr) {
        while let Expr::Group(g) = e {
            let operand = matches!(
                &*g.expr,
                Expr::Path(_)
                    | Expr::Lit(_)
                    | Expr::Paren(_)
                    | Expr::Call(_)
                    | Expr::MethodCall(_)
                    | Expr::Field(_)
                    | Expr::Index(_)
                    | Expr::Try(_)
                    | Expr::Macro(_)
                    | Expr::Tuple(_)
                    | Expr::Array(_)
            );
            *e = match operand {
                true => (*g.expr).clone(),
                // rustc reads the group's tokens in the expansion as if
                // they had none: parentheses keep the order.
                false => Expr::Paren(syn::ExprParen {
                    attrs: g.attrs.clone(),
                    paren_token: syn::token::Paren(g.group_token.span),
                    expr: g.expr.clone(),
                }),
            };
        }
        syn::visit_mut::visit_expr_mut(self, e);
    }
}
