"""The sidecar's chunk verify route (chunk reuse): held and intact, missing, corrupted (dropped)."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.workers.sidecar.test_server import artifact_file, flip_a_byte, sidecar
from workers.sidecar.chunks import VERIFY_PATH


async def test_verify_says_which_chunk_artifacts_are_intact_and_drops_a_corrupted_one(
    tmp_path: Path,
) -> None:
    async with sidecar(tmp_path, "c", memory_bytes=0) as sc, httpx.AsyncClient() as http:
        keys = ["chunk@m@00000000000000aa", "chunk@m@00000000000000bb", "chunk@m@0000000000000cc0"]
        for key in keys[:2]:
            r = await http.put(f"{sc.url}/ownerserve/kv/artifacts/{key}", content=b"kv" * 500)
            assert r.status_code == 201
        flip_a_byte(await artifact_file(sc, keys[1]))
        r = await http.post(sc.url + VERIFY_PATH, json={"keys": keys})
        assert r.status_code == 200
        assert r.json() == {"present": [True, False, False]}
        # the corrupted one is gone: a plain lookup no longer counts it
        r = await http.post(f"{sc.url}/ownerserve/kv/lookup", json={"keys": keys})
        assert r.json()["present"] == [True, False, False]
        r = await http.post(sc.url + VERIFY_PATH, json={"keys": ["bad\\nkey\x00"]})
        assert r.status_code == 400
