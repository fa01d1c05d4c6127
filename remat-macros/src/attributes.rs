//! Our attributes: telling `#[save]`, `#[offload]`, `#[recompute]` and
//! `#[forward_only]` (and their likely misspellings) from the attributes a
//! statement keeps, and reading their arguments.

use quote::ToTokens;
use syn::spanned::Spanned;
use syn::{Attribute, Expr, LitStr};

use crate::errors::Errors;
use crate::model::{Annotation, AnnotationKind};

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

/// Splits our annotations from other attributes.
pub(crate) fn annotations(
    attrs: &[Attribute],
    errors: &mut Errors,
) -> (Option<Annotation>, Vec<Attribute>) {
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
        let Some(kind) = AnnotationKind::from_ident(&ident) else {
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

fn parse_args(attr: &Attribute, kind: AnnotationKind, errors: &mut Errors) -> Option<LitStr> {
    if matches!(attr.meta, syn::Meta::Path(_)) {
        return None;
    }
    if kind == AnnotationKind::ForwardOnly {
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

/// `expr_attrs` and `expr_attrs_mut`: the outer attributes syn keeps on an
/// expression (an expression statement's attributes live there).
macro_rules! expr_attrs {
    ($($variant:ident),*) => {
        pub(crate) fn expr_attrs(expr: &Expr) -> &[Attribute] {
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
pub(crate) fn strip_attrs(expr: &mut Expr) {
    if let Some(attrs) = expr_attrs_mut(expr) {
        attrs.retain(|a| {
            a.path()
                .get_ident()
                .is_none_or(|i| AnnotationKind::from_ident(&i.to_string()).is_none())
        });
    }
}
