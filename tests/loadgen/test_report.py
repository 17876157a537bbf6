"""Reports from synthetic run results: statistics, tables, JSON and PNG plots."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from loadgen.client import RequestRecord, RunResult, SessionRecord
from loadgen.plots import plot_runs
from loadgen.report import (
    ClusterStats,
    Dist,
    markdown_tables,
    percentile,
    summarize,
    write_report,
)


def _req(sid: str, step: int, e2e: float, ttft: float, error: str | None = None) -> RequestRecord:
    return RequestRecord(
        session_id=sid,
        step=step,
        kind="agentic",
        label="turn",
        sent_s=float(step),
        e2e_s=e2e,
        ttft_s=None if error else ttft,
        itl_s=() if error else (0.01, 0.02),
        prompt_tokens=0 if error else 100,
        completion_tokens=0 if error else 3,
        cached_tokens=0 if error else 40,
        status=500 if error else 200,
        error=error,
        plan=""
        if error
        else f"policy=x;action={'state_migration' if step else 'colocated_prefill'}",
    )


def _result(label: str, scale: float = 1.0) -> RunResult:
    reqs = (
        _req("a", 0, 0.5 * scale, 0.1 * scale),
        _req("a", 1, 0.3 * scale, 0.05 * scale),
        _req("b", 0, 0.4 * scale, 0.2 * scale),
        _req("c", 0, 0.1, 0.0, error="HTTP 500: boom"),
    )
    sessions = (
        SessionRecord("a", "agentic", "g", 0.0, 0.0, 2.0 * scale, 2, 2, 1.0),
        SessionRecord("b", "agentic", "g", 0.0, 0.0, 1.0 * scale, 1, 1, 0.0),
        SessionRecord("c", "agentic", "g", 0.0, 0.0, 0.1, 1, 0, 0.0, error="HTTP 500: boom"),
    )
    return RunResult(
        label, "agentic", "http://x", "2026-01-01T00:00:00+00:00", 10.0, reqs, sessions, False
    )


def test_percentile_interpolates_and_handles_empty() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)
    d = Dist.of([1.0, 3.0])
    assert d.n == 2 and d.mean == 2.0 and d.p50 == 2.0


def test_summary_counts_errors_and_uses_only_completed_sessions() -> None:
    s = summarize(_result("x"))
    assert s.requests == 4 and s.errors == 1 and s.error_rate == 0.25
    assert s.error_kinds == {"HTTP 500": 1}
    assert s.sessions == 3 and s.sessions_completed == 2
    assert s.session_e2e.mean == pytest.approx(1.5)
    assert s.ttft.n == 3 and s.ttft.p50 == pytest.approx(0.1)
    # TPOT = (e2e - ttft) / (tokens - 1)
    assert s.tpot.p50 == pytest.approx((0.3 - 0.05) / 2)
    assert s.itl.n == 6
    assert s.requests_per_s == pytest.approx(0.3)
    assert s.output_tokens_per_s == pytest.approx(0.9)
    assert s.prompt_tokens == 300 and s.cached_tokens == 120


def test_markdown_tables_show_each_run_and_cluster_columns() -> None:
    c = ClusterStats(
        prompt_tokens=1000,
        prefill_tokens_computed=400,
        prefix_hit_rate=0.6,
        kv_bytes_pd=2_000_000,
        kv_bytes_fetch=None,
        duplicate_factor=1.25,
    )
    a = summarize(_result("ownerserve"), cluster=c)
    b = summarize(_result("static-pd", 2.0))
    md = markdown_tables([a, b])
    lines = md.splitlines()
    assert lines[0].startswith("| run | sessions ok | session E2E mean s")
    row = next(line for line in lines if line.startswith("| ownerserve | 2/3 | 1.50 | 0.50 "))
    assert "1 (25.0%)" in row
    assert any(line.startswith("| static-pd | 2/3 | 3.00 | 0.50 ") for line in lines)
    assert "- ownerserve actions: colocated_prefill 2 (67%), state_migration 1 (33%)" in lines
    # client prompt tokens (300) against the workers' computed tokens (400 here)
    crow = next(
        line for line in lines if line.startswith("| ownerserve | 300 | 400 | 133.3% | 60.0%")
    )
    assert "2.00 MB" in crow and "1.25" in crow
    assert c.kv_bytes_moved == 2_000_000
    # each table row has as many cells as its header
    for table in md.split("\n\n"):
        tl = table.splitlines()
        assert {line.count("|") for line in tl} == {tl[0].count("|")}


def test_write_report_writes_json_markdown_and_pngs(tmp_path: Path) -> None:
    results = [_result("ownerserve"), _result("round-robin", 1.5)]
    summaries = [summarize(r, cluster=ClusterStats(duplicate_factor=1.0)) for r in results]
    images = plot_runs(summaries, results, tmp_path, "bench")
    paths = write_report(summaries, tmp_path, "bench", header="# hdr", images=images)
    data = json.loads(paths["json"].read_text())
    assert [d["label"] for d in data] == ["ownerserve", "round-robin"]
    assert data[0]["session_e2e"]["mean"] == pytest.approx(1.5)
    assert data[0]["cluster"]["duplicate_factor"] == 1.0
    for key in ("cdf", "bars"):
        png = paths[key].read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5000
    md = paths["md"].read_text()
    assert md.startswith("# hdr") and "![cdf](bench_cdf.png)" in md


def test_fallbacks_and_kv_pressure_counters_are_reported_per_run() -> None:
    base = _result("ownerserve")
    fell_back = dataclasses.replace(
        base.requests[0],
        plan="policy=ownerserve;action=remote_prefill;fallback=colocated;reason=kv_transfer_timeout",
    )
    result = dataclasses.replace(base, requests=(fell_back, *base.requests[1:]))
    s = summarize(result, cluster=ClusterStats(preemptions=3, kv_transfers_expired=1))
    assert s.fallbacks == {"colocated:kv_transfer_timeout": 1}
    assert (
        "- ownerserve: preempted 3, P/D transfers expired 1, "
        "fallbacks colocated:kv_transfer_timeout 1, 429s 0"
    ) in markdown_tables([s]).splitlines()
