#!/usr/bin/env bash
# Set up .venv and run the embedded demo (pass --once to exit after the report).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/ownerserve demo "$@"
