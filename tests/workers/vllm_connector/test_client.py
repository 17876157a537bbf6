"""The connector client's batching (pure): how a request's artifacts are split into batch calls."""

from __future__ import annotations

import pytest

from workers.vllm_connector import client
from workers.vllm_connector.client import _batches


def test_a_request_set_within_the_bounds_is_one_call() -> None:
    assert _batches([100] * 240) == [range(240)]
    assert _batches([]) == []


def test_calls_are_split_at_the_byte_bound_and_an_oversized_artifact_goes_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(client, "MAX_BATCH_BYTES", 10)
    assert _batches([4, 4, 4, 20, 1, 9, 1]) == [
        range(0, 2),
        range(2, 3),
        range(3, 4),
        range(4, 6),
        range(6, 7),
    ]


def test_calls_are_split_at_the_key_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client, "MAX_BATCH_KEYS", 3)
    assert _batches([0] * 7) == [range(0, 3), range(3, 6), range(6, 7)]
