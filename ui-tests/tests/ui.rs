//! The macro's contract: what compiles (and runs), and the errors for what
//! does not, pinned by reviewed `.stderr` files.
//! `TRYBUILD=overwrite cargo test -p ui-tests --test ui` regenerates them.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/fail/*.rs");
    t.pass("tests/ui/pass/*.rs");
}
