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

/// How a parameter is passed, which decides how the region keeps its own
/// copy of it (the body runs again in the backward, after the call
/// returned).
pub(crate) enum Passing {
    /// `x: T`: moved into the region.
    Value,
    /// `x: &T` (also `&[T]`, `&str`): the region keeps `T::to_owned()`;
    /// the body sees `&T` borrowed from it. Holds `T`, lifetime elided.
    Ref(Type),
    /// `x: Option<&T>`: the region keeps `Option<T::Owned>`; the body sees
    /// `Option<&T>`. Holds `T`, lifetime elided.
    OptionRef(Type),
}

/// A function parameter of the block.
pub(crate) struct Param {
    pub ident: syn::Ident,
    pub mutable: bool,
    pub passing: Passing,
}

impl Param {
    /// The body sees a reference into the region's own copy.
    pub fn borrowed(&self) -> bool {
        !matches!(self.passing, Passing::Value)
    }
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
    /// The annotation the user wrote on it.
    pub annotation: Option<Annotation>,
    /// Attributes other than ours, kept on the generated statement.
    pub attrs: Vec<Attribute>,
}

pub(crate) struct Block {
    /// A method's receiver (`&self`, `self`): the binding its `self` became
    /// in the body (`receiver::this`), bound to `self` first thing.
    pub receiver: Option<syn::Ident>,
    pub func: ItemFn,
    pub params: Vec<Param>,
    pub statements: Vec<Statement>,
    pub tail: Option<Expr>,
    /// An annotation written on the tail (refused by `checks`).
    pub tail_annotation: Option<Annotation>,
    /// The return type (`()` when none is written, refused by `checks`).
    pub ret: Type,
}
