#!/usr/bin/env bash
# The whole test suite: set up .venv, then lint (ruff), type check (mypy) and run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# the vLLM CPU install the end-to-end vLLM tests run (cached under ~/.cache/ownerserve): built
# here, before pytest, so that a slow first install is not cut short by a test's timeout
.venv/bin/python -m workers.vllm_cpu.setup
# the SGLang CPU install its end-to-end tests run (same cache; ~2 min cold); where it cannot be
# built here those tests skip and say why, so a failed install does not stop the suite
.venv/bin/python -m workers.sglang_cpu.setup \
  || echo "note: the SGLang CPU install failed; tests/e2e/sglang will skip" >&2
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
