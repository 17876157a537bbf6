"""Smoke tests of the benchmarks under `bench/`: each runs end to end on a small input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_bench(module: str, argv: list[str], timeout_s: float) -> str:
    """Run `python -m module argv...` from the repository root; its stdout (it must exit 0)."""
    return subprocess.run(
        [sys.executable, "-m", module, *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=True,
    ).stdout
