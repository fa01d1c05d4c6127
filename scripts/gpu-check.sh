#!/usr/bin/env bash
# Builds remat with `--features cuda` on a machine with an NVIDIA GPU, runs
# the CUDA tests, the benchmark and a short training run on the GPU, and
# writes everything to $OUT (default gpu-results/).
#
#   scripts/gpu-check.sh            # needs network for crates and, without
#                                   # a CUDA toolkit, for pip's nvcc
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"

if ! command -v nvcc >/dev/null; then
  # nvcc 13.2 from PyPI (about 114 MB of wheels); Debian's 11.8 toolkit
  # cannot target sm_90.
  python3 -m venv .cuda-venv
  .cuda-venv/bin/pip install -q "cuda-toolkit[nvcc,cccl]==13.2.2"
  CUDA_ROOT=$(cd .cuda-venv/lib/python3*/site-packages/nvidia/cu13 && pwd)
  export PATH="$CUDA_ROOT/bin:$PATH" CUDA_HOME="$CUDA_ROOT" CUDA_PATH="$CUDA_ROOT"
fi
if [ -z "${CUDA_COMPUTE_CAP:-}" ]; then
  CUDA_COMPUTE_CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
fi
export CUDA_COMPUTE_CAP
nvidia-smi | tee "$OUT/nvidia-smi.txt"
nvcc --version | tee "$OUT/nvcc.txt"

cargo test --release -p remat-runtime --features cuda --test cuda -- --nocapture 2>&1 \
  | tee "$OUT/cuda-tests.txt"
# The paper-sized shape of docs/performance.md's GPU table, offload included.
cargo run --release -p examples --features cuda --bin bench -- --device cuda \
  --layers 12 --d-model 768 --heads 12 --seq 1024 --batch 8 \
  --policies none,full,selective,offload,save-all,budget=0.5 --out "$OUT/bench" 2>&1 \
  | tee "$OUT/bench.txt"
for policy in selective offload; do
  cargo run --release -p examples --features cuda --bin train_gpt -- --device cuda \
    --policy "$policy" --steps 200 2>&1 | tee "$OUT/train_gpt-$policy.txt"
done
echo "results in $OUT/"
