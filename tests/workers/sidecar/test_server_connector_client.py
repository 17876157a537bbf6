"""The vLLM connector's blocking client (`workers.vllm_connector.client.SidecarClient`) against
a real sidecar: the contract the connector codes against, without vLLM."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.workers.sidecar.test_server import keys_of, payload, sidecar
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
