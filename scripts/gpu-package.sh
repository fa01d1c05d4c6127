#!/usr/bin/env bash
# Builds, on a machine without a GPU, what a GPU machine without cargo or a
# network runs: the CUDA integration tests of remat-runtime and the examples'
# bench, train_gpt and qwen2, built
# with `--features cuda` for the H100/H200 (sm_90) and a CUDA 13.0 driver,
# compressed into gpu-package/ (git-ignored) with the script that runs them:
#
#   scripts/gpu-package.sh      # about 20 minutes the first time on 2 cores
#                               # (candle's kernels through nvcc), then 2
#   bash gpu-package/run.sh --device cpu    # the same steps on this CPU
#
# gpu-package/run.sh (scripts/gpu/run.sh) says what it runs and how. On the
# GPU machine, from the root of a copy of the working tree with gpu-package/
# in it, the whole answer in one call of under 8 minutes:
#
#   bash gpu-package/run.sh verdict
#        the CUDA tests, the bench at GPT-2 small with the replay check on
#        remat's checksum kernels and without it, PyTorch (eager and SDPA)
#        beside it, and the GPU issues' targets, each PASS or FAIL
#        ($OUT/verdict.md)
#
# or, group by group, in two calls of under 10 minutes each:
#
#   bash gpu-package/run.sh tests train torch
#        the CUDA integration tests (about 1-2 minutes), train_gpt for 200
#        steps under selective and under offload (under a minute each), and
#        PyTorch's reference at the bench's shape (about 1 minute)
#   bash gpu-package/run.sh bench
#        every policy, offload and budget=0.25/0.5/0.75 included, at GPT-2
#        small (12 layers, d_model 768, 12 heads, T 1024, B 8; 2 warm-up + 10
#        measured steps each): estimated 3-5 minutes, each step cut at 9
#   bash gpu-package/run.sh exec qwen2 --device cuda      # one program
#
# Results: $OUT/summary.txt (exit code and seconds of each step; 124 = cut),
# $OUT/<step>.txt (each starting with its command), $OUT/bench/, $OUT/torch/,
# $OUT/env.txt (nvidia-smi, torch, the libraries each binary resolves).
#
# How it builds. nvcc comes from PyPI, pinned to 13.0 (PTX of a newer nvcc
# does not load on the 13.0 driver), in a venv under target/gpu/, the
# separate target folder of these builds. candle links the CUDA libraries
# dynamically (libcuda.so.1 of the driver, cuBLAS, cuRAND, NVRTC, the CUDA
# runtime), none of which this machine has: the binaries link against stubs
# generated here, with the real libraries' sonames and the functions the
# binaries call, found by a first link that ignores unresolved symbols. So
# the binaries' NEEDED entries are those sonames, resolved at run time by the
# GPU machine's driver and PyTorch's CUDA pip packages; no path of the stubs
# stays in them. The stubs also travel, for `run.sh --device cpu`.
set -euo pipefail
cd "$(dirname "$0")/.."

for tool in cargo git python3 gcc nm readelf jq xz; do
  command -v "$tool" >/dev/null || { echo "gpu-package.sh needs $tool" >&2; exit 1; }
done

pkg=gpu-package
export CARGO_TARGET_DIR=target/gpu
export CARGO_PROFILE_RELEASE_STRIP=symbols CUDA_COMPUTE_CAP=90
started=$SECONDS

# nvcc 13.0, every component pinned (a newer nvvm or crt would slip in).
venv=$CARGO_TARGET_DIR/nvcc-venv
if [ ! -x "$venv/bin/nvcc-root" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 \
    nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.88 nvidia-cuda-cccl==13.0.85
  root=$(cd "$venv"/lib/python3*/site-packages/nvidia/cu13 && pwd)
  printf '#!/bin/sh\necho %s\n' "$root" >"$venv/bin/nvcc-root"
  chmod +x "$venv/bin/nvcc-root"
fi
root=$("$venv/bin/nvcc-root")
export PATH="$root/bin:$PATH" CUDA_HOME="$root" CUDA_PATH="$root"
[[ $(nvcc --version) == *"release 13.0,"* ]] || { echo "nvcc is not 13.0" >&2; exit 1; }

# What to build: "crate target-kind target-name packaged-name".
targets=("remat-runtime test cuda cuda-tests" "examples bin bench bench"
  "examples bin train_gpt train_gpt" "examples bin qwen2 qwen2")

# The CUDA libraries candle links (cudarc's and candle-kernels' build
# scripts), by link name, with the sonames of CUDA 13 (driver 580 and
# PyTorch's nvidia-* 13.x packages).
declare -A soname=([cuda]=libcuda.so.1 [cudart]=libcudart.so.13 [cublas]=libcublas.so.13
  [cublasLt]=libcublasLt.so.13 [curand]=libcurand.so.10 [nvrtc]=libnvrtc.so.13)

# Which library defines a function, by its prefix.
library_of() {
  case $1 in
    cublasLt*) echo cublasLt ;;
    cublas*) echo cublas ;;
    curand*) echo curand ;;
    nvrtc*) echo nvrtc ;;
    cuda[A-Z]* | __cuda*) echo cudart ;;
    cu[A-Z]*) echo cuda ;;
    *) return 1 ;;
  esac
}

