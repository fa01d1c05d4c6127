//! With the `cuda` feature: compiles the checksum kernels
//! (`src/tape/checksum/checksum.cu`) to PTX with nvcc, embedded in the
//! library, as candle builds its own kernels. Without it: nothing.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let source = "src/tape/checksum/checksum.cu";
    println!("cargo:rerun-if-changed={source}");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    // PTX for the build's compute capability (candle's variable; the JIT
    // runs it on any newer GPU), 8.0 when unset.
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    let cap: String = cap.chars().filter(char::is_ascii_digit).collect();
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| match std::env::var("CUDA_HOME") {
        Ok(home) => format!("{home}/bin/nvcc"),
        Err(_) => "nvcc".into(),
    });
    let ptx = out.join("checksum.ptx");
    let status = Command::new(&nvcc)
        .args([
            "--ptx",
            "-O3",
            "-std=c++17",
            &format!("-arch=compute_{cap}"),
        ])
        .arg(source)
        .arg("-o")
        .arg(&ptx)
        .status()
        .unwrap_or_else(|e| panic!("the `cuda` feature needs nvcc ({nvcc}): {e}"));
    assert!(status.success(), "nvcc failed on {source}");
}
