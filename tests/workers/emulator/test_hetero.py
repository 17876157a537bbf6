"""HeteroCache in the emulated engine, on its own: a DeepSeek-V4-like spec's groups beside the
block pool, window blocks freed past the window and kept where the retention policy says, a
prefix hit only where every group can be restored (or the windows rebuilt, charged to the step),
CPU-tier loads sized by the spec, KV events tagged per group."""

from __future__ import annotations

import asyncio
import time

import pytest

from ownerserve.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from ownerserve.hashing import block_hash_chain, chain_root
from ownerserve.kvstate import StateType, SwaPolicy, load_spec
from ownerserve.kvstate.retention import FULL, ZERO, Retention
from ownerserve.profiles import TimingProfile, profile_from_dict
from ownerserve.tokenizer import ByteTokenizer
from workers.emulator.engine import Engine, SamplingParams, Sequence
from workers.emulator.hetero import HybridKV
from workers.emulator.kv_cache import BlockPool, HostPool
from workers.emulator.metrics import EngineMetrics
from workers.emulator.textgen import OutputText, Vocabulary

ROOT = chain_root("m")
BS = 128
V4 = load_spec("deepseek-v4")
VOCAB = Vocabulary(ByteTokenizer())
SEALED_BLOCK = 636096  # 128 tokens x 4969.5 B: CSA main + indexer + HCA


def profile() -> TimingProfile:
    return profile_from_dict(
        {
            "name": "t",
            "prefill": {"base_s": 0.0, "per_token_s": 1e-7, "per_token_ctx_s": 1e-12},
            "decode": {"base_s": 1e-4, "per_seq_s": 0.0, "per_ctx_token_s": 0.0},
            "link": {"intra_node_bps": 1e11, "inter_node_bps": 1e10, "latency_s": 0.0,
                     "cpu_load_bps": 1e12, "ssd_load_bps": 1e9},
            "kv_bytes_per_token": 1024,
            "hbm_kv_bytes": 1e9,
            "max_num_seqs": 8,
            "max_batched_tokens": 1 << 16,
        }
    )  # fmt: skip


class Engine4:
    """An engine serving the V4-like spec, its published events collected."""

    def __init__(
        self,
        retention: Retention,
        host_blocks: int = 0,
        num_blocks: int = 512,
        offload: SwaPolicy | None = None,
    ) -> None:
        self.events: list[KVEvent] = []
        host_windows = host_blocks if offload is not None else 0
        self.hybrid = HybridKV(V4, BS, retention, num_blocks, offload, host_windows)
        self.host = HostPool(host_blocks, BS) if host_blocks else None
        self.metrics = EngineMetrics("m", "w", "hybrid", "t")
        self.metrics.hybrid = True
        self.engine = Engine(
            profile(), BlockPool(num_blocks, BS), self.metrics, root_hash=ROOT,
            speed=1000.0, publish=self.events.extend, host=self.host, hybrid=self.hybrid,
        )  # fmt: skip
        self.notify = asyncio.Event()

    async def run(self, tokens: list[int], max_tokens: int = 1) -> Sequence:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        s = Sequence(
            "r", 0, tokens, block_hash_chain(tokens, BS, ROOT), params,
            OutputText(VOCAB, 1, max_tokens), self.notify, time.perf_counter(),
        )  # fmt: skip
        self.engine.submit(s)
        while not s.finished:
            await self.notify.wait()
            self.notify.clear()
        return s

    def windows(self) -> set[int]:
        assert self.hybrid.pool is not None
        return set(self.hybrid.pool.cached_hashes())


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(i * 7 + seed) % 251 + 1 for i in range(n)]


async def test_windows_past_the_window_are_dropped_but_the_retained_boundary_stays() -> None:
    e = Engine4(ZERO)
    s = await e.run(tokens(1000), max_tokens=300)  # 1299 computed: 10 full blocks
    assert e.engine.pool.match_prefix(s.hashes) == 10  # every sealed block stays cached
    # window of 128 tokens = 1 block; zero retention keeps only the last prompt boundary (7)
    assert e.windows() == {s.hashes[6]}
    f = Engine4(FULL)
    s = await f.run(tokens(1000), max_tokens=300)
    assert f.windows() == set(s.hashes[:10])
    p = Engine4(Retention(512))
    s = await p.run(tokens(1000), max_tokens=300)  # boundaries 512, 1024 and 896 (prompt's)
    assert p.windows() == {s.hashes[3], s.hashes[6], s.hashes[7]}


