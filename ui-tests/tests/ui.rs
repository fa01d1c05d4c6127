//! The macro's contract: the errors for what does not compile, pinned by
//! reviewed `.stderr` files (what compiles, and runs, is in `lint.rs`:
//! a trybuild pass case would make trybuild build every dependency again,
//! with code generation, where compile-fail cases only check them).
//! `TRYBUILD=overwrite cargo test -p ui-tests --test ui` regenerates them.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/fail/*.rs");
}

/// Every name `remat_runtime::__private` exports or defines (the
/// macro's internals), read from its sources so that the list cannot go
/// stale; less those it re-exports from the public, documented
/// `remat_runtime::rules` (whose traits rustc names in its own words, "the
/// trait `Readable` is not implemented", which no attribute can change).
fn private_names() -> Vec<String> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../remat-runtime/src/private");
    let mut names = std::collections::BTreeSet::new();
    let ident = |w: &str| {
        w.trim_matches(|c: char| !(c.is_alphanumeric() || c == '_'))
            .to_string()
    };
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        // `pub use path::{A, B, C::*};` (the whole statement, over lines).
        for stmt in text.split("pub use ").skip(1) {
            let stmt = &stmt[..stmt.find(';').unwrap_or(stmt.len())];
            if stmt.starts_with("crate::rules") || stmt.starts_with("std::") {
                continue;
            }
            let list = stmt.rsplit("::{").next().unwrap_or(stmt);
            for item in list.split(',') {
                let last = item
                    .trim()
                    .trim_end_matches('}')
                    .rsplit("::")
                    .next()
                    .unwrap_or("");
                let name = ident(last);
                if name.len() > 2 && name != "self" {
                    names.insert(name);
                }
            }
        }
        // `pub struct X`, `pub trait X`, `pub enum X`, `pub type X`.
        for kind in ["pub struct ", "pub trait ", "pub enum ", "pub type "] {
            for rest in text.split(kind).skip(1) {
                let name = ident(
                    rest.split([' ', '<', '(', '{', ';', ':'])
                        .next()
                        .unwrap_or(""),
                );
                if !name.is_empty() {
                    names.insert(name);
                }
            }
        }
    }
    names.into_iter().collect()
}

/// No error a user can get names the macro's internals (anything
/// `__private` exports or defines, quoted or in a path, and the names it
/// generates) or points into remat's sources.
#[test]
fn no_error_names_the_macros_internals() {
    let items = private_names();
    assert!(
        [
            "BlockRegion",
            "ByTensors",
            "CheckPlain",
            "Probe",
            "NotClone"
        ]
        .iter()
        .all(|n| items.iter().any(|i| i == n)),
        "the private names were not read: {items:?}"
    );
    let mut internal: Vec<String> = items
        .iter()
        .flat_map(|n| {
            [
                format!("`{n}`"),
                format!("`{n}<"),
                format!("::{n}"),
                format!("{n}<"),
            ]
        })
        .collect();
    internal.extend(
        [
            "__remat",
            "__private",
            "private/",
            "private.rs",
            "$WORKSPACE/remat-",
        ]
        .map(String::from),
    );
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/ui/fail");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "stderr") {
            let text = std::fs::read_to_string(&path).unwrap();
            for name in &internal {
                assert!(
                    !text.contains(name.as_str()),
                    "{} mentions `{name}`:\n{text}",
                    path.display()
                );
            }
            checked += 1;
        }
    }
    assert!(
        checked >= 30,
        "only {checked} .stderr files found in {}",
        dir.display()
    );
}
