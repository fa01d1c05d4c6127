//! The model of a `remat!` block that parsing builds and the later phases
//! read: the function, its parameters, its top-level statements and their
//! annotations.

use proc_macro2::TokenStream;
use syn::{Attribute, Expr, ItemFn, LitStr, Pat, Type};

/// The annotations a top-level statement can carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AnnotationKind {
    Save,
    Offload,
    Recompute,
    ForwardOnly,
}

impl AnnotationKind {
    pub fn from_ident(name: &str) -> Option<AnnotationKind> {
        match name {
            "save" => Some(AnnotationKind::Save),
            "offload" => Some(AnnotationKind::Offload),
            "recompute" => Some(AnnotationKind::Recompute),
            "forward_only" => Some(AnnotationKind::ForwardOnly),
            _ => None,
        }
    }

    pub fn attr(self) -> &'static str {
        match self {
            AnnotationKind::Save => "#[save]",
            AnnotationKind::Offload => "#[offload]",
            AnnotationKind::Recompute => "#[recompute]",
            AnnotationKind::ForwardOnly => "#[forward_only]",
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Annotation {
    pub kind: AnnotationKind,
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
