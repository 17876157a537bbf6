"""The SWA checkpoint policy: which boundaries are restorable, what each policy writes, what a
restore then costs, and the cost-based period p* (hand-computed values)."""

import pytest

from ownerserve.errors import ConfigError
from ownerserve.kvstate import (
    SwaCaching,
    SwaCostInputs,
    SwaPolicy,
    cost_based_period,
    expected_swa_restore,
    load_spec,
    resolve_swa_policy,
    spec_from_dict,
    swa_period_candidates,
    swa_policy_cost,
    swa_restore_at,
)

V4 = load_spec("deepseek-v4")
QWEN = load_spec("qwen3-8b-swa")
LLAMA = load_spec("llama3-8b")
V4_WINDOW = 61 * 128 * 576  # 4,497,408 B: every layer's 128-entry window of 576 B entries

# One 4-token window layer (K and V of one 8-dim bf16 head: 32 B an entry) over one dense
# layer; blocks of 2 tokens; rebuilding the window recomputes n_win·L = 4 tokens.
TINY = spec_from_dict(
    {
        "name": "tiny-swa",
        "num_layers": 2,
        "block_tokens": 2,
        "kinds": {
            "swa": {"attention": "swa", "kv_heads": 1, "head_dim": 8, "window": 4},
            "full": {"attention": "dense", "kv_heads": 1, "head_dim": 8},
        },
        "pattern": ["swa", "full"],
    }
)


def _inputs(**kw: float) -> SwaCostInputs:
    base: dict[str, float] = {
        "session_tokens": 8,
        "restores": 1.0,
        "load_bps": 128.0,  # a full 4-entry window (128 B) loads in 1 s
        "load_latency_s": 0.0,
        "recompute_s_per_token": 1.0,
        "alpha": 0.001,
    }
    base.update(kw)
    return SwaCostInputs(**base)  # type: ignore[arg-type]


def test_which_boundaries_each_policy_can_restore() -> None:
    full, zero, p4096 = SwaPolicy.full(), SwaPolicy.zero(), SwaPolicy.periodic(4096)
    assert [full.checkpoint_at(s) for s in (128, 5120)] == [128, 5120]
    assert [p4096.checkpoint_at(s) for s in (128, 4096, 5120, 12288)] == [0, 4096, 4096, 12288]
    assert zero.checkpoint_at(12288) == 0
    assert full.restorable(128) and not zero.restorable(128)
    assert p4096.restorable(8192) and not p4096.restorable(8320)
    assert SwaPolicy.cost_based(0).checkpoint_at(8192) == 0  # p* = 0: zero caching
    assert SwaPolicy.cost_based(2048).restorable(6144)
    with pytest.raises(ValueError, match="resolved"):
        SwaPolicy.cost_based().checkpoint_at(4096)
    with pytest.raises(ValueError, match="period_tokens > 0"):
        SwaPolicy.periodic(0)
    assert [
        str(p) for p in (full, zero, p4096, SwaPolicy.cost_based(), SwaPolicy.cost_based(256))
    ] == [
        "full",
        "zero",
        "periodic(4096)",
        "cost",
        "cost(256)",
    ]


def test_write_bytes_per_policy() -> None:
    per_token = 61 * 576  # 35136 B of window entries a token adds over all window layers
    assert V4.swa_write_bytes(SwaPolicy.full(), 1000) == 1000 * per_token == 35_136_000
    # two checkpoints (4096, 8192) of a whole 128-entry window each
    assert V4.swa_write_bytes(SwaPolicy.periodic(4096), 10_000) == 2 * V4_WINDOW == 8_994_816
    # p < window: the windows overlap, their union is 15 · 64 entries
    assert V4.swa_write_bytes(SwaPolicy.periodic(64), 1000) == 15 * 64 * per_token == 33_730_560
    assert V4.swa_write_bytes(SwaPolicy.zero(), 10_000) == 0
    # Qwen3 hybrid: 27 window layers of 4096-entry windows, 4096 B entries
    assert QWEN.swa_write_bytes(SwaPolicy.periodic(1024), 10_000) == 9 * 1024 * 27 * 4096
    assert LLAMA.swa_write_bytes(SwaPolicy.full(), 10_000) == 0  # no windows


