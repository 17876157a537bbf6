"""The peer-model validation: each peer binary's mode is simulated on the workers it routes over,
and the verdict flags gaps beyond ±20% E2E / ±15% counts and a wrong E2E ranking."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench.sim.validate_peers import (
    SECTION,
    Shape,
    TargetRow,
    insert_section,
    judge,
    main,
    mixed_case,
    replayed_text,
    sim_shape,
    simulate,
)
from loadgen.sim.from_workload import workload_sessions
from tests.planner.util import request


def test_sim_shape_is_the_workers_each_binary_routes_over() -> None:
    shape = Shape(2, 2, 2)
    assert sim_shape("static-pd", shape) == shape
    assert sim_shape("sglang-router cache_aware", shape) == Shape(0, 0, 6)
    assert sim_shape("vllm-router consistent_hash", shape) == Shape(0, 0, 6)
    # vllm-router's P/D takes half the hybrids on each side, sglang-router's none
    assert sim_shape("vllm-router pd cache_aware", shape) == Shape(3, 3, 0)
    assert sim_shape("sglang-router pd cache_aware", shape) == Shape(2, 2, 0)
    assert sim_shape("vllm-router pd cache_aware", Shape(1, 1, 2)) == Shape(2, 2, 0)


@pytest.fixture(scope="module")
def tiny() -> dict[str, dict[str, object]]:
    case = mixed_case(scale=0.1)
    return simulate(
        case, ["static-pd", "colocated", "sglang-router cache_aware"], 2000, "h100-llama3-8b"
    )


def _rows(sim: dict[str, dict[str, object]], **scale: float) -> list[TargetRow]:
    """Rows whose emulated side is the simulated one, `target_metric=factor` scaled."""
    rows = []
    for target, s in sim.items():
        emu = dict(s)
        for key, f in scale.items():
            t, metric = key.split("__")
            if t == target.replace(" ", "_").replace("-", "_"):
                emu[metric] = s[metric] * f  # type: ignore[operator]
        rows.append(TargetRow(target, emu, s))
    return rows


def test_judge_on_a_tiny_case(tiny: dict[str, dict[str, object]]) -> None:
    assert tiny["sglang-router cache_aware"]["shape"] == [0, 0, 6]
    assert tiny["static-pd"]["kv_bytes"] > 0 and tiny["colocated"]["kv_bytes"] == 0  # type: ignore[operator]
    v = judge(_rows(tiny))
    assert v.met and v.tau_e2e == pytest.approx(1.0)
    # emulated E2E 30% above the simulated one: outside ±20%
    v = judge(_rows(tiny, static_pd__e2e_mean_s=1.3))
    assert v.misses["e2e_mean_s"] == ["static-pd"] and not v.met
    # 10% is inside ±20% for E2E, 20% outside ±15% for prefill tokens
    v = judge(_rows(tiny, colocated__e2e_mean_s=1.1, colocated__prefill_tokens=1.2))
    assert v.misses == {"e2e_mean_s": [], "prefill_tokens": ["colocated"], "kv_bytes": []}


def test_judge_flags_a_reversed_ranking() -> None:
    def row(name: str, emu: float, sim: float) -> TargetRow:
        counts = {"prefill_tokens": 10, "kv_bytes": 0}
        return TargetRow(name, {"e2e_mean_s": emu, **counts}, {"e2e_mean_s": sim, **counts})

    # every value within ±20%, but the order is reversed
    rows = [row("a", 10.0, 11.5), row("b", 11.0, 11.0), row("c", 12.0, 10.5)]
    v = judge(rows)
    assert not any(v.misses.values()) and v.tau_e2e == pytest.approx(-1.0) and not v.tau_ok


def test_insert_section_goes_after_the_title_and_replaces_itself(tmp_path: Path) -> None:
    md = tmp_path / "v.md"
    md.write_text("# Title\n\n## Older\n\nold text\n")
    insert_section(md, f"{SECTION}\n\nfirst\n")
    insert_section(md, f"{SECTION}\n\nsecond\n")
    text = md.read_text()
    assert text.startswith(f"# Title\n\n{SECTION}\n\nsecond\n\n## Older")
    assert "first" not in text


def test_sim_only_run_writes_json_and_the_section(tmp_path: Path) -> None:
    md = tmp_path / "v.md"
    md.write_text("# Title\n")
    argv = ["--sim-only", "--cases", "mixed", "--mixed-scale", "0.1", "--out", str(tmp_path)]
    argv += ["--targets", "colocated,vllm-router pd cache_aware", "--results-md", str(md)]
    assert main(argv) == 0
    (saved,) = tmp_path.glob("peers_mixed_*.json")
    data = json.loads(saved.read_text())
    assert [r["target"] for r in data["rows"]] == ["colocated", "vllm-router pd cache_aware"]
    assert data["rows"][1]["simulated"]["shape"] == [3, 3, 0]
    assert SECTION in md.read_text() and "vllm-cache-aware-pd (3/3/0)" in md.read_text()
    assert main(["--resimulate", str(saved), "--out", str(tmp_path)]) == 0
    resim = json.loads(next(tmp_path.glob("*_resim.json")).read_text())
    assert resim["rows"][1]["simulated"] == data["rows"][1]["simulated"]


def test_replayed_text_reads_the_request_bodies() -> None:
    case = mixed_case(scale=0.1)
    sessions = workload_sessions(case.workload)
    text = replayed_text(case.workload, sessions)
    kinds: dict[str, list[bool]] = {}
    for src, sim in zip(case.workload.sessions, sessions, strict=True):
        for t in sim.turns:
            r = replace(request(t.input_tokens), session_id=str(sim.session_id))
            kinds.setdefault(src.session_id.split("-")[0], []).append(text.carries_tools(r))
            known = text.content_bytes(r)
            assert known is not None
            by_block, total = known
            # one count per block boundary, rising, never past the whole text
            assert len(by_block) == len(t.chain) + 1 and by_block[0] == 0
            assert list(by_block) == sorted(by_block) and by_block[-1] <= total
            # the template's framing is no part of the text: fewer bytes than tokens
            assert 0 < total < t.input_tokens
    # an agent's turns after its first return a tool result; document QA never does
    assert kinds["agentic"][0] is False and any(kinds["agentic"][1:])
    assert not any(kinds["docqa"])
