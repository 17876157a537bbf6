"""The overhead bench's long agent sessions: each turn resends the conversation with one more
tool call, every `tool` message answers an assistant call, and the prompt grows to its size."""

from __future__ import annotations

import json
from itertools import pairwise

from bench.router_overhead.load import AgentSession
from bench.router_overhead.run import LONG, pick_scenarios


def _turns(grow_to: int, turns: int, n: int) -> list[tuple[bytes, dict]]:
    out = []
    requests = AgentSession("m", 3, False, "h:1", grow_to, turns).requests()
    for _ in range(n):
        head, body = next(requests).split(b"\r\n\r\n", 1)
        assert head.endswith(b"\r\ncontent-length: %d" % len(body))
        out.append((head, json.loads(body)))
    return out


def test_every_tool_message_answers_an_assistant_call_before_it():
    for _, body in _turns(8192, 6, 12):
        calls: set[str] = set()
        for m in body["messages"]:
            if m["role"] == "assistant":
                calls.update(c["id"] for c in m.get("tool_calls", []))
            if m["role"] == "tool":
                assert m["tool_call_id"] in calls


def test_a_session_resends_its_history_and_grows_to_its_size_then_starts_over():
    turns = _turns(32768, 8, 9)
    sessions = [h.split(b"x-session-id: ", 1)[1].split(b"\r\n", 1)[0] for h, _ in turns]
    assert len(set(sessions[:8])) == 1 and sessions[8] != sessions[0]
    for (_, a), (_, b) in pairwise(turns[:8]):
        assert b["messages"][: len(a["messages"])] == a["messages"]
    last = len(json.dumps(turns[7][1]))
    assert 0.9 * 32768 < last < 1.2 * 32768
    assert len(turns[8][1]["messages"]) == 2


def test_scenarios_are_picked_by_group_or_label():
    assert pick_scenarios("long") == list(LONG)
    picked = pick_scenarios("agent 8K stream c=8,stream c=1")
    assert [s.label for s in picked] == ["agent 8K stream c=8", "stream c=1"]
    assert picked[0].load_args() == ["-c", "8", "--stream", "--grow-to", "8192", "--turns", "16"]
