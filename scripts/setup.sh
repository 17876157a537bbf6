#!/usr/bin/env bash
# Create (or refresh) the project's local virtualenv at .venv with everything the demo and the
# test suite need. Idempotent: a stamp of pyproject.toml skips reinstalling when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
# mooncake.engine needs libibverbs at import (TCP works without RDMA hardware); best effort
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
  && ! ldconfig -p 2>/dev/null | grep 'libibverbs\.so\.1' >/dev/null; then
  { apt-get install -y -q libibverbs1 || { apt-get update -q && apt-get install -y -q libibverbs1; }; } \
    >/dev/null 2>&1 || echo "note: libibverbs1 not installed (the sidecar falls back to TCP)" >&2
fi
# prometheus: the real Prometheus the dashboard test scrapes with (Debian's package, ~15 s
# measured; its service is not started where policy-rc.d forbids it, as in containers); best
# effort: without it that test skips
if ! command -v prometheus >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt_prom() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus; }
  { apt_prom || { apt-get update -q && apt_prom; }; } >/dev/null 2>&1 \
    || echo "note: prometheus not installed (the Grafana dashboard test skips)" >&2
fi
stamp=.venv/.ownerserve-stamp
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # torch first, pinned: on these machines 2.13.0 is a local CPU wheel; anything else pulls CUDA.
  .venv/bin/python -m pip install -q "torch==2.13.0"
  # mooncake: Mooncake Transfer Engine for the sidecar transport (45 MB wheel, ~3 s measured)
  .venv/bin/python -m pip install -q -e ".[dev,kernels,loadgen,mooncake]"
  echo "$want" > "$stamp"
fi