async def test_a_hit_resumes_only_where_the_windows_are_cached() -> None:
    for retention, want_hit, how in ((FULL, 10 * BS, "cached"), (ZERO, 7 * BS, "truncated")):
        e = Engine4(retention)
        first = await e.run(tokens(1000), max_tokens=300)
        turn2 = first.prompt_ids + first.out_ids + tokens(200, seed=5)
        second = await e.run(turn2)
        # the sealed blocks reach block 10; under zero retention the windows only at 7:
        # recomputing 3 blocks beats rebuilding the windows over 1280 tokens
        assert second.cached_tokens == want_hit, retention
        assert e.metrics.resumes == {"cold": 1, how: 1}
        assert e.metrics.window_rebuild_tokens == 0


async def test_a_long_prefix_rebuilds_the_windows_charging_n_win_times_l_tokens() -> None:
    shared = tokens(100 * BS)
    runs = {}
    for retention in (FULL, ZERO):
        e = Engine4(retention)
        await e.run(shared + tokens(2000, seed=1))
        busy = e.metrics.busy_s
        second = await e.run(shared + tokens(2000, seed=2))
        runs[retention.name] = (e, second, e.metrics.busy_s - busy)
    e0, s0, t0 = runs["zero"]
    ef, sf, tf = runs["full"]
    # zero: the windows at block 100 are gone (kept at the first prompt's boundary, 115,
    # whose sealed blocks diverge); rebuilding costs 7808 tokens, less than 12800
    assert V4.swa_recompute_tokens == 7808
    assert s0.cached_tokens == sf.cached_tokens == 100 * BS
    assert e0.metrics.resumes["rebuilt"] == 1 and ef.metrics.resumes["cached"] == 1
    assert e0.metrics.window_rebuild_tokens == 7808 and ef.metrics.window_rebuild_tokens == 0
    # the rebuild is charged to the step: a prefill of 7808 tokens over 12800 - 7808 cached
    extra = profile().prefill_s(7808, 100 * BS - 7808) - profile().prefill.base_s
    assert t0 - tf == pytest.approx(extra, rel=1e-6)


async def test_a_cold_resume_loads_sealed_kv_from_cpu_sized_by_the_spec() -> None:
    e = Engine4(ZERO, host_blocks=512)
    first = await e.run(tokens(100 * BS + 50))
    assert e.engine.pool.reset() and e.hybrid.pool is not None and e.hybrid.pool.reset()
    second = await e.run(first.prompt_ids + tokens(100, seed=3))
    assert second.cached_tokens == 100 * BS and second.host_tokens == 100 * BS
    m = e.metrics
    assert m.kv_offload_load_bytes == 100 * SEALED_BLOCK  # not the profile's 1024 B/token
    want = V4.state_bytes(0, 100 * BS)
    assert m.state_loaded_bytes == {
        t.value: want[t]
        for t in (StateType.COMPRESSED_CSA_MAIN, StateType.COMPRESSED_HCA,
                  StateType.COMPRESSED_CSA_INDEX)
    }  # fmt: skip
    # the CPU tier holds no windows: they were rebuilt over the loaded KV
    assert m.resumes["rebuilt"] == 1 and m.window_rebuild_tokens == 7808


