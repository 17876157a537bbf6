"""`bench.heterocache.hits`: the prediction is read from the plan's record alone (a move
credited with the blocks the planner priced, a hybrid resume where the engine's rule puts
it), and a run that fell back or fetched less is scored apart."""

from __future__ import annotations

from typing import Any

import pytest

from bench.heterocache.hits import outcome, peer_rows, predicted_tokens, resume_blocks
from loadgen.cluster import DEFAULT_PROFILE
from ownerserve.kvstate import load_spec
from ownerserve.kvstate.retention import Retention
from ownerserve.profiles import load_profile
from workers.emulator.hetero import HybridKV
from workers.emulator.kv_cache import NewBlock

PROFILE = load_profile(DEFAULT_PROFILE)


def record(action: str, reused: int, source: str | None = None, **extra: Any) -> dict[str, Any]:
    chosen = {"action": action, "decode_worker": "h1", "source_worker": source}
    return {"chosen": chosen | {"reused_blocks": reused}, "restorable": [], **extra}


@pytest.mark.parametrize("spec_name", ["qwen3-8b-swa", "deepseek-v4"])
def test_resume_blocks_is_where_the_emulated_engine_resumes(spec_name: str) -> None:
    """Against the emulator's own rule (`HybridKV.choose`, no CPU tier): windows cached at
    boundary k only, sealed blocks cached to `sealed`."""
    spec = load_spec(spec_name)
    bs = spec.block_tokens
    hashes = list(range(1, 400))
    outcomes = set()
    for sealed in (1, 8, 40, 200, 390):
        for k in sorted({0, 1, sealed // 2, sealed - 1, sealed}):
            hybrid = HybridKV(spec, bs, Retention(), 4000)
            assert hybrid.pool is not None
            lo = max(0, k - hybrid.window_blocks)
            hybrid.pool.register(
                [NewBlock(j, hashes[j], None, tuple(range(bs))) for j in range(lo, k)]
            )
            engine = hybrid.choose(hashes, sealed, PROFILE).blocks
            assert resume_blocks(spec, PROFILE, k, sealed) == engine, (sealed, k)
            outcomes.add(engine == sealed)
    assert outcomes == {True, False}  # both the rebuild and the truncation are seen


def test_a_move_is_credited_with_what_the_planner_priced() -> None:
    dense = load_spec("llama3-8b")
    mig = record("state_migration", 500, source="h0", fetched_blocks=[400, 400])
    assert predicted_tokens(mig, 10_000, dense, PROFILE) == 500 * 16
    assert predicted_tokens(mig, 100, dense, PROFILE) == 96  # the last token is computed
    # a hybrid move resumes where the destination's own windows let it (a fetch brings
    # none): h1's at block 1, whatever the source h0 holds; computing 7984 tokens over 16
    # beats rebuilding all 8000
    swa = load_spec("qwen3-8b-swa")
    mig["restorable"] = [
        {"worker": "h0", "tier": "gpu", "blocks": 500, "sealed_blocks": 500},
        {"worker": "h1", "tier": "gpu", "blocks": 1, "sealed_blocks": 1},
    ]
    assert predicted_tokens(mig, 10_000, swa, PROFILE) == 16
    assert predicted_tokens(mig, 10_000, swa, PROFILE, planner_only=True) == 500 * 16
    # h1 holding nothing: the rebuild recomputes all 8000 tokens, as cutting back to 0 would
    # (a tie: the engine rebuilds, and reports the 8000 as cached)
    mig["restorable"] = mig["restorable"][:1]
    assert predicted_tokens(mig, 10_000, swa, PROFILE) == 500 * 16


def test_fallbacks_and_partial_fetches_are_told_apart() -> None:
    assert outcome(record("colocated_prefill", 3)) == "as_planned"
    assert outcome(record("state_migration", 3, "h0", fetched_blocks=[3, 3])) == "as_planned"
    assert outcome(record("state_migration", 3, "h0", fetched_blocks=[1, 3])) == "partial_fetch"
    fb = {"ran": "colocated", "reason": "kv_fetch_empty", "gave_up": []}
    empty = record("state_migration", 3, "h0", fetched_blocks=[0, 3], fallback=fb)
    assert outcome(empty) == "fallback:kv_fetch_empty"


def test_the_peers_credits_are_scored_on_the_requests_that_moved_no_kv() -> None:
    def row(action: str, delivered: int, events: int, tree: int) -> dict[str, Any]:
        return {
            "action": action,
            "delivered": delivered,
            "kv_events_credit": events,
            "approx_tree_credit": tree,
        }

    rows = [
        row("colocated_prefill", 16, 4432, 4432),  # the windows cut it back to block 1
        row("colocated_prefill", 800, 800, 960),  # the tree missed an eviction
        row("state_migration", 0, 5000, 5000),  # a move: the peers would not have made it
        row("remote_prefill", 6912, 0, 0),  # D reports what it pulled
    ]
    peers = peer_rows(rows)
    assert peers["kv_events_credit"] == {
        "requests": 2,
        "credited_tokens": 5232,
        "delivered_tokens": 816,
        "error": pytest.approx((5232 - 816) / 816),
        "requests_differing": 1,
    }
    assert peers["approx_tree_credit"]["credited_tokens"] == 5392
    assert peers["approx_tree_credit"]["requests_differing"] == 2


def test_a_remote_prefill_is_credited_with_the_prompt_its_decode_worker_pulls() -> None:
    rp = record("remote_prefill", 0)
    swa = load_spec("qwen3-8b-swa")
    assert predicted_tokens(rp, 6923, swa, PROFILE) == 6912
    assert predicted_tokens(rp, 6923, swa, PROFILE, planner_only=True) == 6912
