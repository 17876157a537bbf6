"""The scheduler on its own: chunked prefill within the token budget, `max_num_seqs`, the step
time formula, and the pacing of steps in real time."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from ownerserve.hashing import block_hash_chain, chain_root
from ownerserve.profiles import TimingProfile, profile_from_dict
from ownerserve.tokenizer import ByteTokenizer
from workers.emulator.engine import Engine, SamplingParams, Sequence
from workers.emulator.kv_cache import BlockPool
from workers.emulator.metrics import EngineMetrics
from workers.emulator.textgen import OutputText, Vocabulary

ROOT = chain_root("m")
VOCAB = Vocabulary(ByteTokenizer())


def profile(**over: Any) -> TimingProfile:
    data: dict[str, Any] = {
        "name": "t",
        "prefill": {"base_s": 0.002, "per_token_s": 1e-5, "per_token_ctx_s": 1e-8},
        "decode": {"base_s": 0.003, "per_seq_s": 1e-4, "per_ctx_token_s": 1e-7},
        "link": {"intra_node_bps": 1e11, "inter_node_bps": 1e10, "latency_s": 0.0,
                 "cpu_load_bps": 1e10, "ssd_load_bps": 1e9},
        "kv_bytes_per_token": 1024,
        "hbm_kv_bytes": 1e9,
        "max_num_seqs": 8,
        "max_batched_tokens": 64,
    }  # fmt: skip
    data.update(over)
    return profile_from_dict(data)


def make_engine(prof: TimingProfile, num_blocks: int = 256, speed: float = 1.0) -> Engine:
    metrics = EngineMetrics("m", "w", "hybrid", prof.name)
    return Engine(prof, BlockPool(num_blocks, 16), metrics, root_hash=ROOT, speed=speed)


def seq(tokens: list[int], max_tokens: int, notify: asyncio.Event) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Sequence(
        "r", 0, tokens, block_hash_chain(tokens, 16, ROOT), params,
        OutputText(VOCAB, 1, max_tokens), notify, time.perf_counter(),
    )  # fmt: skip


async def run_to_end(engine: Engine, seqs: list[Sequence], notify: asyncio.Event) -> None:
    for s in seqs:
        engine.submit(s)
    while not all(s.finished for s in seqs):
        await notify.wait()
        notify.clear()


async def test_prefill_is_chunked_by_the_token_budget_and_timed_by_the_formula() -> None:
    prof = profile()
    engine = make_engine(prof, speed=100.0)
    notify = asyncio.Event()
    s = seq(list(range(200)), 3, notify)
    await run_to_end(engine, [s], notify)
    m = engine.metrics
    # 200 prompt tokens in chunks of 64: 64, 64, 64, 8 -> the 4th chunk samples token 1;
    # two decode steps follow for tokens 2 and 3.
    assert m.steps == 6
    expected = sum(prof.prefill_s(n, c) for n, c in ((64, 0), (64, 64), (64, 128), (8, 192)))
    expected += prof.decode_step_s(1, 201) + prof.decode_step_s(1, 202)
    assert m.busy_s == pytest.approx(expected)
    assert m.prefill_tokens_computed == 200 and m.decode_tokens_computed == 2
    assert s.out_ids and len(s.out_ids) == 3 and s.finish_reason == "length"
    await engine.close()


async def test_max_num_seqs_bounds_the_batch_and_decodes_share_a_step() -> None:
    prof = profile(max_num_seqs=2, max_batched_tokens=4096)
    engine = make_engine(prof, speed=100.0)
    notify = asyncio.Event()
    seqs = [seq([i] * 20, 5, notify) for i in range(3)]
    for s in seqs:
        engine.submit(s)
    await asyncio.sleep(0)  # the step loop schedules its first step
    assert engine.num_running == 2 and engine.num_waiting == 1
    while not all(s.finished for s in seqs):
        await notify.wait()
        notify.clear()
    assert all(len(s.out_ids) == 5 for s in seqs)
    await engine.close()


async def test_steps_are_slept_in_real_time_divided_by_speed() -> None:
    # 20 decode steps of 50 ms: 1 s at speed 1, 0.25 s at speed 4. The upper bounds leave a
    # busy machine a few hundred ms of pauses and still tell speed 4 from speed 1 (or 2).
    prof = profile(decode={"base_s": 0.05, "per_seq_s": 0.0, "per_ctx_token_s": 0.0})
    for speed, lo, hi in ((1.0, 0.95, 2.0), (4.0, 0.24, 0.5)):
        engine = make_engine(prof, speed=speed)
        notify = asyncio.Event()
        t0 = time.perf_counter()
        await run_to_end(engine, [seq([1] * 10, 21, notify)], notify)  # 20 decode steps
        took = time.perf_counter() - t0
        assert lo < took < hi, (speed, took)
        assert engine.metrics.busy_s == pytest.approx(1.0 + prof.prefill_s(10, 0))
        await engine.close()
