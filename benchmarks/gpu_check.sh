#!/usr/bin/env bash
# The prepared device check (issue 51), for one GPU machine and under 8 minutes, with the image's own python3:
# the CUDA tests (tests/gpu, the Triton kernels and the LoRA path compiled for the device), then
# `python -m kvloom.benchmarks.gpu`.
# Everything lands in $OUT: check.log, nvidia-smi.txt, tests.log, the report (<device>.md and .json).
# Prepare here first: bash benchmarks/gpu_assets.sh; then run through the device tool from the repository root
# with carry [".whl", ".gpu_assets"].
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvloom-gpu-check}
mkdir -p "$OUT"
exec > >(tee "$OUT/check.log") 2>&1
echo "start $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "the carried wheels did not install"; exit 1; }
# the repository root is the package `kvloom`, whatever this copy's folder is called
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/kvloom
export PYTHONPATH=/tmp/site:/tmp/pkg
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
SECONDS=0
timeout 240 python3 -m pytest -q tests/gpu tests/test_triton_kernels.py tests/test_triton_lora.py --timeout 200 > "$OUT/tests.log" 2>&1
echo "tests: exit $? after ${SECONDS}s ($(grep -E 'passed|failed' "$OUT/tests.log" | tail -1))"
SECONDS=0
timeout 300 python3 -m kvloom.benchmarks.gpu --model-dir .gpu_assets/smollm2 --out "$OUT"
echo "benchmark: exit $? after ${SECONDS}s"
