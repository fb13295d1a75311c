#!/usr/bin/env bash
# Regenerates benchmarks/results/vs-peers/<host>/: w1/ (W1), chat/ (chat at three arrival rates),
# single-stream/ (one 256-token prompt, 128 tokens out, at a time, over HTTP) and serving/ (`kvloom serve`
# against its own offline engine on W1: three alternated rounds of offline, straight to the replica and over
# HTTP): kvloom against vLLM's CPU
# build (offline `LLM` and `vllm serve`) and llama.cpp's `llama-server`, one system after the other in the
# same run, on the same prompt ids. <host> names this CPU (e.g. intel-xeon-amx, amd-epyc-avx512bf16), so
# each kind of host keeps its own figures. Sets the peers up first (minutes, once per machine).
set -euo pipefail
cd "$(dirname "$0")/.."
./dev.sh --help >/dev/null   # creates .venv on a fresh machine (the llama.cpp converter runs in it)
bash benchmarks/peer_setup/vllm.sh >/dev/null
bash benchmarks/peer_setup/llama_cpp.sh >/dev/null
host=$(.venv/bin/python -c "from kvloom.kernels.host_isa import host_isa; print(host_isa().report_key)")
out="benchmarks/results/vs-peers/$host"
./dev.sh bench --workload offline-mixed --strategies continuous,continuous+chunked --peers vllm,vllm-serve,llama.cpp,kvloom-serve \
  --no-roofline --budget-min 0 --out "$out/w1"
./dev.sh bench --workload chat --num-requests 32 --rates 0.5,1,1.5 --strategies "" --peers vllm-serve,kvloom-serve \
  --no-roofline --budget-min 0 --out "$out/chat"
./dev.sh bench --workload single-stream --strategies "" --peers vllm-serve,kvloom-serve \
  --no-roofline --budget-min 0 --out "$out/single-stream"
.venv/bin/python -m kvloom.benchmarks.studies.serving_ratio --rounds 3 --out "$out/serving"
