"""The CPU tier behind HBM (vLLM's KV offloading): prompt blocks written through to CPU memory,
a prefix evicted from HBM served from CPU at the host-to-device bandwidth, its accounting and
events. The engine on its own, then a real emulator process over HTTP and ZMQ, then the router's
KV event subscriber filling a directory's CPU tier."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from typing import Any

import httpx
import msgpack
import pytest

from ownerserve.directory.memory import InMemoryDirectory
from ownerserve.errors import ConfigError
from ownerserve.events import BlockRemoved, BlockStored, KVEvent
from ownerserve.hashing import block_hash_chain, chain_root
from ownerserve.ports import free_port
from ownerserve.profiles import TimingProfile, profile_from_dict
from ownerserve.tokenizer import ByteTokenizer, ChatTemplate
from ownerserve.types import Tier
from ownerserve.vllm_events import decode_message
from router.backends import parse_load_metrics
from tests.waiting import until
from tests.workers.emulator.conftest import StartEmulator, metric_value, scrape
from tests.workers.emulator.zmq_subscriber import ZmqSubscriber
from workers.emulator.config import DEFAULT_MODEL as MODEL
from workers.emulator.config import EmulatorConfig, add_arguments, config_from_args
from workers.emulator.engine import Engine, SamplingParams, Sequence
from workers.emulator.kv_cache import BlockPool, HostPool
from workers.emulator.metrics import EngineMetrics
from workers.emulator.textgen import OutputText, Vocabulary

ROOT = chain_root("m")
BS = 16
VOCAB = Vocabulary(ByteTokenizer())


def profile(cpu_load_bps: float = 1e6) -> TimingProfile:
    return profile_from_dict(
        {
            "name": "t",
            "prefill": {"base_s": 0.0, "per_token_s": 1e-5, "per_token_ctx_s": 0.0},
            "decode": {"base_s": 0.001, "per_seq_s": 0.0, "per_ctx_token_s": 0.0},
            "link": {"intra_node_bps": 1e11, "inter_node_bps": 1e10, "latency_s": 0.0,
                     "cpu_load_bps": cpu_load_bps, "ssd_load_bps": 1e9},
            "kv_bytes_per_token": 1024,
            "hbm_kv_bytes": 1e9,
            "max_num_seqs": 8,
            "max_batched_tokens": 4096,
        }
    )  # fmt: skip


class Harness:
    """An engine with a CPU tier, its published events, and a way to run requests to the end."""

    def __init__(self, hbm_blocks: int, cpu_blocks: int, prof: TimingProfile) -> None:
        self.events: list[KVEvent] = []
        self.host = HostPool(cpu_blocks, BS)
        self.engine = Engine(
            prof,
            BlockPool(hbm_blocks, BS),
            EngineMetrics("m", "w", "hybrid", prof.name),
            root_hash=ROOT,
            publish=self.events.extend,
            host=self.host,
        )
        self.notify = asyncio.Event()
        self._n = 0

    async def run(self, tokens: list[int], max_tokens: int = 2) -> Sequence:
        self._n += 1
        s = Sequence(
            f"r{self._n}", 0, tokens, block_hash_chain(tokens, BS, ROOT),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            OutputText(VOCAB, self._n, max_tokens), self.notify, time.perf_counter(),
        )  # fmt: skip
        self.engine.submit(s)
        while not s.finished:
            await self.notify.wait()
            self.notify.clear()
        return s


def prompt(i: int, n: int = 100) -> list[int]:
    return [i * 1000 + k for k in range(n)]


async def test_computed_prompt_blocks_are_written_through_to_the_cpu_tier() -> None:
    h = Harness(64, 64, profile())
    s = await h.run(prompt(1, 100), max_tokens=40)  # 6 full prompt blocks, output fills more
    prompt_hashes = block_hash_chain(prompt(1, 100), BS, ROOT)
    # The prompt's blocks only, in eviction order: the finished request's tail goes first.
    assert h.host.cached_hashes() == prompt_hashes[::-1]
    assert len(s.hashes) > len(prompt_hashes)  # output blocks went to HBM, not to CPU
    cpu = [e for e in h.events if isinstance(e, BlockStored) and e.tier == Tier.CPU]
    assert [e.engine_hashes for e in cpu] == [(x,) for x in prompt_hashes]
    assert cpu[3].parent_engine_hash == prompt_hashes[2] and cpu[3].block_size == BS
    assert cpu[3].token_ids == tuple(prompt(1, 100)[48:64])
    await h.engine.close()


async def test_a_prefix_evicted_from_hbm_is_loaded_from_cpu_and_only_its_tail_computed() -> None:
    prof = profile(cpu_load_bps=1e6)
    h = Harness(10, 64, prof)
    m = h.engine.metrics
    await h.run(prompt(1))
    for i in (2, 3):  # other traffic evicts the first prompt from HBM
        await h.run(prompt(i))
    hashes = block_hash_chain(prompt(1), BS, ROOT)
    assert h.engine.pool.match_prefix(hashes) == 0 and h.host.match_prefix(hashes) == 6
    computed_before = m.prefill_tokens_computed
    h.events.clear()

    s = await h.run(prompt(1))

    assert m.prefill_tokens_computed - computed_before == 4  # 100 - 6 blocks of 16
    assert s.cached_tokens == 96
    assert m.prompt_tokens_cached_by_source["host"] == 96
    assert m.prompt_tokens_by_source["external_kv_transfer"] == 96
    load_bytes = 6 * BS * prof.kv_bytes_per_token
    assert m.kv_offload_load_bytes == load_bytes
    assert m.kv_offload_load_s == pytest.approx(load_bytes / prof.link.cpu_load_bps)
    assert s.first_token_at - s.arrival >= load_bytes / prof.link.cpu_load_bps  # in its TTFT
    # Once loaded, the blocks are cached in HBM again; they are not stored to CPU twice.
    gpu = [x for e in h.events if isinstance(e, BlockStored) and e.tier == Tier.GPU
           for x in e.engine_hashes]  # fmt: skip
    assert gpu[:6] == hashes
    assert not [e for e in h.events if isinstance(e, BlockStored) and e.tier == Tier.CPU]
    assert h.engine.pool.match_prefix(hashes) == 6 and h.host.usage == 0.0
    await h.engine.close()


async def test_an_hbm_hit_is_extended_by_the_cpu_tier_past_where_hbm_stops() -> None:
    h = Harness(10, 64, profile(cpu_load_bps=1e9))
    m = h.engine.metrics
    base = prompt(1, 48)  # 3 blocks shared by both prompts
    await h.run(base + prompt(2, 60))
    await h.run(prompt(3, 100))  # evicts the tail blocks first (LRU), keeps the shared prefix
    hashes = block_hash_chain(base + prompt(2, 60), BS, ROOT)
    hbm = h.engine.pool.match_prefix(hashes)
    assert 0 < hbm < 6 and h.host.match_prefix(hashes) == 6
    s = await h.run(base + prompt(2, 60))
    assert s.cached_tokens == 96
    assert m.prompt_tokens_cached_by_source["device"] == hbm * BS
    assert m.prompt_tokens_cached_by_source["host"] == (6 - hbm) * BS
    await h.engine.close()


async def test_a_full_cpu_tier_evicts_its_least_recent_blocks_with_a_cpu_removal() -> None:
    h = Harness(64, 8, profile())
    await h.run(prompt(1, 64))  # 4 blocks
    await h.run(prompt(2, 64))  # 4 more: full
    await h.run(prompt(3, 32))  # 2 more: the oldest request's tail goes first
    first = block_hash_chain(prompt(1, 64), BS, ROOT)
    removed = [e for e in h.events if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved((first[3], first[2]), Tier.CPU)]
    assert h.host.num_cached == 8 and h.host.evicted_blocks == 2
    assert h.engine.pool.match_prefix(first) == 4  # HBM still has them
    await h.engine.close()


# --- HBM pressure: parked CPU loads must not leave requests waiting for ever ----------------------


async def cpu_only(h: Harness, *prompts: list[int]) -> None:
    """Run `prompts` (writing them through to CPU), then evict them from HBM with other traffic."""
    for p in prompts:
        await h.run(p)
    for i in (91, 92):
        await h.run(prompt(i, 320))  # 20 blocks each, of a 22-block pool
    for p in prompts:
        hashes = block_hash_chain(p, BS, ROOT)
        assert h.engine.pool.match_prefix(hashes) == 0 and h.host.match_prefix(hashes) == 6


async def test_a_cpu_load_waits_for_blocks_an_earlier_load_still_needs() -> None:
    # Both prompts fit HBM whole on their own, not together. The first load holds 6 blocks and
    # needs 11 more to run; had the second load taken 6 of the 16 left, both would hold blocks
    # waiting for more with nothing running to free any. vLLM reserves in-flight loads' blocks.
    h = Harness(22, 200, profile(cpu_load_bps=1e6))
    await cpu_only(h, prompt(1, 96), prompt(2, 96))
    a = prompt(1, 96) + prompt(5, 170)  # 17 blocks whole
    b = prompt(2, 96) + prompt(6, 154)  # 16 blocks whole
    async with asyncio.timeout(10):
        sa, sb = await asyncio.gather(h.run(a), h.run(b))
    assert sa.host_tokens == sb.host_tokens == 96  # both served their prefix from CPU
    assert sb.admitted_at >= sa.finished_at  # the second load waited for the first to finish
    await h.engine.close()


async def test_a_loaded_request_runs_once_a_running_one_preempts_itself() -> None:
    # A loaded request waits for blocks a running one holds; when that one cannot grow and
    # preempts itself, the freed blocks must be used at once (no later event wakes the engine).
    h = Harness(22, 200, profile(cpu_load_bps=1e9))  # loaded before the other fills the pool
    await cpu_only(h, prompt(1, 96))
    a = prompt(1, 96) + prompt(5, 170)  # 6 blocks loaded, 11 more to run
    async with asyncio.timeout(10):
        sa, sx = await asyncio.gather(h.run(a), h.run(prompt(7, 200), max_tokens=100))
    assert h.engine.metrics.preemptions == 1
    assert sa.host_tokens == 96 and sx.finish_reason == "length"
    await h.engine.close()


# --- a real emulator process: HTTP, /metrics, KV events over ZMQ ----------------------------------


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{i} conversation " + "a" * 80}]  # 124 tokens: 7 blocks


def chain_of(i: int, salt: str = "") -> list[int]:
    ids = ByteTokenizer().encode(ChatTemplate().render(messages(i)))
    assert len(ids) == 124
    return block_hash_chain(ids, BS, chain_root(MODEL, salt))


async def chat(http: httpx.AsyncClient, url: str, msgs: list[dict[str, str]]) -> None:
    body = {"messages": msgs, "max_tokens": 2, "ignore_eos": True}
    resp = await http.post(url + "/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text


class RawSubscriber(ZmqSubscriber):
    """A ZMQ SUB socket keeping each event's wire map next to its decoded form."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint)
        self.events: list[tuple[dict[str, Any], KVEvent]] = []

    async def drain(self, quiet_s: float = 0.3) -> list[tuple[dict[str, Any], KVEvent]]:
        async for frames in self.messages(quiet_s):
            wire = msgpack.unpackb(frames[2], raw=False)[1]
            self.events.extend(zip(wire, decode_message(frames).events, strict=True))
        return self.events


