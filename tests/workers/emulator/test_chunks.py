"""Chunk reuse in the emulated engine: the chunk store (LRU with pinning) and a request whose
chunk layout names chunks computed before, at another position."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from ownerserve.chunks import layout_params, split_on_separator
from ownerserve.hashing import chain_root
from tests.workers.emulator.conftest import (
    StartEmulator,
    metric_value,
    scrape,
    timed_post,
    write_profile,
)
from workers.emulator.chunk_store import ChunkStore
from workers.emulator.config import DEFAULT_MODEL as MODEL
from workers.emulator.server import EmulatorServer

DOC_A = "alpha document " * 20  # 300 tokens
DOC_B = "bravo document " * 20
DOC_C = "charlie document " * 20


def test_the_store_evicts_least_recently_used_unpinned_chunks() -> None:
    store = ChunkStore(capacity_tokens=100)
    assert store.store(1, 40) and store.store(2, 40)
    assert store.lookup(1) == 40  # 1 is now the most recently used
    assert store.store(3, 40)  # evicts 2
    assert 2 not in store and 1 in store and 3 in store
    store.pin(1)
    store.pin(3)
    assert not store.store(4, 40)  # everything pinned: refused, nothing evicted
    assert store.refused == 1 and len(store) == 2
    store.unpin(3)
    assert store.store(4, 40)
    assert 3 not in store and 1 in store and store.used_tokens == 80
    assert store.evicted == 2
    store.clear()
    assert store.hashes() == [1]  # pinned chunks stay


def completion(prompt: str, **extra: Any) -> dict[str, Any]:
    cp = split_on_separator(
        list(prompt.encode()), list(b"##"), chain_root(MODEL), max_model_len=100_000
    )
    assert cp is not None
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 1,
        "kv_transfer_params": {"ownerserve": layout_params(cp)},
        **extra,
    }


async def post(
    http: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> tuple[dict[str, Any], float]:
    return await timed_post(http, url + "/v1/completions", body)


async def cached_tokens(
    http: httpx.AsyncClient, server: EmulatorServer, *prompts: str
) -> list[int]:
    """Complete each of `prompts` (`completion`: chunks split on `##`) on `server` in turn: the
    prompt tokens each one found cached."""
    found = []
    for prompt in prompts:
        answer, _ = await post(http, server.url, completion(prompt))
        found.append(int(answer["usage"]["prompt_tokens_details"]["cached_tokens"]))
    return found


async def test_a_chunk_computed_before_is_reused_at_another_position(
    start_emulator: StartEmulator, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    # 1 ms per computed token, 1 µs per re-rotated one
    profile = write_profile(tmp_path, rerotate_per_token_s=1e-6)
    server = await start_emulator(profile=profile)
    first, first_s = await post(http, server.url, completion(f"sys##{DOC_A}##{DOC_B}##q1"))
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # A moves from the first chunk to the second, behind a new chunk; B is gone
    second, second_s = await post(http, server.url, completion(f"sys##{DOC_C}##{DOC_A}##q2"))
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == len(DOC_A)  # the prefix "sys##" is under one block: nothing else hits
    n1, n2 = first["usage"]["prompt_tokens"], second["usage"]["prompt_tokens"]
    text = await scrape(http, server)
    assert metric_value(text, "ownerserve_emulator_chunk_tokens_reused_total") == len(DOC_A)
    assert metric_value(text, "ownerserve_emulator_chunks_stored_total") == 3
    computed = metric_value(text, "ownerserve_emulator_prefill_tokens_computed_total")
    assert computed == n1 + n2 - len(DOC_A)
    by_source = "vllm:prompt_tokens_by_source_total"
    assert metric_value(text, by_source, source="local_cache_hit") == len(DOC_A)
    assert second_s < first_s * 0.8  # ~330 tokens computed instead of ~630
    blocks = (await http.get(server.url + "/kv_blocks")).json()
    assert len(blocks["chunk_hashes"]) == 3


async def test_legolink_recomputes_the_first_tokens_of_each_reused_chunk(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    server = await start_emulator(chunk_recompute_tokens=16)
    # another system segment: another hash, nothing reused
    prompts = (f"sys##{DOC_A}##q1", f"other##{DOC_B}##{DOC_A}##q2", f"sys##{DOC_B}##{DOC_A}##q3")
    assert await cached_tokens(http, server, *prompts) == [0, 0, len(DOC_A) - 16]


async def test_without_a_chunk_store_the_layout_is_ignored(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    server = await start_emulator(chunk_store_tokens=0)
    prompts = (f"sys##{DOC_A}##q1", f"sys##{DOC_B}##{DOC_A}##q2")
    assert await cached_tokens(http, server, *prompts) == [0, 0]


async def test_a_malformed_layout_is_a_400(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    server = await start_emulator()
    body = completion("sys##doc##q")
    body["kv_transfer_params"]["ownerserve"]["chunks"][0]["end"] = 10_000
    resp = await http.post(server.url + "/v1/completions", json=body)
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "invalid_request_error"


async def test_a_chunk_fetch_copies_chunks_from_a_peers_store_paying_the_link(
    start_emulator: StartEmulator, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    # the link: 10 ms latency + 1 GB/s, so 600 tokens of KV (131072 bytes each) take ~90 ms
    profile = write_profile(
        tmp_path, rerotate_per_token_s=1e-6, link__latency_s=0.01, link__intra_node_bps=1e9
    )
    src = await start_emulator(profile=profile)
    dst = await start_emulator(profile=profile)
    body = completion(f"sys##{DOC_A}##{DOC_B}##q1")
    await post(http, src.url, body)
    chunks = [int(c["hash"], 16) for c in body["kv_transfer_params"]["ownerserve"]["chunks"]]
    assert len(chunks) == 2
    fetch = {"source_url": src.url, "chunk_hashes": [*chunks, 12345], "model": MODEL}
    resp = await http.post(dst.url + "/ownerserve/kv/fetch_chunks", json=fetch)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["chunks"] == chunks and out["fetched"] == 2 and out["missing"] == [12345]
    assert out["bytes"] == (len(DOC_A) + len(DOC_B)) * 131072
    # the link's time for those bytes, as `link.transfer_s` models it
    assert out["seconds"] >= 0.01 + out["bytes"] / 1e9 - 1e-6
    stored = (await http.get(dst.url + "/kv_blocks")).json()["chunk_hashes"]
    assert sorted(int(h, 16) for h in stored) == sorted(chunks)
    # the fetched chunks are reused there, at another position
    again, _ = await post(http, dst.url, completion(f"sys##{DOC_C}##{DOC_B}##{DOC_A}##q2"))
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(DOC_A) + len(DOC_B)
    text = await scrape(http, dst)
    assert metric_value(text, "ownerserve_emulator_chunks_fetched_total") == 2
    assert (
        metric_value(text, "ownerserve_emulator_kv_received_bytes_total", kind="chunk")
        == (out["bytes"])
    )
    # already held: nothing moves; a source without the chunks gives none; bad input is a 400
    again_out = (await http.post(dst.url + "/ownerserve/kv/fetch_chunks", json=fetch)).json()
    assert again_out["already_held"] == 2 and again_out["bytes"] == 0
    back = {"source_url": dst.url, "chunk_hashes": [999]}
    none = (await http.post(src.url + "/ownerserve/kv/fetch_chunks", json=back)).json()
    assert none["chunks"] == [] and none["missing"] == [999]
    bad = await http.post(dst.url + "/ownerserve/kv/fetch_chunks", json={"source_url": src.url})
    assert bad.status_code == 400
