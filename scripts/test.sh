#!/usr/bin/env bash
# The whole test suite: set up .venv, then lint (ruff), type check (mypy) and run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# the vLLM CPU install the end-to-end vLLM tests run (cached under ~/.cache/ownerserve): built
# here, before pytest, so that a slow first install is not cut short by a test's timeout
.venv/bin/python -m workers.vllm_cpu.setup
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