@pytest.mark.parametrize(
    ("policy", "how", "resumed_at", "rebuilt"),
    [
        (SwaPolicy.full(), "cached", 100, 0),
        # checkpoints every 4096 tokens (32 blocks): the CPU part loads up to boundary 96 and
        # 4 blocks are computed, quicker than rebuilding at 100
        (SwaPolicy.periodic(4096), "truncated", 96, 0),
        (SwaPolicy.zero(), "rebuilt", 100, 7808),
    ],
)
async def test_a_cold_resume_restores_windows_by_the_off_gpu_policy(
    policy: SwaPolicy, how: str, resumed_at: int, rebuilt: int
) -> None:
    e = Engine4(FULL, host_blocks=512, offload=policy)
    first = await e.run(tokens(100 * BS + 50))
    assert e.engine.pool.reset() and e.hybrid.pool is not None and e.hybrid.pool.reset()
    second = await e.run(first.prompt_ids + tokens(100, seed=3))
    m = e.metrics
    assert second.cached_tokens == resumed_at * BS
    assert m.resumes[how] == 1 and m.window_rebuild_tokens == rebuilt
    windows = m.state_loaded_bytes.get("swa", 0)
    # the windows (128 entries x 61 layers x 576 B) come from the CPU only when cached there
    assert windows == (61 * 128 * 576 if how != "rebuilt" else 0)
    assert m.kv_offload_load_bytes == resumed_at * SEALED_BLOCK + (
        V4.mutable_bytes(resumed_at * BS) if windows else 0
    )


async def test_kv_events_are_tagged_per_group() -> None:
    e = Engine4(ZERO)
    s = await e.run(tokens(3 * BS + 10), max_tokens=200)
    stored: dict[int, set[int]] = {}
    removed: dict[int, set[int]] = {}
    kinds: dict[int, tuple[str | None, int | None]] = {}
    for ev in e.events:
        if isinstance(ev, BlockStored):
            assert ev.group_idx is not None
            stored.setdefault(ev.group_idx, set()).update(ev.engine_hashes)
            kinds[ev.group_idx] = (ev.group_kind, ev.sliding_window)
        elif isinstance(ev, BlockRemoved):
            assert ev.group_idx is not None
            removed.setdefault(ev.group_idx, set()).update(ev.engine_hashes)
        else:
            assert isinstance(ev, AllBlocksCleared)
    assert kinds == {
        0: ("compressed_attention", None),
        1: ("compressed_attention", None),
        2: ("compressed_indexer", None),
        3: ("sliding_window", 128),
        4: ("state", None),
        5: ("state", None),
    }
    full = set(s.hashes[:4])
    assert stored[0] == stored[1] == stored[2] == full and not removed.get(0)
    # the window group stores a block while it is in the window or a kept boundary needs it
    # (blocks 0 and 1 left the window in the prefill's step): the prompt's last boundary (3)
    # stays, the answer's block 3 is dropped at the end
    assert stored[3] == stored[4] == stored[5] == {s.hashes[2], s.hashes[3]}
    assert removed[3] == removed[4] == {s.hashes[3]}


def test_the_spec_is_chosen_per_model_and_a_dense_one_keeps_the_plain_pool() -> None:
    from ownerserve.errors import ConfigError
    from workers.emulator.config import EmulatorConfig

    assert EmulatorConfig().kv_state_spec() is None  # ownerserve-tiny: llama3-8b, dense
    assert EmulatorConfig(model="deepseek-ai/DeepSeek-V3").kv_state_spec() is None
    v4 = EmulatorConfig(model="deepseek-v4-like", block_size=128)
    spec = v4.kv_state_spec()
    assert spec is not None and spec.name == "deepseek-v4"
    # capacity by the sealed groups' bytes per block, not the profile's per-token KV
    prof = profile()
    assert v4.capacity_blocks(prof, spec) == int(1e9 // SEALED_BLOCK)
    hybrid = v4.hybrid_kv(spec, 100)
    assert hybrid is not None and hybrid.pool is not None and hybrid.pool.num_blocks == 100
    qwen = EmulatorConfig(kv_spec="qwen3-8b-swa", retention_interval=0).kv_state_spec()
    assert qwen is not None and qwen.name == "qwen3-8b-swa"
    with pytest.raises(ConfigError, match="multiple"):
        EmulatorConfig(model="deepseek-v4-like").kv_state_spec()  # 16-token blocks
    with pytest.raises(ConfigError):
        EmulatorConfig(retention_interval=-1)


def test_the_retention_flag_parses_like_vllms_interval() -> None:
    import argparse

    from workers.emulator.config import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for flag, want in (([], None), (["--prefix-cache-retention-interval", "0"], 0),
                       (["--prefix-cache-retention-interval", "4096"], 4096)):  # fmt: skip
        assert config_from_args(parser.parse_args(flag)).retention_interval == want
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefix-cache-retention-interval", "often"])
