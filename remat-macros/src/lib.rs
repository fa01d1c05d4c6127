//! The `remat!` macro: a block of candle code compiled into a checkpointed
//! region. Use it through `remat_runtime`, which re-exports it and documents
//! it; this crate holds the implementation:
//!
//! * `model`: what a block is once parsed (function, parameters,
//!   statements, annotations);
//! * `parse`: the token stream to the model, with syntax errors collected
//!   (`receiver`: a method's `self`);
//!   `attributes` reads our annotations, `checks` refuses what the replay
//!   could not run faithfully;
//! * `analyse`: names, static dataflow (who reads which binding), early
//!   drops, and the semantic errors (`usage`: what a statement's syntax
//!   does with the names it mentions; `scopes`: which of them are the
//!   block's, after the names the statement binds itself);
//! * `generate`: the code, a forward-and-replay body for
//!   `remat_runtime::Region`.
//!
//! Every error of a block is reported at once; the expansion then still
//! emits the function with a body that never runs, so that one mistake does
//! not cascade into errors at every call site.

mod analyse;
mod attributes;
mod checks;
mod errors;
mod generate;
mod host;
mod model;
mod parse;
mod receiver;
mod scopes;
mod usage;

use proc_macro2::TokenStream;

/// See `remat_runtime::remat`.
#[proc_macro]
pub fn remat(input: proc_macro::TokenStream) -> proc_macro::TokenStream {
    expand(input.into()).into()
}

/// The whole pipeline over `proc_macro2` tokens, for tests and fuzzing.
fn expand(input: TokenStream) -> TokenStream {
    let mut errors = errors::Errors::default();
    let blocks = match parse::parse(input, &mut errors) {
        Ok(blocks) => blocks,
        Err(e) => {
            // With any error collected before it (none today: parsing
            // fails before a block is read), so that none is dropped.
            errors.push_error(e);
            return errors.into_compile_errors();
        }
    };
    let mut out = TokenStream::new();
    for block in &blocks {
        let before = errors.len();
        let analysis = analyse::analyse(block, &mut errors);
        if !block.failed && errors.len() == before {
            out.extend(generate::generate(block, &analysis));
        } else {
            out.extend(generate::stub(block));
        }
    }
    out.extend(errors.into_compile_errors());
    out
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod fuzz;
