"""Trace replay against one real emulated engine: the trace's prefix-sharing ratio shows up in the
engine's own prefix-cache metrics (within 5%), and the generated workloads run cleanly."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadgen.client import RunOptions, run_workload
from loadgen.cluster import ManagedProcess, wait_healthy
from loadgen.metrics import snapshot_all
from loadgen.text import template_overhead
from loadgen.trace import TraceRequest, TraceScaling, load_trace, prefix_sharing, trace_workload
from loadgen.workloads import generate
from ownerserve.ports import free_port

SHARED_TRACE = Path(__file__).resolve().parents[2] / "data" / "mooncake_synthetic_trace.jsonl"
MODEL = "ownerserve-tiny"


@pytest.fixture
def emulator(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    proc = ManagedProcess(
        "emulator",
        [
            sys.executable,
            "-m",
            "workers.emulator",
            "--role",
            "hybrid",
            "--port",
            str(port),
            "--profile",
            "fast-test",
            "--model",
            MODEL,
            "--num-blocks",
            "60000",
        ],
        tmp_path / "emulator.log",
    ).start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy([(proc, url)], timeout_s=60)
        yield url
    finally:
        proc.stop()


def _rows() -> list[TraceRequest]:
    if SHARED_TRACE.exists():
        # a window late in the trace, where sharing is high (about 36%)
        return load_trace(SHARED_TRACE, start=3500, limit=120)
    pytest.skip("shared Mooncake trace not present")


async def test_trace_replay_reproduces_the_traces_prefix_sharing_at_the_server(
    emulator: str,
) -> None:
    rows = _rows()
    scaling = TraceScaling(block_tokens=32, max_output=2, time_scale=0.0)
    expected = prefix_sharing(rows, scaling)
    assert expected > 0.2
    workload = trace_workload(rows, scaling)
    # one request at a time, in trace order: the server sees the trace's order exactly
    res = await run_workload(
        workload, RunOptions(target=emulator, model=MODEL, max_inflight=1, progress=False)
    )
    assert all(r.ok for r in res.requests), [r.error for r in res.requests if r.error][:3]
    (snap,) = await snapshot_all([emulator], with_hashes=False)
    queries = snap.get("vllm:prefix_cache_queries_total")
    hits = snap.get("vllm:prefix_cache_hits_total")
    assert queries and hits is not None
    # every prompt has the row's scaled length (rows shorter than the template's own tokens
    # cannot be shorter than the template)
    floor = template_overhead().total + 1
    assert queries == sum(max(scaling.input_tokens(r), floor) for r in rows)
    measured = hits / queries
    assert measured == pytest.approx(expected, rel=0.05)
    # the engine's usage agrees with its metrics
    assert sum(r.prompt_tokens for r in res.requests) == queries


async def test_generated_mixed_workload_runs_without_errors(emulator: str) -> None:
    w = generate("mixed", seed=2, scale=0.2).scaled(0.02)
    res = await run_workload(w, RunOptions(target=emulator, model=MODEL, progress=False))
    assert res.requests and all(r.ok for r in res.requests)
    assert all(s.completed for s in res.sessions)
    # later turns of a session reuse its earlier prompt from the engine's cache
    later = [r for r in res.requests if r.step > 0]
    assert sum(r.cached_tokens for r in later) > 0.8 * sum(r.prompt_tokens for r in later)
