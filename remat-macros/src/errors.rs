//! An accumulator of spanned errors, reported together at the end.

use proc_macro2::{Span, TokenStream};
use std::fmt::Display;

#[derive(Default)]
pub(crate) struct Errors(Vec<syn::Error>);

impl Errors {
    pub fn push(&mut self, span: Span, msg: impl Display) {
        self.0.push(syn::Error::new(span, msg));
    }

    /// An error spanning all of `tokens` (the whole attribute, pattern, ...).
    pub fn push_spanned(&mut self, tokens: impl quote::ToTokens, msg: impl Display) {
        self.0.push(syn::Error::new_spanned(tokens, msg));
    }

    pub fn push_error(&mut self, e: syn::Error) {
        self.0.push(e);
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn into_compile_errors(self) -> TokenStream {
        self.0.into_iter().map(|e| e.to_compile_error()).collect()
    }
}
