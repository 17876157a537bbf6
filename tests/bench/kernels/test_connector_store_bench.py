"""`bench/kernels/connector_store.py` runs end to end on CPU tensors (a smoke test, not a
measurement; the numbers come from a GPU host): every placement's checks pass (bit-exact loads,
TP-mismatch loads; the zero-copy ones' objects and digests, per head and grouped), every timed
part has its row, the report file is written; without CUDA the default run says it skipped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.bench import run_bench
from workers.mooncake_store import MasterUnavailable, find_master_binary


def test_the_store_bench_runs_its_cpu_smoke_and_writes_the_report(tmp_path: Path) -> None:
    try:
        find_master_binary()
    except MasterUnavailable as exc:
        pytest.skip(f"mooncake_master cannot run here: {exc}")
    out_file = tmp_path / "store.md"
    argv = ["--device", "cpu", "--small", "--reps", "1", "--digest-threads", "2"]
    out = run_bench("bench.kernels.connector_store", [*argv, "--out", str(out_file)], 300)
    assert "checks: all passed" in out, out
    for placement in ("own segment", "sidecar segment"):
        checks = [line for line in out.splitlines() if line.startswith(f"check {placement}:")]
        assert len(checks) == 4 and all(c.endswith(": ok") for c in checks), out
        rows = [line for line in out.splitlines() if line.startswith(f"| {placement}:")]
        assert len(rows) == 9, out
        assert "save end to end" in rows[0] and "load end to end" in rows[5]
    checks = [line for line in out.splitlines() if line.startswith("check zero copy:")]
    assert len(checks) == 7 and all(c.endswith(": ok") for c in checks), out
    rows = [line for line in out.splitlines() if line.startswith("| zero copy:")]
    assert len(rows) == 21, out
    assert "save end to end" in rows[0] and "load end to end, replicas cached" in rows[10]
    checks = [line for line in out.splitlines() if line.startswith("check grouped by 8:")]
    assert len(checks) == 7 and all(c.endswith(": ok") for c in checks), out
    rows = [line for line in out.splitlines() if line.startswith("| grouped by 8:")]
    assert len(rows) == 18, out
    assert "save end to end" in rows[0] and "load end to end, replicas cached" in rows[9]
    assert out_file.read_text().splitlines()[-1] == "checks: all passed"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA: the bench would run")
def test_the_store_bench_skips_with_a_clear_message_without_cuda() -> None:
    out = run_bench("bench.kernels.connector_store", [], 60)
    assert "skipped, no CUDA device" in out
