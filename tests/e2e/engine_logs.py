"""The report hook of the packages that run real engine servers (`tests/e2e/vllm`,
`tests/e2e/sglang`): a failed test carries the tails of its servers' and sidecars' logs in its
report. CI keeps no files, and a worker that crashed says why only in its log. Each package's
conftest imports `pytest_runtest_makereport` from here, so it applies to that package alone.
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path

import pytest

LOG_TAIL_CHARS = 6000
_PARTS = ("server", "sidecar", "prefill", "decode")
"""Attributes naming the processes a fixture's value is made of (a P/D pair, a test's worker)."""


def log_holders(value: object) -> list[object]:
    """`value` and the servers and sidecars it is made of (a P/D pair, a test's workers)."""
    if isinstance(value, tuple | list):
        return [part for v in value for part in log_holders(v)]
    return [value, *(getattr(value, a) for a in _PARTS if hasattr(value, a))]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Append to a failed test's report the log tail of every process its fixtures hold."""
    report = yield
    if report.failed:
        for name, value in getattr(item, "funcargs", {}).items():
            for part in log_holders(value):
                path = getattr(part, "log_path", None)
                if isinstance(path, Path) and path.exists():
                    tail = path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
                    report.sections.append((f"log of {name}: {path.name}", tail))
    return report
