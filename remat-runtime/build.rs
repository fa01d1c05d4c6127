//! With the `cuda` feature: compiles remat's CUDA kernels (the checksum of
//! the replay check, `src/tape/checksum/checksum.cu`; fused attention, the
//! norms and GELU's backward, `src/nn/kernels/`) to PTX with nvcc, embedded in the
//! library, as candle builds its own kernels. Without it: nothing.

use std::path::PathBuf;
use std::process::Command;

/// Each kernel source and the PTX file it becomes in `OUT_DIR`.
const SOURCES: [(&str, &str); 6] = [
    ("src/tape/checksum/checksum.cu", "checksum.ptx"),
    ("src/nn/kernels/attention.cu", "attention.ptx"),
    ("src/nn/kernels/attention_tc.cu", "attention_tc.ptx"),
    ("src/nn/kernels/gelu.cu", "gelu.ptx"),
    ("src/nn/kernels/norm.cu", "norm.ptx"),
    ("src/nn/kernels/bias.cu", "bias.ptx"),
];

fn main() {
    for (source, _) in SOURCES {
        println!("cargo:rerun-if-changed={source}");
    }
    println!("cargo:rerun-if-changed=src/nn/kernels/elements.cuh");
    println!("cargo:rerun-if-changed=src/nn/kernels/attention.cuh");
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
    for (source, ptx) in SOURCES {
        let status = Command::new(&nvcc)
            .args([
                "--ptx",
                "-O3",
                "-std=c++17",
                &format!("-arch=compute_{cap}"),
            ])
            .arg(source)
            .arg("-o")
            .arg(out.join(ptx))
            .status()
            .unwrap_or_else(|e| panic!("the `cuda` feature needs nvcc ({nvcc}): {e}"));
        assert!(status.success(), "nvcc failed on {source}");
    }
}
