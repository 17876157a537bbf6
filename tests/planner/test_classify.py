"""The request classes (planner/README.md) and their defaults."""

from __future__ import annotations

import pytest

from planner.classify import DEFAULT_ACTION, classify, new_tokens
from planner.cost import CostConfig
from planner.types import Action, RequestClass
from tests.planner.util import request

CFG = CostConfig()  # long ≥ 4096 new, small ≤ 2048, continuation ≤ 64, cold after 300 s idle


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({"prompt_tokens": 8000}, RequestClass.NEW_LONG_PREFIX),
        ({"prompt_tokens": 4096}, RequestClass.NEW_LONG_PREFIX),
        ({"prompt_tokens": 4095}, RequestClass.SMALL_INCREMENTAL_TURN),
        # a new session whose first 7000 tokens are an owned shared prefix: only 1000 are new
        (
            {"prompt_tokens": 8000, "owner": "d0", "owner_blocks": 70},
            RequestClass.SMALL_INCREMENTAL_TURN,
        ),
        (
            {"prompt_tokens": 5000, "session_owner": "d0", "previous_prompt_tokens": 4000},
            RequestClass.SMALL_INCREMENTAL_TURN,
        ),
        (
            {"prompt_tokens": 4064, "session_owner": "d0", "previous_prompt_tokens": 4000},
            RequestClass.DECODE_CONTINUATION,
        ),
        (
            {"prompt_tokens": 4065, "session_owner": "d0", "previous_prompt_tokens": 4000},
            RequestClass.SMALL_INCREMENTAL_TURN,
        ),
        (
            {"prompt_tokens": 6049, "session_owner": "d0", "previous_prompt_tokens": 4000},
            RequestClass.LONG_TOOL_OUTPUT,
        ),
        (
            {
                "prompt_tokens": 4100,
                "session_owner": "d0",
                "previous_prompt_tokens": 4000,
                "idle_s": 300.0,
            },
            RequestClass.COLD_RESUME,
        ),
        # the session's owner is gone (lease expired, worker died): cold
        ({"prompt_tokens": 4100, "previous_prompt_tokens": 4000}, RequestClass.COLD_RESUME),
        (
            {"prompt_tokens": 4100, "is_fork": True, "session_owner": "d0"},
            RequestClass.FORKED_ROLLOUT,
        ),
        ({"prompt_tokens": 100, "n": 4}, RequestClass.FORKED_ROLLOUT),
    ],
)
def test_classify(kw: dict[str, object], expected: RequestClass) -> None:
    kw = dict(kw)
    n = int(kw.pop("prompt_tokens"))  # type: ignore[call-overload]
    assert classify(request(n, **kw), CFG) is expected


def test_new_tokens_counts_only_what_is_not_known() -> None:
    assert new_tokens(request(1000)) == 1000
    assert new_tokens(request(1000, previous_prompt_tokens=700)) == 300
    assert new_tokens(request(1000, owner="x", owner_blocks=8)) == 200  # 8 · 100
    assert new_tokens(request(1000, previous_prompt_tokens=5000)) == 0


def test_each_class_has_the_mission_default() -> None:
    assert dict(DEFAULT_ACTION) == {
        RequestClass.NEW_LONG_PREFIX: Action.REMOTE_PREFILL,
        RequestClass.SMALL_INCREMENTAL_TURN: Action.COLOCATED_PREFILL,
        RequestClass.LONG_TOOL_OUTPUT: Action.REMOTE_PREFILL,
        RequestClass.DECODE_CONTINUATION: Action.DECODE_CONTINUATION,
        RequestClass.FORKED_ROLLOUT: Action.ARTIFACT_FETCH,
        RequestClass.COLD_RESUME: Action.TAIL_RECOMPUTE,
    }
