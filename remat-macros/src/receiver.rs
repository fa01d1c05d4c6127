//! Methods: a block written as `fn forward(&self, ...)`. The receiver is a
//! borrowed parameter like any other (the region keeps a copy of `Self`);
//! since `self` cannot be bound again inside the region's closures, the
//! body's `self` becomes a binding of the macro's own, spanned where the
//! user wrote `self`.

use proc_macro2::{Group, Span, TokenStream, TokenTree};
use syn::visit_mut::VisitMut;
use syn::Ident;

/// The binding the body's `self` becomes, at `span`: `self_`, a name a
/// compile error can show (rustc's "`self_` is a `&` reference"), with the
/// macro's own hygiene, so that a `self_` of the user's is another binding.
pub(crate) fn this(span: Span) -> Ident {
    Ident::new("self_", span.resolved_at(Span::mixed_site()))
}

/// Replaces every `self` of `block` (expressions, and tokens inside macro
/// invocations such as `bail!("{}", self.name)`) with the binding `this`;
/// nested items keep theirs.
pub(crate) fn rename_self(block: &mut syn::Block) {
    Rename.visit_block_mut(block);
}

struct Rename;

impl VisitMut for Rename {
    fn visit_expr_path_mut(&mut self, p: &mut syn::ExprPath) {
        if p.qself.is_none() && p.path.segments.len() == 1 && p.path.segments[0].ident == "self" {
            let span = p.path.segments[0].ident.span();
            p.path.segments[0].ident = this(span);
        }
        syn::visit_mut::visit_expr_path_mut(self, p);
    }

    fn visit_macro_mut(&mut self, m: &mut syn::Macro) {
        m.tokens = rename_tokens(std::mem::take(&mut m.tokens));
    }

    fn visit_item_mut(&mut self, _: &mut syn::Item) {}
}

fn rename_tokens(ts: TokenStream) -> TokenStream {
    ts.into_iter()
        .map(|tt| match tt {
            TokenTree::Ident(i) if i == "self" => TokenTree::Ident(this(i.span())),
            TokenTree::Group(g) => {
                let mut new = Group::new(g.delimiter(), rename_tokens(g.stream()));
                new.set_span(g.span());
                TokenTree::Group(new)
            }
            other => other,
        })
        .collect()
}
