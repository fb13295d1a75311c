#!/usr/bin/env bash
# Regenerates benchmarks/results/vs-peers/ (W1), vs-peers-chat/ (chat at three arrival rates) and
# vs-peers-single/ (one 256-token prompt, 128 tokens out, at a time, over HTTP): kvloom
# against vLLM's CPU build (offline `LLM` and `vllm serve`) and llama.cpp's `llama-server`, one system after
# the other in the same run, on the same prompt ids. Sets the peers up first (minutes, once per machine).
set -euo pipefail
cd "$(dirname "$0")/.."
./dev.sh --help >/dev/null   # creates .venv on a fresh machine (the llama.cpp converter runs in it)
bash benchmarks/peer_setup/vllm.sh >/dev/null
bash benchmarks/peer_setup/llama_cpp.sh >/dev/null
./dev.sh bench --workload offline-mixed --strategies continuous,continuous+chunked --peers vllm,vllm-serve,llama.cpp,kvloom-serve \
  --no-roofline --budget-min 0 --out benchmarks/results/vs-peers
./dev.sh bench --workload chat --num-requests 32 --rates 0.5,1,1.5 --strategies "" --peers vllm-serve,kvloom-serve \
  --no-roofline --budget-min 0 --out benchmarks/results/vs-peers-chat
./dev.sh bench --workload single-stream --strategies "" --peers vllm-serve,kvloom-serve \
  --no-roofline --budget-min 0 --out benchmarks/results/vs-peers-single
