#!/usr/bin/env bash
# Runs the binaries of a package built by scripts/gpu-package.sh (copied into
# the package as run.sh) on the machine it is carried to, from the root of
# the repository's working tree, and writes each step's output under $OUT
# (default gpu-results/) with the exit codes in $OUT/summary.txt. A step that
# fails or runs past its time limit does not stop the others.
#
#   bash gpu-package/run.sh [--device cuda|cpu] [GROUP...]   # default: all
#   bash gpu-package/run.sh [--device cuda|cpu] exec BIN [ARGS...]
#
# Groups: tests (the CUDA integration tests), bench (every policy at GPT-2
# small), train (train_gpt under selective and offload, and in bf16 under
# full), torch (PyTorch's reference at the bench's shape), all (the four),
# and verdict: the CUDA
# tests, the bench with the replay check on remat's checksum kernels and
# without it, PyTorch with eager attention and with SDPA, the same in bf16
# (remat none/full, PyTorch SDPA), the replay check's batch kernels (their
# CUDA test, the bf16 bench with them), then the table of the GPU issues'
# targets, each PASS or FAIL ($OUT/verdict.md; about 5 of its 8 minutes on
# an H100); profile: where a step's time goes, remat's
# `bench --profile` (each nn op, the replay check and the regions, by phase)
# beside torch.profiler's kernels (PyTorch SDPA), at the same shape;
# kernels: the CUDA tests, then the bench and its profile with remat's fused
# kernels (`bench --nn kernels`: attention, GELU's backward) in f32 and bf16;
# tc: the CUDA tests, the bench in bf16, f32 and f16 beside PyTorch SDPA in
# the same dtype, the profile in bf16 and f32, and Nsight Compute's time of
# every kernel of one plain bf16 step (if ncu is there); batches: the replay
# check's batch kernels (opt-in until they pass here): their CUDA test, then
# the bench's full recompute checked and unchecked in bf16 and f32 with the
# one-value kernels and with the batches:
#
#   bash gpu-package/run.sh verdict profile
#
# Every call first writes env.txt (nvidia-smi, the libraries each binary resolves, torch's version).
# `exec` runs one binary of the package (e.g. qwen2, if packaged) with ARGS.
#
# --device cuda (default) takes the CUDA libraries from the pip packages of
# python3's PyTorch and libcuda.so.1 from the driver. --device cpu runs the
# same steps at a small shape against the package's stub libraries, whose
# every function aborts: the CPU path of the CUDA-built binaries must not
# call CUDA at all, and this checks it on a machine without a driver. The
# CUDA tests need a GPU, so on a CPU they are only listed.
set -euo pipefail

pkg=$(cd "$(dirname "$0")" && pwd)
cd "$pkg/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

device=cuda
if [ "${1:-}" = --device ]; then
  device=${2:?--device needs cuda or cpu}
  shift 2
fi
case $device in
  cuda | cpu) ;;
  *) echo "unknown device '$device': cuda or cpu" >&2; exit 2 ;;
esac

bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
tar -xJf "$pkg/bin.tar.xz" -C "$bin"

if [ "$device" = cuda ]; then
  # PyTorch's CUDA libraries: every lib/ folder of its nvidia-* packages
  # (nvidia/cu13/lib for CUDA 13, nvidia/<name>/lib before).
  # (None where PyTorch's CUDA comes from a system-wide toolkit instead.)
  libs=$(python3 - 2>/dev/null <<'EOF' || true
import glob, os, nvidia
dirs = {os.path.dirname(so) for p in nvidia.__path__
        for so in glob.glob(os.path.join(p, "*", "lib", "*.so*"))}
print(":".join(sorted(dirs)))
EOF
  )
  if [ -d /usr/local/cuda/lib64 ]; then libs="$libs:/usr/local/cuda/lib64"; fi
  # The driver's libcuda.so.1, where the loader's cache does not know it.
  if [[ $(ldconfig -p) != *"libcuda.so.1 "* ]]; then
    for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu; do
      [ -e "$d/libcuda.so.1" ] && libs="$libs:$d"
    done
  fi
  shape=(--layers 12 --d-model 768 --heads 12 --seq 1024 --batch 8)
  steps=(--steps 10 --warmup 2)
  policies=none,full,selective,offload,save-all,budget=0.25,budget=0.5,budget=0.75
  train=(--steps 200)
  tests=(--nocapture --test-threads=1)
  verdict_steps=(--steps 5 --warmup 2)
else
  libs=$bin/stubs
  shape=(--layers 2 --d-model 64 --heads 2 --seq 32 --batch 4)
  steps=(--steps 3 --warmup 1)
  policies=none,full,selective,offload,save-all,budget=0.5
  train=(--steps 20 "${shape[@]}" --sample 50)
  tests=(--list)
  verdict_steps=(--steps 2 --warmup 1)
