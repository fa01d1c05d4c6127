//! The `remat!` macro: a block of candle code compiled into a checkpointed
//! region. Use it through `remat_runtime`, which re-exports it and documents
//! it; this crate holds the implementation:
//!
//! * `model`: what a block is once parsed (function, parameters,
//!   statements, annotations);
//! * `parse`: the token stream to the model, refusing what the model cannot
//!   hold (`receiver`: a method's `self`; `attributes` reads our
//!   annotations);
//! * `checks`: the refusals that read the model alone, in one pass
//!   (signature, annotations' places, `return`, the result);
//! * `analyse`: names, static dataflow (who reads which binding), early
//!   drops, and the refusals that need them (`plain`: the `let`s that run
//!   as plain code; `usage`: what a statement's syntax does with the names
//!   it mentions; `scopes`: which of them are the block's, after the names
//!   the statement binds itself; `fields`: the parameters' fields it reads
//!   in place; `hygiene`: which expansion wrote a name);
//! * `generate`: the code, a forward-and-replay body for
//!   `remat_runtime::Region`.
//!
//! Every error of a block is reported at once; the expansion then still
//! emits the function with a body that never runs, so that one mistake does
//! not cascade into errors at every call site.

mod analyse;
mod attributes;
mod checks;
mod derive;
mod errors;
mod fields;
mod generate;
mod host;
mod hygiene;
mod model;
mod parse;
mod plain;
mod receiver;
mod scopes;
mod usage;

use proc_macro2::{Ident, Span, TokenStream};

/// The identifier `name` as the user wrote it, a raw one (`r#type`)
/// included, which `Ident::new` refuses.
pub(crate) fn ident(name: &str, span: Span) -> Ident {
    match name.strip_prefix("r#") {
        Some(raw) => Ident::new_raw(raw, span),
        None => Ident::new(name, span),
    }
}

/// See `remat_runtime::remat`.
#[proc_macro]
pub fn remat(input: proc_macro::TokenStream) -> proc_macro::TokenStream {
    expand(input.into()).into()
}

/// See `remat_runtime::Outputs`.
#[proc_macro_derive(Outputs, attributes(outputs))]
pub fn derive_outputs(input: proc_macro::TokenStream) -> proc_macro::TokenStream {
    derive::outputs(input.into()).into()
}

/// The whole pipeline over `proc_macro2` tokens, for tests and fuzzing.
fn expand(input: TokenStream) -> TokenStream {
    let blocks = match parse::parse(input) {
        Ok(blocks) => blocks,
        Err(e) => return e.to_compile_error(),
    };
    let mut out = TokenStream::new();
    let mut errors = errors::Errors::default();
    for (block, mut refused) in blocks {
        checks::check(&block, &mut refused);
        let analysis = analyse::analyse(&block, &mut refused);
        if refused.is_empty() {
            out.extend(generate::generate(&block, &analysis));
        } else {
            out.extend(generate::stub(&block));
        }
        errors.append(refused);
    }
    out.extend(errors.into_compile_errors());
    out
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod fuzz;
