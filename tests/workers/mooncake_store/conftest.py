"""A real `mooncake_master` per test (free loopback ports), skipped only where none can run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.mooncake_store import MasterUnavailable, MooncakeMaster


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    try:
        m = MooncakeMaster(client_ttl_s=2, log_path=tmp_path / "master.log")
        m.start()
    except MasterUnavailable as exc:
        pytest.skip(f"mooncake_master cannot run here: {exc}")
    try:
        yield m
    finally:
        m.stop()
