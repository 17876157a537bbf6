"""The KV fetch request's one schema: what the router sends is what the workers parse, and a
malformed body names the field at fault."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from ownerserve.errors import InvalidRequestError
from ownerserve.kvfetch import MAX_FETCH_BLOCKS, KVFetchRequest, fetched_blocks

GOOD: dict[str, Any] = {
    "source_url": "http://10.0.0.5:8200",
    "source_worker": "w0",
    "model": "m",
    "block_hashes": [1, 2**64 - 1],
    "token_ids": list(range(8)),
    "block_size": 4,
}


def test_a_request_survives_the_wire_unchanged() -> None:
    req = KVFetchRequest(
        source_url="http://10.0.0.5:8200",
        block_hashes=(1, 2**64 - 1),
        model="m",
        source_worker="w0",
        token_ids=tuple(range(8)),
        block_size=4,
    )
    assert KVFetchRequest.from_json(orjson.loads(orjson.dumps(req.to_json()))) == req


def test_only_url_and_hashes_are_required_and_unknown_keys_are_ignored() -> None:
    req = KVFetchRequest.from_json({"source_url": "https://a/", "block_hashes": [], "x": 1})
    assert req == KVFetchRequest(source_url="https://a", block_hashes=())


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"source_url": "ftp://x"}, "source_url"),
        ({"source_url": "http://"}, "source_url"),
        ({"source_url": "http://[::1"}, "source_url"),
        ({"source_url": None}, "source_url"),
        ({"block_hashes": [-1]}, "block_hashes"),
        ({"block_hashes": [2**64]}, "block_hashes"),
        ({"block_hashes": [True]}, "block_hashes"),
        ({"block_hashes": "1,2"}, "block_hashes"),
        ({"block_hashes": [0] * (MAX_FETCH_BLOCKS + 1)}, "block_hashes"),
        ({"model": ""}, "model"),
        ({"model": 3}, "model"),
        ({"source_worker": 3}, "source_worker"),
        ({"token_ids": [1.5]}, "token_ids"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": "16"}, "block_size"),
    ],
)
def test_a_malformed_field_is_refused_by_name(change: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        KVFetchRequest.from_json({**GOOD, **change})


def test_a_body_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="JSON object"):
        KVFetchRequest.from_json([GOOD])


@pytest.mark.parametrize(
    ("answer", "blocks"),
    [
        ({"blocks": 12, "artifacts": 96}, 12),  # the sidecar's answer
        ({"blocks": 0, "requested": 5}, 0),  # the emulator's, nothing came
        ({"artifacts": 3}, None),  # does not say
        ({"blocks": -1}, None),
        ({"blocks": True}, None),
        ({"blocks": "12"}, None),
        ([12], None),
    ],
)
def test_fetched_blocks_reads_only_a_count_it_can_trust(answer: object, blocks: int | None) -> None:
    assert fetched_blocks(answer) == blocks
