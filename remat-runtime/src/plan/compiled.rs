//! The statement names of every `remat!` block compiled into the program.
//!
//! Each block registers its names where it is compiled (one
//! `rt::names!(...)` line in its expansion, gathered at start-up by the
//! `inventory` crate), so that a plan may name a statement of a block that
//! has not run yet (a layer enabled later, an expert no token reached)
//! while a misspelt name, which no block has, is still an error.

/// The names a plan may use for the statements of one `remat!` block.
pub struct StatementNames(pub &'static [&'static str]);

inventory::collect!(StatementNames);

/// Whether some `remat!` block of the program has a statement named `name`.
pub(crate) fn has(name: &str) -> bool {
    names().any(|n| n == name)
}

/// The names of the statements of every `remat!` block of the program.
pub(crate) fn names() -> impl Iterator<Item = &'static str> {
    inventory::iter::<StatementNames>
        .into_iter()
        .flat_map(|n| n.0.iter().copied())
}

/// Registers the names of a block's statements (see the module's doc).
#[doc(hidden)]
#[macro_export]
macro_rules! __remat_statement_names {
    ($($name:literal),* $(,)?) => {
        $crate::__private::inventory::submit! {
            $crate::__private::StatementNames(&[$($name),*])
        }
    };
}
