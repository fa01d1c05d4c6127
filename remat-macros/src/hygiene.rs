//! Hygiene: which expansion wrote a name. Inside a `macro_rules!` macro, a
//! name the template writes (`let h = ...`) and a name the caller passes
//! in (`$x` = `h`) are two bindings although they are spelt alike; rustc
//! keeps them apart by their spans' syntax contexts, and so must the
//! analysis, or a statement's read of the caller's `h` is taken for a read
//! of the template's.
//!
//! `proc_macro` offers no comparison of syntax contexts on stable Rust, but
//! the compiler's `Debug` form of a span begins with its context (`#4
//! bytes(111..112)`). Where it does not (another compiler, or
//! `proc_macro2`'s fallback in unit tests), every name counts as written in
//! one context.

use proc_macro2::Span;

/// The syntax context of `span`, if the compiler shows it.
pub(crate) fn context(span: Span) -> Option<u32> {
    let shown = format!("{span:?}");
    let digits = shown.strip_prefix('#')?;
    let end = digits.find(|c: char| !c.is_ascii_digit())?;
    digits[..end].parse().ok()
}

/// Two mentions of `name`, at `a` and `b`, may be the same binding: their
/// contexts are equal, or one is not known.
pub(crate) fn same(a: Span, b: Span) -> bool {
    match (context(a), context(b)) {
        (Some(x), Some(y)) => x == y,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outside_the_compiler_every_name_shares_one_context() {
        assert_eq!(context(Span::call_site()), None);
        assert!(same(Span::call_site(), Span::mixed_site()));
    }
}