async def wait_healthy(http: httpx.AsyncClient, url: str, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(300):
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        with contextlib.suppress(httpx.HTTPError):
            if (await http.get(url + "/health", timeout=0.5)).status_code == 200:
                return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{url} not healthy")


async def test_an_emulator_process_serves_an_evicted_prompt_from_its_cpu_tier(
    http: httpx.AsyncClient,
) -> None:
    port, events_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "workers.emulator", "--port", str(port),
           "--profile", "fast-test", "--num-blocks", "12", "--cpu-num-blocks", "24",
           "--kv-events-port", str(events_port), "--worker-id", "c0"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    sub = RawSubscriber(f"tcp://127.0.0.1:{events_port}")
    try:
        await wait_healthy(http, url, proc)
        probes = 0

        async def heard() -> bool:  # ZMQ's slow joiner: probe until events arrive
            nonlocal probes
            probes += 1
            await chat(http, url, [{"role": "user", "content": f"probe {probes}"}])
            return bool(await sub.drain(0.05))

        await until(heard, what="a probe's KV events on the SUB socket")  # then start clean
        reset = await http.post(url + "/reset_prefix_cache?reset_external=true")
        assert reset.status_code == 200
        await sub.drain()
        sub.events.clear()

        for i in (0, 1, 2):  # 1 and 2 evict 0 from the 12-block HBM; CPU keeps all 21 blocks
            await chat(http, url, messages(i))
        a, b = chain_of(0), chain_of(1)
        held = (await http.get(url + "/kv_blocks")).json()
        assert not set(a) & set(held["block_hashes"])
        assert set(a) <= set(held["cpu_block_hashes"]) and held["cpu_blocks_held"] == 21
        before = await scrape_url(http, url)
        await sub.drain()
        stored_before = len(sub.events)

        await chat(http, url, messages(0))  # served from CPU: only the last 12 tokens computed

        after = await scrape_url(http, url)
        computed = "ownerserve_emulator_prefill_tokens_computed_total"
        assert metric_value(after, computed) - metric_value(before, computed) == 12
        host_hits = metric_value(after, "vllm:prompt_tokens_cached_by_source_total", source="host")
        assert host_hits == 7 * BS
        assert metric_value(after, "vllm:kv_offload_load_bytes_total") == 7 * BS * 131072
        reloaded = [e for _w, e in (await sub.drain())[stored_before:]]
        gpu_stored = [h for e in reloaded if isinstance(e, BlockStored) and e.tier == Tier.GPU
                      for h in e.engine_hashes]  # fmt: skip
        assert gpu_stored == a  # loaded into HBM and cached there
        assert not [e for e in reloaded if isinstance(e, BlockStored) and e.tier == Tier.CPU]

        await chat(http, url, messages(3))  # 7 more blocks: the CPU tier's 4 oldest must go

        events = await sub.drain()
        cpu_stores = [
            (w, e) for w, e in events if isinstance(e, BlockStored) and e.tier == Tier.CPU
        ]
        assert [e.engine_hashes for _w, e in cpu_stores[:7]] == [(h,) for h in a]
        wire = cpu_stores[1][0]
        assert wire["type"] == "BlockStored" and wire["medium"] == "CPU"
        assert wire["parent_block_hash"] == a[0] and wire["block_size"] == BS
        removed = [(w, e) for w, e in events if isinstance(e, BlockRemoved)]
        cpu_removed = [(w, e) for w, e in removed if e.tier == Tier.CPU]
        # b was used longest ago (a was loaded since): its tail goes first.
        assert [e for _w, e in cpu_removed] == [BlockRemoved(tuple(b[:-5:-1]), Tier.CPU)]
        assert cpu_removed[0][0] == {"type": "BlockRemoved", "block_hashes": b[:-5:-1],
                                     "medium": "CPU"}  # fmt: skip
        assert all(w["medium"] == "GPU" for w, e in removed if e.tier == Tier.GPU)

        text = await scrape_url(http, url)
        assert metric_value(text, "ownerserve_emulator_cpu_kv_blocks_held") == 24
        assert metric_value(text, "ownerserve_emulator_cpu_kv_blocks_capacity") == 24
        assert metric_value(text, "ownerserve_emulator_cpu_kv_blocks_evicted_total") == 4
        assert metric_value(text, "vllm:kv_offload_cpu_cache_usage_perc") == 0.0
        assert metric_value(text, "vllm:kv_cache_usage_perc") == 0.0
        stored = "vllm:kv_offload_store_bytes_total"  # the re-sent prompt stored nothing
        assert metric_value(text, stored) - metric_value(before, stored) == 7 * BS * 131072
    finally:
        sub.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def scrape_url(http: httpx.AsyncClient, url: str) -> str:
    resp = await http.get(url + "/metrics")
    resp.raise_for_status()
    return resp.text


async def test_without_a_cpu_tier_nothing_is_offloaded_and_no_offload_metrics_appear(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    server = await start_emulator(num_blocks=12)
    for i in (0, 1, 2, 0):
        await chat(http, server.url, messages(i))
    text = await scrape(http, server)
    assert "kv_offload" not in text and "cpu_kv_blocks" not in text
    assert metric_value(text, "vllm:prompt_tokens_cached_by_source_total", source="host") == 0
    assert "cpu_block_hashes" not in (await http.get(server.url + "/kv_blocks")).json()


# --- through the router's KV event subscriber into a directory ------------------------------------


async def test_the_routers_directory_sees_the_cpu_tiers_holdings(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    from router.backends.kv_events import KVEventSubscriber

    port, replay_port = free_port(), free_port()
    server = await start_emulator(
        num_blocks=12, cpu_kv_blocks=24, kv_events_port=port,
        kv_events_replay_port=replay_port, worker_id="w1", salt="cpu",
    )  # fmt: skip
    directory = InMemoryDirectory()
    await directory.register_worker("w1", chain_root(MODEL, "cpu"), BS)
    sub = KVEventSubscriber(
        "w1", f"tcp://127.0.0.1:{port}", directory,
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
    )  # fmt: skip
    await sub.start()

    async def held(i: int, tier: Tier, blocks: int) -> None:
        """Until the directory shows `blocks` of prompt `i` in `tier` (a batch the SUB socket
        missed comes from the replay socket after the subscriber's quiet interval)."""

        async def there() -> bool:
            return (await directory.lookup(chain_of(i, "cpu"))).longest("w1", tier) == blocks

        await until(there, what=f"prompt {i}: {blocks} blocks in {tier}")

    try:
        for i in (0, 1, 2):
            await chat(http, server.url, messages(i))
        await held(2, Tier.GPU, 7)
        await held(0, Tier.GPU, 0)  # evicted from HBM...
        await held(0, Tier.CPU, 7)  # ...still in the CPU tier
        await chat(http, server.url, messages(0))  # loaded from CPU: in both tiers now
        await held(0, Tier.GPU, 7)
        await chat(http, server.url, messages(3))  # the CPU tier evicts 1's last 4 blocks
        await held(1, Tier.CPU, 3)
        await held(0, Tier.CPU, 7)
        assert sub.stats.skipped_blocks == 0
    finally:
        await sub.close()


def test_the_cpu_tier_is_off_by_default_and_sized_by_its_flag() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args([])).cpu_kv_blocks == 0
    assert config_from_args(parser.parse_args(["--cpu-num-blocks", "64"])).cpu_kv_blocks == 64
    with pytest.raises(ConfigError, match="--cpu-num-blocks"):
        EmulatorConfig(cpu_kv_blocks=-1)


async def test_metrics_tell_the_router_the_pools_size_as_vllm_does(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    server = await start_emulator(num_blocks=12, block_size=16)
    load = parse_load_metrics(await scrape_url(http, server.url))
    assert load.kv_capacity_tokens == 12 * 16
