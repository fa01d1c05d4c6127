//! Compile-fail and compile-pass tests of the `remat!` macro, run with
//! trybuild. The cases land together with the macro; this crate holds the
//! place in the workspace until then.
