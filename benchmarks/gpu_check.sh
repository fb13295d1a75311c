#!/usr/bin/env bash
# The prepared device check (issues 51, 74, 72) for one GPU machine, with the image's own python3, in phases each
# bounded and logged on its own, their limits adding up to under 6 minutes (a rerun fits 15 minutes of device
# time): the carried wheels installed; kvloom's C++ CPU kernels built (the CPU engine is the reference the CUDA
# tests compare with: building them inside a test's timeout was how the old check ran out of time); the CUDA
# tests (tests/gpu, the Triton attention, LoRA and quantized GEMM kernels compiled for the device); `python -m
# kvloom.benchmarks.gpu`.
# Everything lands in $OUT: check.log, nvidia-smi.txt, engine-tests.log, kernel-tests.log, the report (<device>.md
# and .json), profile-*.txt.
# Prepare here first: bash benchmarks/gpu_assets.sh; then run through the device tool from the repository root
# with carry [".whl", ".gpu_assets"].
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvloom-gpu-check}
mkdir -p "$OUT"
exec > >(tee "$OUT/check.log") 2>&1
echo "start $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
# the repository root is the package `kvloom`, whatever this copy's folder is called
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/kvloom
export PYTHONPATH=/tmp/site:/tmp/pkg PYTHONUNBUFFERED=1

phase() {  # phase NAME SECONDS COMMAND...: run COMMAND for at most SECONDS, log its exit and time
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  timeout "$limit" "$@"
  local status=$?
  echo "phase $name: exit $status after $((SECONDS - start))s of ${limit}s"
  return $status
}

export KVLOOM_SOURCE_COMMIT=$(cat .gpu_assets/commit 2>/dev/null || echo unknown)
echo "source commit $KVLOOM_SOURCE_COMMIT"
phase install 15 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || { echo "the carried wheels did not install"; exit 1; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
phase build 40 python3 -m kvloom.kernels.cpu_extensions
# two test phases, each well inside its limit, so each prints its own summary (a phase cut off prints none)
tests() {  # tests NAME FILES...: verbose, failures in short form, into $OUT/NAME.log
  local name=$1
  shift
  phase "$name" "$TESTS_LIMIT" python3 -m pytest -v --tb=short --durations=5 --timeout 60 "$@" > "$OUT/$name.log" 2>&1
  echo "$name: $(grep -E 'passed|failed' "$OUT/$name.log" | tail -1)"
}
TESTS_LIMIT=85 tests engine-tests tests/gpu
TESTS_LIMIT=85 tests kernel-tests tests/test_triton_quant_gemm.py tests/test_triton_kernels.py tests/test_triton_lora.py
phase benchmark 130 python3 -m kvloom.benchmarks.gpu --model-dir .gpu_assets/smollm2 --out "$OUT"
echo "end $(date -u +%FT%TZ)"
