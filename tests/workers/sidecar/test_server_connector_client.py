"""The vLLM connector's blocking client (`workers.vllm_connector.client.SidecarClient`) against
a real sidecar: the contract the connector codes against, without vLLM."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.workers.sidecar.test_server import keys_of, payload, sidecar
from workers.vllm_connector import client as client_module
from workers.vllm_connector.client import ArtifactRejected, SidecarClient


async def test_connector_client_saves_looks_up_and_loads(tmp_path: Path) -> None:
    async with sidecar(tmp_path, "a", memory_bytes=0) as a:
        client = SidecarClient(a.url)
        keys = keys_of(0x77)
        try:
            assert await asyncio.to_thread(client.health)
            assert await asyncio.to_thread(client.lookup, keys) == [False, False]
            for i, key in enumerate(keys):
                # the connector declares how many heads make a block whole
                await asyncio.to_thread(client.put, key, payload(key), len(keys))
                assert (0x77 in a.holdings()) == (i == len(keys) - 1)
            assert await asyncio.to_thread(client.lookup, keys) == [True, True]
            assert await asyncio.to_thread(client.get, keys[1]) == payload(keys[1])

            await asyncio.to_thread(a.store.flush)  # the files are written behind
            (path, _) = sorted((tmp_path / "a").rglob("*.kv"))
            raw = bytearray(path.read_bytes())
            raw[-1] ^= 0x7F
            path.write_bytes(bytes(raw))
            with pytest.raises(ArtifactRejected):
                await asyncio.to_thread(client.get, keys[0])
            with pytest.raises(ArtifactRejected):
                await asyncio.to_thread(client.get, "absent")
            assert await asyncio.to_thread(client.lookup, keys) == [False, True]
        finally:
            client.close()


async def test_connector_client_moves_many_artifacts_per_call_each_checked_alone(
    tmp_path: Path,
) -> None:
    async with sidecar(tmp_path, "a", memory_bytes=0) as a:
        client = SidecarClient(a.url)
        keys = keys_of(0x91) + keys_of(0x92)
        try:
            await asyncio.to_thread(client.put_many, [(k, payload(k)) for k in keys], 2)
            assert {0x91, 0x92} <= set(a.holdings())  # every declared head arrived
            got = await asyncio.to_thread(client.get_many, [*keys, "absent"], [3000] * 5)
            assert got[:4] == [payload(k) for k in keys]
            assert isinstance(got[4], ArtifactRejected)

            await asyncio.to_thread(a.store.flush)  # the files are written behind
            files = sorted((tmp_path / "a").rglob("*.kv"))
            assert len(files) == 4
            raw = bytearray(files[0].read_bytes())
            raw[-1] ^= 0x7F
            files[0].write_bytes(bytes(raw))
            got = await asyncio.to_thread(client.get_many, keys)
            # the corrupted one is refused alone; the batch still brings the other three
            assert sum(isinstance(g, ArtifactRejected) for g in got) == 1
            assert [g for g in got if isinstance(g, bytes)] == [
                payload(k) for k, g in zip(keys, got, strict=True) if isinstance(g, bytes)
            ]
            assert len([g for g in got if isinstance(g, bytes)]) == 3
        finally:
            client.close()


async def test_connector_client_splits_a_large_set_into_several_batch_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_module, "MAX_BATCH_BYTES", 7000)  # two 3000-byte artifacts a call
    async with sidecar(tmp_path, "a") as a:
        client = SidecarClient(a.url)
        keys = [k for chunk in range(0xA0, 0xA3) for k in keys_of(chunk)]
        try:
            await asyncio.to_thread(client.put_many, [(k, payload(k)) for k in keys], 2)
            assert a.health()["artifacts"] == len(keys)
            got = await asyncio.to_thread(client.get_many, keys, [3000] * len(keys))
            assert got == [payload(k) for k in keys]
        finally:
            client.close()
