"""Batch calls of the sidecar (`workers/sidecar/batch.py` bodies): the codec, and
`POST /ownerserve/kv/batch/get` / `batch/put` over real sockets — many artifacts per round trip,
each still checked against its own checksum."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.workers.sidecar.test_server import assert_openai_error, keys_of, payload, sidecar
from workers.sidecar.batch import (
    BATCH_GET_PATH,
    BATCH_PUT_PATH,
    MEDIA_TYPE,
    BatchFormatError,
    decode_batch,
    encode_batch,
)
from workers.sidecar.store import checksum


def test_a_batch_body_decodes_to_its_entries_and_payloads() -> None:
    entries = [
        {"key": "k0", "size": 3, "checksum": "00"},
        {"key": "gone", "found": False},
        {"key": "k1", "size": 0, "checksum": "01"},
        {"key": "k2", "size": 2},
    ]
    got, payloads = decode_batch(encode_batch(entries, [b"abc", b"", memoryview(b"xy")]))
    assert got == entries
    assert [None if p is None else bytes(p) for p in payloads] == [b"abc", None, b"", b"xy"]


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\x00\x00\x00\x10{}",
        encode_batch([{"key": "k", "size": 4}], [b"abc"]),  # short
        encode_batch([{"key": "k", "size": 2}], [b"abc"]),  # bytes left over
        encode_batch([{"size": 3}], [b"abc"]),  # no key
        encode_batch([{"key": "k", "size": -1}], []),
        encode_batch([{"key": "k", "size": 3, "checksum": 7}], [b"abc"]),
        b"\x00\x00\x00\x02[]",
    ],
)
def test_a_malformed_batch_body_is_refused(body: bytes) -> None:
    with pytest.raises(BatchFormatError):
        decode_batch(body)


async def test_batch_put_stores_each_artifact_and_batch_get_returns_them(tmp_path: Path) -> None:
    keys = keys_of(0x51) + keys_of(0x52)
    async with sidecar(tmp_path, "a") as a, httpx.AsyncClient() as http:
        entries = [
            {"key": k, "size": 3000, "checksum": checksum(payload(k)).hex(), "block_artifacts": 2}
            for k in keys
        ]
        body = encode_batch(entries, [payload(k) for k in keys])
        r = await http.post(a.url + BATCH_PUT_PATH, content=body)
        assert r.status_code == 200, r.text
        assert [s["key"] for s in r.json()["stored"]] == keys
        assert all(s["bytes"] == 3000 for s in r.json()["stored"])
        # the declared head count made both blocks whole: published and indexed
        assert {0x51, 0x52} <= set(a.holdings())

        r = await http.post(a.url + BATCH_GET_PATH, json={"keys": [keys[2], "absent", keys[0]]})
        assert r.status_code == 200
        assert r.headers["content-type"] == MEDIA_TYPE
        got, payloads = decode_batch(r.content)
        assert [e["key"] for e in got] == [keys[2], "absent", keys[0]]
        assert got[1] == {"key": "absent", "found": False} and payloads[1] is None
        for entry, data, key in ((got[0], payloads[0], keys[2]), (got[2], payloads[2], keys[0])):
            assert data is not None and bytes(data) == payload(key)
            assert entry["checksum"] == checksum(payload(key)).hex()


async def test_a_batch_put_refuses_only_the_artifact_that_fails_its_checksum(
    tmp_path: Path,
) -> None:
    keys = keys_of(0x61)
    async with sidecar(tmp_path, "a") as a, httpx.AsyncClient() as http:
        bad = bytearray(payload(keys[1]))
        bad[0] ^= 1  # bytes that no longer match the checksum declared for them
        entries = [
            {"key": keys[0], "size": 3000, "checksum": checksum(payload(keys[0])).hex()},
            {"key": keys[1], "size": 3000, "checksum": checksum(payload(keys[1])).hex()},
        ]
        r = await http.post(
            a.url + BATCH_PUT_PATH, content=encode_batch(entries, [payload(keys[0]), bytes(bad)])
        )
        assert r.status_code == 200, r.text
        stored = r.json()["stored"]
        assert stored[0]["key"] == keys[0] and "error" not in stored[0]
        assert stored[1]["key"] == keys[1] and "checksum" in stored[1]["error"]
        assert a.store.has(keys[0]) and not a.store.has(keys[1])


async def test_a_malformed_batch_put_stores_nothing(tmp_path: Path) -> None:
    keys = keys_of(0x71)
    async with sidecar(tmp_path, "a") as a, httpx.AsyncClient() as http:
        good = {"key": keys[0], "size": 3000}
        for entry in (
            {"key": keys[1], "size": 3000, "checksum": "not hex"},
            {"key": keys[1], "size": 3000, "block_artifacts": 0},
            {"key": "", "size": 3000},
            {"key": keys[1], "found": False},
        ):
            payloads = [payload(keys[0])] + ([] if "found" in entry else [payload(keys[1])])
            r = await http.post(
                a.url + BATCH_PUT_PATH, content=encode_batch([good, entry], payloads)
            )
            assert_openai_error(r, 400)
        r = await http.post(a.url + BATCH_PUT_PATH, content=b"\x00\x00\x00\x05{}")
        assert_openai_error(r, 400)
        assert not a.store.has(keys[0])


async def test_batch_get_drops_a_corrupted_file_and_serves_the_others(tmp_path: Path) -> None:
    keys = keys_of(0x81)
    async with sidecar(tmp_path, "a", memory_bytes=0) as a, httpx.AsyncClient() as http:
        for k in keys:
            r = await http.put(f"{a.url}/ownerserve/kv/artifacts/{k}", content=payload(k))
            assert r.status_code == 201
        await asyncio.to_thread(a.store.flush)  # the files are written behind
        (path,) = [p for p in (tmp_path / "a").rglob("*.kv") if "head:0" in p.name]
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0x7F
        path.write_bytes(bytes(raw))
        r = await http.post(a.url + BATCH_GET_PATH, json={"keys": keys})
        entries, payloads = decode_batch(r.content)
        assert entries[0] == {"key": keys[0], "found": False}
        assert payloads[1] is not None and bytes(payloads[1]) == payload(keys[1])
        assert not a.store.has(keys[0])  # never served again
