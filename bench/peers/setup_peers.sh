#!/usr/bin/env bash
# Install the peer routers (vllm-router 0.1.17, sglang-router 0.3.2) into their own cached venvs
# under ${OWNERSERVE_CACHE:-$HOME/.cache/ownerserve}/peers/ and print their console scripts.
# Idempotent. Usage: bench/peers/setup_peers.sh [--check] [vllm-router|sglang-router ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
exec "$PY" -m bench.peers.peers "$@"