def test_a_restore_at_a_boundary_loads_the_checkpoint_or_recomputes_the_windows() -> None:
    inp = SwaCostInputs(
        session_tokens=20_000,
        restores=1.0,
        load_bps=1e10,
        load_latency_s=1e-3,
        recompute_s_per_token=1e-4,
        alpha=0.0,
    )
    p4096 = SwaPolicy.periodic(4096)
    # S = 5120: checkpoint at 4096, then [4096, 5120) recomputed
    r = swa_restore_at(V4, p4096, 5120, inp)
    assert r.latency_s == pytest.approx(1e-3 + V4_WINDOW / 1e10 + 1024 * 1e-4)  # 0.10385 s
    assert (r.recompute_tokens, r.load_bytes) == (1024, V4_WINDOW)
    # a checkpoint exactly there: load only
    r = swa_restore_at(V4, p4096, 12288, inp)
    assert r.latency_s == pytest.approx(1e-3 + V4_WINDOW / 1e10) and r.recompute_tokens == 0
    # zero caching: the last n_win·L = 7808 tokens (all 5120 when fewer)
    assert swa_restore_at(V4, SwaPolicy.zero(), 5120, inp).latency_s == pytest.approx(0.512)
    assert swa_restore_at(V4, SwaPolicy.zero(), 12288, inp).recompute_tokens == 7808
    # a stale checkpoint (7808 tokens back) loses to recomputing the windows from scratch
    r = swa_restore_at(V4, SwaPolicy.periodic(8192), 16000, inp)
    assert (r.recompute_tokens, r.load_bytes) == (7808, 0)
    assert r.latency_s == pytest.approx(0.7808)


def test_expected_restore_and_cost_by_hand() -> None:
    # TINY, n = 8: boundaries S = 2, 4, 6, 8; ρ = 1 s, a window of min(4, q) entries loads in
    # min(4, q)/4 s
    inp = _inputs()
    # zero: recompute min(S, 4) = 2, 4, 4, 4
    assert expected_swa_restore(TINY, SwaPolicy.zero(), inp) == (3.5, 3.5)
    # full: load 0.5, 1, 1, 1
    assert expected_swa_restore(TINY, SwaPolicy.full(), inp) == (0.875, 0.0)
    # every 4: S=2 recompute 2; S=4 load 1; S=6 load 1 + recompute 2 (3 < 4); S=8 load 1
    assert expected_swa_restore(TINY, SwaPolicy.periodic(4), inp) == (1.75, 1.0)
    # writes: full 8 entries · 32 B; every 8: one window of 4 entries
    assert TINY.swa_write_bytes(SwaPolicy.full(), 8) == 256
    assert TINY.swa_write_bytes(SwaPolicy.periodic(8), 8) == 128
    # J = α·writes + R·(β·latency + γ·ρ·recompute)
    assert swa_policy_cost(TINY, SwaPolicy.full(), inp) == pytest.approx(0.256 + 0.875)
    j = swa_policy_cost(TINY, SwaPolicy.periodic(4), _inputs(restores=2.0, gamma=0.5))
    assert j == pytest.approx(0.256 + 2 * (1.75 + 0.5 * 1.0))


def test_the_cost_based_period_follows_the_price_of_a_written_byte() -> None:
    assert swa_period_candidates(TINY, 8) == (0, 1, 2, 4, 8)
    # α = 0.001: full costs 1.131 against zero's 3.5
    assert cost_based_period(TINY, _inputs(alpha=0.001)) == 1
    # α = 0.02: full 5.995, every 8 5.31, zero 3.5
    assert cost_based_period(TINY, _inputs(alpha=0.02)) == 0
    # no restores expected: nothing is worth writing
    assert cost_based_period(TINY, _inputs(restores=0.0)) == 0
    assert cost_based_period(LLAMA, _inputs()) == 0  # no windows, nothing to checkpoint


def test_the_cost_based_period_is_the_argmin_over_its_candidates_on_v4() -> None:
    inp = SwaCostInputs(
        session_tokens=100_000,
        restores=10.0,
        load_bps=6e9,
        load_latency_s=2e-4,
        recompute_s_per_token=4e-5 + 1.3e-9 * 50_000,
        alpha=1 / 6e9,
    )
    p = cost_based_period(V4, inp)
    costs = {
        c: swa_policy_cost(V4, SwaPolicy.cost_based(c), inp)
        for c in swa_period_candidates(V4, 100_000)
    }
    assert costs[p] == min(costs.values())
    assert p not in (0, 1)  # neither extreme: the windows are worth a checkpoint now and then
    resolved = resolve_swa_policy(V4, SwaPolicy.cost_based(), inp)
    assert resolved == SwaPolicy.cost_based(p) and resolved.caching is SwaCaching.COST
    assert resolve_swa_policy(V4, SwaPolicy.zero(), inp) == SwaPolicy.zero()


def test_the_spec_file_sets_the_policy() -> None:
    assert V4.swa_policy == SwaPolicy.periodic(4096)  # the default when the file is silent
    base = {
        "name": "t",
        "num_layers": 1,
        "block_tokens": 2,
        "kinds": {"swa": {"attention": "swa", "kv_heads": 1, "head_dim": 8, "window": 4}},
        "pattern": ["swa"],
    }
    for value, want in (
        ("full", SwaPolicy.full()),
        ("zero", SwaPolicy.zero()),
        ("cost", SwaPolicy.cost_based()),
        ({"periodic": 256}, SwaPolicy.periodic(256)),
    ):
        assert spec_from_dict({**base, "swa_policy": value}).swa_policy == want
    for bad in ("sometimes", {"periodic": 0}, {"periodic": True}, {"every": 4}):
        with pytest.raises(ConfigError, match="swa_policy"):
            spec_from_dict({**base, "swa_policy": bad}, "x.yaml")
