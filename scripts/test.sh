#!/usr/bin/env bash
# The whole test suite: set up .venv, then lint (ruff), type check (mypy) and run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
