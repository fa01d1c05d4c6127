//! The macro's contract: what compiles (and runs), and the errors for what
//! does not, pinned by reviewed `.stderr` files.
//! `TRYBUILD=overwrite cargo test -p ui-tests --test ui` regenerates them.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/fail/*.rs");
    t.pass("tests/ui/pass/*.rs");
}

/// No error a user can get names the macro's internals or points into
/// remat's sources.
#[test]
fn no_error_names_the_macros_internals() {
    let internal = [
        "Probe",
        "ViaPlain",
        "ViaTensor",
        "ViaClone",
        "Unreadable",
        "__remat",
        "__private",
        "private.rs",
        "$WORKSPACE/remat-",
    ];
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/ui/fail");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "stderr") {
            let text = std::fs::read_to_string(&path).unwrap();
            for name in internal {
                assert!(
                    !text.contains(name),
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
