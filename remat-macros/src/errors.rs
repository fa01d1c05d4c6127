//! An accumulator of spanned errors, reported together at the end. It must
//! be consumed (as serde_derive's `Ctxt`): dropping one that still holds
//! errors is a bug of the macro, which would have compiled a block it had
//! refused, and panics.

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

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Takes `other`'s errors, after those already here.
    pub fn append(&mut self, mut other: Errors) {
        self.0.append(&mut other.0);
    }

    pub fn into_compile_errors(mut self) -> TokenStream {
        std::mem::take(&mut self.0)
            .into_iter()
            .map(|e| e.to_compile_error())
            .collect()
    }
}

impl Drop for Errors {
    fn drop(&mut self) {
        if !self.0.is_empty() && !std::thread::panicking() {
            panic!(
                "remat!: {} error(s) collected and never reported",
                self.0.len()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "never reported")]
    fn errors_must_be_reported() {
        let mut errors = Errors::default();
        errors.push(Span::call_site(), "refused");
    }

    #[test]
    fn reported_errors_become_compile_errors() {
        let mut errors = Errors::default();
        errors.push(Span::call_site(), "refused");
        let tokens = errors.into_compile_errors().to_string();
        assert!(tokens.contains("compile_error") && tokens.contains("refused"));
        // Nothing to report: dropping is fine.
        drop(Errors::default());
    }
}
