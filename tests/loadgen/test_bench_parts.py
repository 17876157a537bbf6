"""The benchmark's pure parts: metrics parsing, cluster totals, duplicate factor, goals, and the
RESULTS.md section update."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadgen.bench import evaluate_goals, goals_table, replace_section
from loadgen.client import RunResult, SessionRecord
from loadgen.cluster import (
    ClusterSpec,
    EmulatedCluster,
    ownerserve_config,
    peer_command,
    peer_mode_unfit,
)
from loadgen.metrics import (
    WorkerSnapshot,
    cluster_stats,
    duplicate_factor,
    metric_sum,
    parse_prometheus,
)
from loadgen.report import ClusterStats, summarize
from ownerserve.config import settings_from_dict

TEXT = """# HELP vllm:prefix_cache_queries Prefix cache queries, in tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{model_name="m",engine="0"} 1000
vllm:prefix_cache_hits_total{model_name="m",engine="0"} 600
vllm:prompt_tokens_total{model_name="m",engine="0"} 1000
vllm:prompt_tokens_by_source_total{model_name="m",engine="0",source="local_compute"} 400
ownerserve_emulator_prefill_tokens_computed_total{worker_id="w"} 400
ownerserve_emulator_kv_received_bytes_total{worker_id="w",kind="pd"} 2048
ownerserve_emulator_kv_received_bytes_total{worker_id="w",kind="fetch"} 1024
vllm:e2e_request_latency_seconds_bucket{model_name="m",le="+Inf"} 3
garbage line
"""


def test_parse_prometheus_reads_names_labels_and_values() -> None:
    samples = parse_prometheus(TEXT)
    assert metric_sum(samples, "vllm:prefix_cache_hits_total") == 600
    assert metric_sum(samples, "ownerserve_emulator_kv_received_bytes_total", kind="pd") == 2048
    assert metric_sum(samples, "ownerserve_emulator_kv_received_bytes_total") == 3072
    assert metric_sum(samples, "vllm:e2e_request_latency_seconds_bucket", le="+Inf") == 3
    assert metric_sum(samples, "missing") is None


def test_duplicate_factor_is_held_over_distinct() -> None:
    assert duplicate_factor([frozenset({1, 2}), frozenset({2, 3}), frozenset()]) == (4 / 3, 4, 3)
    assert duplicate_factor([frozenset({1}), frozenset({1})])[0] == 2.0
    assert duplicate_factor([])[0] is None


def test_cluster_stats_subtracts_the_before_snapshot_and_sums_workers() -> None:
    samples = tuple(parse_prometheus(TEXT))
    zero = tuple((n, labels, 0.0) for n, labels, _ in samples)
    after = [
        WorkerSnapshot("a", samples, frozenset({1, 2, 3})),
        WorkerSnapshot("b", samples, frozenset({3})),
    ]
    before = [WorkerSnapshot("a", zero), WorkerSnapshot("b", samples)]
    c = cluster_stats(after, before, dup_samples=[1.0, 1.5])
    assert c.prompt_tokens == 1000 and c.prefill_tokens_computed == 400
    assert c.prefix_hit_rate == pytest.approx(0.6)
    assert c.kv_bytes_pd == 2048 and c.kv_bytes_fetch == 1024 and c.kv_bytes_moved == 3072
    assert c.held_blocks == 4 and c.distinct_blocks == 3
    assert c.duplicate_factor == pytest.approx((1.0 + 1.5 + 4 / 3) / 3)
    assert c.duplicate_factor_peak == 1.5
    # a worker without the hash listing: no duplicate factor rather than a wrong one
    partial = cluster_stats([after[0], WorkerSnapshot("b", samples)])
    assert partial.duplicate_factor is None


def _summary(label: str, e2e: float, moved: int | None = None, dup: float | None = None):
    sessions = (SessionRecord("s", "agentic", "g", 0.0, 0.0, e2e, 1, 1, 0.0),)
    res = RunResult(label, "w", "t", "now", 1.0, (), sessions, False)
    return summarize(res, cluster=ClusterStats(kv_bytes_pd=moved, duplicate_factor=dup))


def test_goals_compare_ownerserve_with_best_peer_best_baseline_and_static_pd() -> None:
    summaries = [
        _summary("ownerserve", 6.0, moved=100, dup=1.05),
        _summary("static-pd", 10.0, moved=400),
        _summary("colocated", 7.0, moved=0),
        _summary("vllm-router cache_aware", 9.0),
        _summary("sglang-router cache_aware", 8.0),
    ]
    goals = {g.name: g for g in evaluate_goals(summaries)}
    peer = goals["mean session E2E vs best peer"]
    assert peer.measured == pytest.approx(0.75) and peer.met is False
    assert peer.detail == "sglang-router cache_aware"
    base = goals["mean session E2E vs best own baseline"]
    assert base.measured == pytest.approx(6 / 7) and base.met is False
    assert goals["KV bytes moved vs static-pd"].measured == pytest.approx(0.25)
    assert goals["KV bytes moved vs static-pd"].met is True
    assert goals["HBM duplicate factor"].met is True
    table = goals_table(list(goals.values()))
    assert "| mean session E2E vs best peer | 0.75 | ≤ 0.7× | **no** |" in table
    assert evaluate_goals([_summary("static-pd", 1.0)]) == []


def test_replace_section_rewrites_only_its_own_section(tmp_path: Path) -> None:
    md = tmp_path / "RESULTS.md"
    md.write_text(
        "# Results\n\n## Router overhead\n\nkeep me\n\n"
        "## Agentic benchmark\n\nold\n\n## Later\n\ntail\n"
    )
    replace_section(md, "## Agentic benchmark", "## Agentic benchmark\n\nnew\n")
    text = md.read_text()
    assert "keep me" in text and "tail" in text and "new" in text and "old" not in text
    assert text.index("## Router overhead") < text.index("new") < text.index("## Later")
    other = tmp_path / "other.md"
    replace_section(other, "## Agentic benchmark", "## Agentic benchmark\n\nx\n")
    assert other.read_text().startswith("# Benchmark results\n\n## Agentic benchmark")


def test_cluster_config_is_valid_settings_and_peer_commands_split_pd(tmp_path: Path) -> None:
    cluster = EmulatedCluster(ClusterSpec(), tmp_path)
    assert [w.worker_id for w in cluster.workers] == ["p0", "p1", "d0", "d1", "h0", "h1"]
    settings = settings_from_dict(ownerserve_config(cluster, 8000, "static-pd"))
    assert settings.planner.policy == "static-pd" and len(settings.workers) == 6
    cmd = peer_command(Path("/x/smg"), "sglang-router", "cache_aware", True, cluster, 9000)
    assert cmd[:2] == ["/x/smg", "launch"] and "--pd-disaggregation" in cmd
    prefills = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--prefill"]
    decodes = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--decode"]
    # SGLang servers are prefill or decode servers: the hybrids sit out its P/D mode
    assert prefills == [w.url for w in cluster.by_role("prefill")]
    assert decodes == [w.url for w in cluster.by_role("decode")]
    # sglang's prefill entries carry the bootstrap port
    assert cmd[cmd.index("--prefill") + 2] == str(cluster.workers[0].bootstrap_port)
    vpd = peer_command(Path("/x/vr"), "vllm-router", "cache_aware", True, cluster, 9000)
    prefills = [vpd[i + 1] for i, a in enumerate(vpd) if a == "--prefill"]
    decodes = [vpd[i + 1] for i, a in enumerate(vpd) if a == "--decode"]
    assert len(prefills) == 3 and len(decodes) == 3 and not set(prefills) & set(decodes)
    assert "--vllm-pd-disaggregation" in vpd
    regular = peer_command(Path("/x/vr"), "vllm-router", "consistent_hash", False, cluster, 9000)
    assert regular[regular.index("--worker-urls") + 1 :][:6] == [w.url for w in cluster.workers]


def test_a_pd_peer_mode_without_prefill_or_decode_workers_is_refused_or_skipped(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from loadgen.bench_cli import CAPACITY_TARGETS
    from ownerserve.cli import main as ownerserve_main

    hybrids = ClusterSpec(0, 0, 4)
    why = peer_mode_unfit("sglang-router pd cache_aware", hybrids)
    assert why is not None and "0 prefill, 0 decode, 4 hybrid" in why
    assert peer_mode_unfit("sglang-router pd cache_aware", ClusterSpec(1, 1, 0)) is None
    # vllm-router splits the hybrids between its prefill and decode lists: two are enough
    assert peer_mode_unfit("vllm-router pd cache_aware", hybrids) is None
    assert peer_mode_unfit("vllm-router pd cache_aware", ClusterSpec(0, 0, 1)) is not None
    assert peer_mode_unfit("sglang-router cache_aware", ClusterSpec(0, 0, 1)) is None
    # named by the user: a clear error before anything starts
    rc = ownerserve_main(
        ["bench", "capacity", "--quick", "--targets", "ownerserve,sglang-router pd cache_aware"]
    )
    assert rc == 2 and "needs one of each" in capsys.readouterr().err
    # from the default list: skipped, and said
    from loadgen.bench_cli import _runnable

    kept = _runnable(list(CAPACITY_TARGETS), hybrids, asked=False)
    assert "sglang-router pd cache_aware" not in kept and "vllm-router pd cache_aware" in kept
    assert "skipping sglang-router pd cache_aware" in capsys.readouterr().err