fi
# No empty entries: an empty entry of LD_LIBRARY_PATH is the current folder.
libs=$(tr -s ':' <<<"$libs" | sed 's/^://; s/:$//')
# Our binaries get these libraries; python3 keeps its own (the stubs would
# shadow PyTorch's CUDA libraries).
with_libs=(env "LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
export PYTHONUNBUFFERED=1

if [ "${1:-}" = exec ]; then
  shift
  name=${1:?exec needs a binary: $(ls "$bin/bin")}
  shift
  "${with_libs[@]}" "$bin/bin/$name" "$@"
  exit
fi

groups=("$@")
if [ ${#groups[@]} -eq 0 ] || [ "${groups[*]}" = all ]; then
  groups=(tests bench train torch)
fi
for group in "${groups[@]}"; do
  case $group in
    tests | bench | train | torch | verdict | profile | kernels | tc | batches) ;;
    *) echo "unknown group '$group': tests, bench, train, torch, verdict, profile, kernels, tc, batches or all" >&2; exit 2 ;;
  esac
done

# step NAME SECONDS CMD...: runs CMD with its output in $OUT/NAME.txt (the
# command on the first line), killed after SECONDS, and adds its exit code
# (124: timed out) and duration to $OUT/summary.txt.
failed=0
: >"$OUT/summary.txt"
step() {
  local name=$1 limit=$2 start=$SECONDS rc=0
  shift 2
  echo "\$ $*" >"$OUT/$name.txt"
  timeout -k 10 "$limit" "$@" >>"$OUT/$name.txt" 2>&1 || rc=$?
  printf '%-22s rc=%-3s %4ss\n' "$name" "$rc" $((SECONDS - start)) | tee -a "$OUT/summary.txt"
  [ "$rc" = 0 ] || failed=$((failed + 1))
}

{
  date -u
  uname -a
  echo "device: $device"
  echo "binaries run with: ${with_libs[*]}"
  cat "$pkg/BUILD.txt"
  if [ "$device" = cuda ]; then nvidia-smi || true; fi
  python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda,
              "GPU available:", torch.cuda.is_available())' || true
  for b in "$bin"/bin/*; do
    echo "== ldd ${b##*/}"
    "${with_libs[@]}" ldd "$b" || true
    # Linked with BIND_NOW: a function missing from a library fails the start.
    "${with_libs[@]}" "$b" --help >/dev/null && echo "starts: every symbol resolves"
  done
} >"$OUT/env.txt" 2>&1

