"""Mooncake-format traces: parsing, scaling, exact prompt lengths and block-aligned sharing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadgen.text import template_overhead
from loadgen.trace import (
    TraceError,
    TraceRequest,
    TraceScaling,
    load_trace,
    prefix_sharing,
    trace_workload,
    write_trace,
)
from ownerserve.tokenizer import ChatTemplate

SHARED_TRACE = Path(__file__).resolve().parents[2] / "data" / "mooncake_synthetic_trace.jsonl"


def _rows() -> list[TraceRequest]:
    return [
        TraceRequest(0, 1200, 10, (1, 2, 3)),
        TraceRequest(500, 1100, 5, (1, 2, 4)),
        TraceRequest(1500, 700, 7, (1, 5)),
        TraceRequest(2000, 1536, 3, (1, 2, 3)),
    ]


def _prompt(session_steps: object) -> str:
    step = session_steps.steps[0]  # type: ignore[attr-defined]
    return ChatTemplate().render([m.as_dict() for m in step.new_messages])


def test_write_then_load_round_trips(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    write_trace(_rows(), p)
    assert load_trace(p) == _rows()
    assert load_trace(p, start=1, stride=2) == [_rows()[1], _rows()[3]]
    assert load_trace(p, limit=2) == _rows()[:2]


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("{not json", "invalid JSON"),
        ('{"timestamp": 0, "input_length": 5}', "missing field"),
        ('{"timestamp": 0, "input_length": "x", "output_length": 1, "hash_ids": [1]}', "bad"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": []}', "hash_ids"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_bad_rows_name_the_line(tmp_path: Path, line: str, needle: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n' + line
    )
    with pytest.raises(TraceError, match=f"bad.jsonl:2: .*{needle}"):
        load_trace(p)


def test_prompts_have_the_scaled_input_length_and_shared_ids_share_text() -> None:
    scaling = TraceScaling(block_tokens=64, max_output=4)
    w = trace_workload(_rows(), scaling)
    prompts = [_prompt(s) for s in w.sessions]
    for row, prompt in zip(_rows(), prompts, strict=True):
        assert len(prompt) == scaling.input_tokens(row)
    assert [scaling.input_tokens(r) for r in _rows()] == [64 * 2 + 22, 64 * 2 + 10, 64 + 24, 192]
    # rows 0 and 1 share blocks 1, 2 (row 1 ends inside block 2, then the template's tail)
    tail = template_overhead().tail
    assert prompts[1][: 138 - tail] == prompts[0][: 138 - tail]
    assert prompts[2][:64] == prompts[0][:64] and prompts[2][64:70] != prompts[0][64:70]
    assert prompts[3].startswith(prompts[0][: len(prompts[0]) - tail])
    assert [s.steps[0].max_tokens for s in w.sessions] == [4, 4, 4, 3]
    assert [s.start_s for s in w.sessions] == [0.0, 0.5, 1.5, 2.0]


def test_time_scale_and_output_scale() -> None:
    w = trace_workload(_rows(), TraceScaling(time_scale=0.1, output_scale=0.5))
    assert [s.start_s for s in w.sessions] == pytest.approx([0.0, 0.05, 0.15, 0.2])
    assert [s.steps[0].max_tokens for s in w.sessions] == [5, 2, 4, 2]


def test_prefix_sharing_counts_reused_leading_blocks() -> None:
    # row0: 0 of 1200; row1: blocks 1,2 = 1024 of 1100; row2: block 1 = 512 of 700;
    # row3: all 3 blocks = 1536 of 1536
    expected = (1024 + 512 + 1536) / (1200 + 1100 + 700 + 1536)
    assert prefix_sharing(_rows()) == pytest.approx(expected)


@pytest.mark.skipif(not SHARED_TRACE.exists(), reason="shared Mooncake trace not present")
def test_shared_trace_has_the_documented_size_and_sharing() -> None:
    rows = load_trace(SHARED_TRACE)
    assert len(rows) == 3993
    assert rows[-1].timestamp_ms / 1000 == pytest.approx(1022, abs=1)
    blocks = sum(len(r.hash_ids) for r in rows)
    seen: set[int] = set()
    reused = 0
    for r in rows:
        reused += sum(h in seen for h in r.hash_ids)
        seen.update(r.hash_ids)
    assert reused / blocks == pytest.approx(0.64, abs=0.01)
    assert prefix_sharing(rows) == pytest.approx(0.65, abs=0.01)
    # shrinking the blocks keeps the sharing ratio
    assert prefix_sharing(rows, TraceScaling(block_tokens=32)) == pytest.approx(0.65, abs=0.01)


def test_load_rejects_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "nope.jsonl")
    (tmp_path / "e.jsonl").write_text(json.dumps({"x": 1}) + "\n")
    with pytest.raises(TraceError, match="missing field"):
        load_trace(tmp_path / "e.jsonl")