# make_stubs SYMBOLS-FILE: one stub library per entry of `soname`, defining
# the functions of SYMBOLS-FILE that belong to it; each prints its name and
# aborts (nothing may call CUDA without a GPU), except the CUDA runtime's
# hooks that nvcc-compiled code (candle's MoE kernels) calls when the
# program loads and exits, GPU or not, which do nothing. Written as the
# soname, with lib<name>.so beside it for the linker.
stubs=$PWD/$CARGO_TARGET_DIR/cuda-stubs
make_stubs() {
  rm -rf "$stubs"
  mkdir -p "$stubs"
  local lib sym
  for lib in "${!soname[@]}"; do
    printf '#include <stdio.h>\n#include <stdlib.h>\n' >"$stubs/$lib.c"
    printf 'static void stub(const char *f) {\n  fprintf(stderr, "%%s: a stub of %s called (no CUDA here)\\n", f);\n  abort();\n}\n' \
      "${soname[$lib]}" >>"$stubs/$lib.c"
  done
  while read -r sym; do
    lib=$(library_of "$sym") || { echo "no CUDA library for '$sym'" >&2; return 1; }
    case $sym in
      __cudaRegister* | __cudaUnregister*) printf 'void *%s(void) { return 0; }\n' "$sym" ;;
      *) printf 'void %s(void) { stub("%s"); }\n' "$sym" "$sym" ;;
    esac >>"$stubs/$lib.c"
  done <"$1"
  for lib in "${!soname[@]}"; do
    gcc -shared -fPIC -O1 -Wl,-soname,"${soname[$lib]}" -o "$stubs/${soname[$lib]}" "$stubs/$lib.c"
    ln -s "${soname[$lib]}" "$stubs/lib$lib.so"
  done
}

# link TARGET RUSTC-ARGS...: builds one target against the stubs and prints
# the path of its executable. `cargo rustc` passes the extra arguments to
# that target's final rustc call alone, so the dependencies build once.
link() {
  local crate kind name
  read -r crate kind name _ <<<"$1"
  shift
  cargo rustc --release --locked -p "$crate" --features cuda "--$kind" "$name" \
    --message-format=json-render-diagnostics -- -L "native=$stubs" "$@" |
    jq -r 'select(.reason == "compiler-artifact" and .executable != null) | .executable' | tail -n 1
}

# First link: empty stubs, unresolved symbols allowed; the undefined,
# unversioned dynamic symbols left are the CUDA functions the binaries call.
symbols=$CARGO_TARGET_DIR/cuda-symbols.txt
make_stubs /dev/null
: >"$symbols.all"
for t in "${targets[@]}"; do
  exe=$(link "$t" -C link-arg=-Wl,--unresolved-symbols=ignore-all)
  nm -D --undefined-only "$exe" >>"$symbols.all"
done
awk '$1 == "U" && $2 !~ /@/ { print $2 }' "$symbols.all" | sort -u >"$symbols"
echo "$(wc -l <"$symbols") CUDA functions called"

# Second link: the stubs define them all; a clean link.
make_stubs "$symbols"
rm -rf "$pkg"
mkdir -p "$pkg/bin.tmp/bin" "$pkg/bin.tmp/stubs"
for t in "${targets[@]}"; do
  exe=$(link "$t")
  read -r _ _ _ packaged <<<"$t"
  cp "$exe" "$pkg/bin.tmp/bin/$packaged"
done
for lib in "${!soname[@]}"; do cp "$stubs/${soname[$lib]}" "$pkg/bin.tmp/stubs/"; done

# The binaries must need libcuda.so.1 (else the first link's binary was kept)
# and carry no path to the stubs.
for b in "$pkg"/bin.tmp/bin/*; do
  dynamic=$(readelf -d "$b")
  [[ $dynamic == *"[libcuda.so.1]"* ]] || { echo "$b: does not need libcuda.so.1" >&2; exit 1; }
  if [[ $dynamic == *RPATH* || $dynamic == *RUNPATH* ]] || grep -qF "$stubs" "$b"; then
    echo "$b: holds a path to the stubs" >&2
    exit 1
  fi
done

# One archive: the binaries share candle's PTX, which xz then stores once.
tar -C "$pkg/bin.tmp" -cf - bin stubs | xz -T2 -9 >"$pkg/bin.tar.xz"
cp scripts/gpu/run.sh "$pkg/run.sh"
cp scripts/gpu/verdict.py "$pkg/verdict.py"
(
  echo "built $(date -u +%FT%TZ) from $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . || echo ' with local changes')"
  nvcc --version | grep release
  echo "CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP"
  cd "$pkg/bin.tmp"
  for b in bin/*; do
    echo "$b: $(du -h "$b" | cut -f1), needs $(readelf -d "$b" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p' | tr '\n' ' ')"
  done
) >"$pkg/BUILD.txt"
rm -rf "$pkg/bin.tmp"
cat "$pkg/BUILD.txt"
du -h "$pkg"/*
du -sh "$pkg"
echo "built in $(((SECONDS - started) / 60)) min"
