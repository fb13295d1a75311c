#!/usr/bin/env bash
# Sets up the OpenAI-API clients nobody on this project wrote (the `openai` package, `litellm`, `guidellm`)
# in a virtual environment of their own, for benchmarks/studies/conformance.py: their pins must not meet kvloom's.
# Idempotent; prints the venv's python when done.
#   bash benchmarks/peer_setup/clients.sh      (venv under ~/.cache/kvloom/peers/clients, or $KVLOOM_PEERS_DIR/clients)
set -euo pipefail
root="${KVLOOM_PEERS_DIR:-$HOME/.cache/kvloom/peers}"
venv="$root/clients"
versions="openai==${OPENAI_VERSION:-3.57.0} litellm${LITELLM_VERSION:+==$LITELLM_VERSION} guidellm==${GUIDELLM_VERSION:-0.8.1}"
stamp="$venv/.installed-$(echo "$versions" | tr ' =' '_-')"
if [[ ! -f $stamp ]]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  # guidellm reads token counts with transformers' tokenizers only: a CPU torch keeps a CUDA one out
  "$venv/bin/pip" install -q torch==2.13.0
  # shellcheck disable=SC2086
  "$venv/bin/pip" install -q $versions
  touch "$stamp"
fi
echo "$venv/bin/python"