for group in "${groups[@]}"; do
  case $group in
    tests)
      step cuda-tests 540 "${with_libs[@]}" "$bin/bin/cuda-tests" "${tests[@]}"
      step cuda-views 120 env REMAT_REPLAY_VIEWS=1 "${with_libs[@]}" "$bin/bin/cuda-tests" \
        "${tests[@]}" --ignored a_replay_reads_views_in_the_forwards_layout ;;
    bench)
      step bench 540 "${with_libs[@]}" "$bin/bin/bench" --device "$device" "${shape[@]}" "${steps[@]}" \
        --policies "$policies" --out "$OUT/bench" ;;
    train)
      for policy in selective offload; do
        step "train_gpt-$policy" 240 "${with_libs[@]}" "$bin/bin/train_gpt" --device "$device" \
          --policy "$policy" "${train[@]}"
      done
      # bf16 from f32 master weights, the way GPUs train.
      step train_gpt-bf16 240 "${with_libs[@]}" "$bin/bin/train_gpt" --device "$device" \
        --policy full --dtype bf16 "${train[@]}" ;;
    torch)
      step torch 300 python3 scripts/torch_reference.py --device "$device" "${shape[@]}" \
        "${steps[@]}" --out "$OUT/torch" ;;
    verdict)
      step cuda-tests 240 "${with_libs[@]}" "$bin/bin/cuda-tests" "${tests[@]}"
      step cuda-views 120 env REMAT_REPLAY_VIEWS=1 "${with_libs[@]}" "$bin/bin/cuda-tests" \
        "${tests[@]}" --ignored a_replay_reads_views_in_the_forwards_layout
      step bench 240 "${with_libs[@]}" "$bin/bin/bench" --device "$device" "${shape[@]}" \
        "${verdict_steps[@]}" --policies none,full,selective,budget=0.5 \
        --unchecked full,selective,budget=0.5 --checksum kernels --out "$OUT/bench"
      for attention in eager sdpa; do
        step "torch-$attention" 120 python3 scripts/torch_reference.py --device "$device" \
          "${shape[@]}" "${verdict_steps[@]}" --attention "$attention" --out "$OUT/torch-$attention"
      done
      # bf16, the dtype GPUs train in: remat and PyTorch SDPA.
      step bench-bf16 120 "${with_libs[@]}" "$bin/bin/bench" --device "$device" "${shape[@]}" \
        "${verdict_steps[@]}" --dtype bf16 --policies none,full --unchecked full \
        --checksum kernels --out "$OUT/bench-bf16"
      step torch-sdpa-bf16 120 python3 scripts/torch_reference.py --device "$device" \
        "${shape[@]}" "${verdict_steps[@]}" --dtype bf16 --attention sdpa --out "$OUT/torch-sdpa-bf16"
      # The replay check's batch kernels (opt-in until this passes).
      step cuda-batches 120 "${with_libs[@]}" "$bin/bin/cuda-tests" \
        "${tests[@]}" --ignored checksum_batches_give_the_cpu_bits
      step bench-batches-bf16 120 "${with_libs[@]}" "$bin/bin/bench" --device "$device" \
        "${shape[@]}" "${verdict_steps[@]}" --dtype bf16 --policies none,full --unchecked full \
        --checksum batches --out "$OUT/bench-batches-bf16"
      python3 "$pkg/verdict.py" "$OUT" 2>&1 | tee "$OUT/verdict.txt" || true ;;
    profile)
      step bench-profile 150 "${with_libs[@]}" "$bin/bin/bench" --device "$device" "${shape[@]}" \
        --steps 2 --warmup 1 --profile true --policies none,full --unchecked full \
        --checksum kernels --out "$OUT/bench-profile"
      step torch-profile 90 python3 scripts/torch_reference.py --device "$device" "${shape[@]}" \
        --steps 2 --warmup 1 --attention sdpa --profile --out "$OUT/torch-profile" ;;
    kernels)
      # remat's fused attention kernels: the CUDA tests, then the bench and
      # its profile in f32 and bf16 with them, beside the composed path.
      step cuda-tests 240 "${with_libs[@]}" "$bin/bin/cuda-tests" "${tests[@]}"
      for dtype in f32 bf16; do
        step "bench-kernels-$dtype" 150 "${with_libs[@]}" "$bin/bin/bench" --device "$device" \
          "${shape[@]}" "${verdict_steps[@]}" --dtype "$dtype" --nn kernels \
          --policies none,full --unchecked full --out "$OUT/bench-kernels-$dtype"
        step "profile-kernels-$dtype" 120 "${with_libs[@]}" "$bin/bin/bench" --device "$device" \
          "${shape[@]}" --steps 2 --warmup 1 --dtype "$dtype" --nn kernels --profile true \
          --policies none,full --out "$OUT/profile-kernels-$dtype"
      done
      step torch-profile-bf16 90 python3 scripts/torch_reference.py --device "$device" "${shape[@]}" \
        --steps 2 --warmup 1 --dtype bf16 --attention sdpa --profile --out "$OUT/torch-profile-bf16" ;;
    batches)
      step cuda-batches 120 "${with_libs[@]}" "$bin/bin/cuda-tests" \
        "${tests[@]}" --ignored checksum_batches_give_the_cpu_bits
      for dtype in bf16 f32; do
        for checksum in kernels batches; do
          step "bench-$checksum-$dtype" 120 "${with_libs[@]}" "$bin/bin/bench" --device "$device" \
            "${shape[@]}" "${verdict_steps[@]}" --dtype "$dtype" --policies none,full --unchecked full \
            --checksum "$checksum" --out "$OUT/bench-$checksum-$dtype"
        done
      done ;;
    tc)
      step cuda-tests 240 "${with_libs[@]}" "$bin/bin/cuda-tests" "${tests[@]}"
      for dtype in bf16 f32 f16; do
        step "bench-$dtype" 120 "${with_libs[@]}" "$bin/bin/bench" --device "$device" "${shape[@]}" \
          "${verdict_steps[@]}" --dtype "$dtype" --policies none,full --unchecked full \
          --out "$OUT/bench-$dtype"
        step "torch-$dtype" 90 python3 scripts/torch_reference.py --device "$device" "${shape[@]}" \
          "${verdict_steps[@]}" --dtype "$dtype" --attention sdpa --out "$OUT/torch-$dtype"
      done
      for dtype in bf16 f32; do
        step "profile-$dtype" 120 "${with_libs[@]}" "$bin/bin/bench" --device "$device" \
          "${shape[@]}" --steps 2 --warmup 1 --dtype "$dtype" --profile true \
          --policies none,full --out "$OUT/profile-$dtype"
      done
      # Nsight Compute over one plain bf16 step: every kernel's device time.
      ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || true)
      if [ "$device" = cuda ] && [ -n "$ncu" ]; then
        step ncu-bf16 150 "${with_libs[@]}" "$ncu" --csv --metrics gpu__time_duration.sum \
          --log-file "$OUT/ncu-bf16.csv" "$bin/bin/bench" --device cuda "${shape[@]}" --steps 1 \
          --warmup 0 --dtype bf16 --policies none --out "$OUT/ncu-bench"
        python3 scripts/gpu/ncu_top.py "$OUT/ncu-bf16.csv" 40 >"$OUT/ncu-bf16-top.txt" 2>&1 || true
        rm -f "$OUT/ncu-bf16.csv"
      fi ;;
  esac
done
echo "results in $OUT/; $failed step(s) failed"
[ "$failed" = 0 ]
