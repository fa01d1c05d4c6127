#!/usr/bin/env bash
# Runs the CUDA tests, the benchmark at GPT-2 small, short training runs and
# PyTorch's reference on a machine with an NVIDIA GPU, writing everything to
# $OUT (default gpu-results/). The GPU machine needs neither cargo nor a
# network: scripts/gpu-package.sh builds the binaries beforehand, elsewhere,
# into gpu-package/, and this runs that package (gpu-package/run.sh, whose
# arguments it takes: [--device cuda|cpu] [tests|bench|train|torch|all...]).
#
#   scripts/gpu-package.sh      # on the build machine
#   scripts/gpu-check.sh        # on the GPU machine, gpu-package/ carried
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f gpu-package/run.sh ]; then
  echo "no gpu-package/: build it with scripts/gpu-package.sh first" >&2
  exit 1
fi
exec bash gpu-package/run.sh "$@"
