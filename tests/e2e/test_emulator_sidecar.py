"""Emulated engines whose KV goes through their own sidecar processes (`--sidecar-url`): every
computed block is saved to the sidecar, a request's blocks past its HBM hit are loaded from it,
a prefix the sidecar fetched from a peer's sidecar is what the engine then loads, and a dead
sidecar costs a recompute, never the request."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadgen.cluster import EmulatedWorker, KVSidecar, emulated_workers
from ownerserve.hashing import chain_root
from tests.e2e.router_cluster import MODEL, metric_value
from tests.waiting import until
from workers.emulator.kv_cache import prompt_block_hashes

pytestmark = pytest.mark.timeout(120)

BLOCK = 16
TEXT = "".join(f"line {i}: the sidecar keeps what the engine computed.\n" for i in range(60))


@contextlib.contextmanager
def with_sidecars(tmp_path: Path, *ids: str) -> Iterator[list[tuple[EmulatedWorker, KVSidecar]]]:
    scs = [KVSidecar(i, tmp_path / f"sc-{i}") for i in ids]
    try:
        for sc in scs:
            sc.start()
        for sc in scs:
            sc.wait_healthy()
        ws = [
            EmulatedWorker(i, "hybrid", speed=20, sidecar_url=sc.url)
            for i, sc in zip(ids, scs, strict=True)
        ]
        with emulated_workers(*ws):
            yield list(zip(ws, scs, strict=True))
    finally:
        for sc in scs:
            sc.stop()


def messages(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": TEXT + question}]


async def chat(http: httpx.AsyncClient, w: EmulatedWorker, question: str) -> dict[str, Any]:
    r = await http.post(
        w.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": messages(question), "max_tokens": 2},
    )
    assert r.status_code == 200, r.text
    usage: dict[str, Any] = r.json()["usage"]
    return usage


def cached(usage: dict[str, Any]) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def chain(http: httpx.AsyncClient, w: EmulatedWorker, question: str) -> list[int]:
    r = await http.post(w.url + "/tokenize", json={"model": MODEL, "messages": messages(question)})
    return prompt_block_hashes(r.json()["tokens"], BLOCK, chain_root(MODEL))


async def counter(http: httpx.AsyncClient, url: str, name: str, **labels: str) -> float:
    return metric_value((await http.get(url + "/metrics")).text, name, **labels)


async def artifacts(http: httpx.AsyncClient, sc: KVSidecar) -> int:
    return int((await http.get(sc.url + "/health")).json()["artifacts"])


async def test_blocks_saved_to_the_sidecar_are_loaded_once_hbm_lost_them(tmp_path: Path) -> None:
    with with_sidecars(tmp_path, "h0") as [(w, sc)]:
        async with httpx.AsyncClient(timeout=30) as http:
            first = await chat(http, w, "Q?")
            blocks = first["prompt_tokens"] // BLOCK
            await until(
                lambda: _at_least(artifacts(http, sc), blocks), what="the prompt's blocks saved"
            )
            assert (await http.post(w.url + "/reset_prefix_cache")).status_code == 200
            again = await chat(http, w, "Q?")
            assert cached(again) >= (blocks - 1) * BLOCK
            loaded = await counter(http, w.url, "ownerserve_emulator_sidecar_blocks_loaded_total")
            assert loaded >= blocks - 1


async def test_a_prefix_its_sidecar_fetched_from_a_peer_is_loaded_by_the_engine(
    tmp_path: Path,
) -> None:
    with with_sidecars(tmp_path, "h0", "h1") as [(w0, s0), (w1, s1)]:
        async with httpx.AsyncClient(timeout=30) as http:
            first = await chat(http, w0, "Q?")
            hashes = await chain(http, w0, "Q?")
            assert len(hashes) == first["prompt_tokens"] // BLOCK
            await until(lambda: _at_least(artifacts(http, s0), len(hashes)), what="saved on s0")
            body = {
                "source_url": s0.url,
                "source_worker": "h0",
                "model": MODEL,
                "block_hashes": hashes,
                "token_ids": [],
                "block_size": BLOCK,
            }
            r = await http.post(s1.url + "/ownerserve/kv/fetch", json=body)
            assert r.status_code == 200 and r.json()["blocks"] == len(hashes), r.text
            usage = await chat(http, w1, "Q?")
            assert cached(usage) >= (len(hashes) - 1) * BLOCK
            sent = await counter(http, w0.url, "ownerserve_emulator_kv_sent_bytes_total")
            assert sent == 0  # the bytes came from the sidecars, not from h0's engine


async def test_a_dead_sidecar_costs_a_recompute_not_the_request(tmp_path: Path) -> None:
    with with_sidecars(tmp_path, "h0") as [(w, sc)]:
        async with httpx.AsyncClient(timeout=30) as http:
            first = await chat(http, w, "Q?")
            blocks = first["prompt_tokens"] // BLOCK
            await until(lambda: _at_least(artifacts(http, sc), blocks), what="blocks saved")
            sc.kill()
            assert (await http.post(w.url + "/reset_prefix_cache")).status_code == 200
            again = await chat(http, w, "Q?")
            assert cached(again) == 0
            failed = await counter(http, w.url, "ownerserve_emulator_sidecar_load_failures_total")
            assert failed >= 1
            await chat(http, w, "Other question?")  # its saves fail too, counted, not raised
            await until(
                lambda: _at_least(
                    counter(http, w.url, "ownerserve_emulator_sidecar_save_failures_total"), 1
                ),
                what="a failed save counted",
            )


async def _at_least(value: Any, n: float) -> bool:
    return bool(await value >= n)
