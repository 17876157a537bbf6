"""The load-vs-recompute crossover (`planner.crossover`) on hand-computed numbers, and against a
brute-force scan of the same formulas."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ownerserve.profiles import PrefillTiming, TransportTiming
from planner.crossover import crossover_tokens, load_beats_recompute
from tests.planner.util import UNIT

# UNIT: base_s 0.01, per_token_s 1e-4, per_token_ctx_s 1e-8; K = 1000 B/token


def test_a_path_as_fast_per_token_as_prefill_crosses_where_the_context_term_pays_the_latency() -> (
    None
):
    # K / bps = 1e-4 = per_token_s: recompute − load = 5e-9·n² + 0.01 − 0.02 > 0 ⇔ n > 1414.2
    path = TransportTiming(bps=1e7, latency_s=0.02)
    assert crossover_tokens(UNIT, path, 1000) == 1415
    assert not load_beats_recompute(UNIT, path, 1000, 1414)
    assert load_beats_recompute(UNIT, path, 1000, 1415)


def test_marginal_leaves_base_out_of_the_recompute() -> None:
    # 5e-9·n² − 0.03 > 0 ⇔ n > 2449.5
    path = TransportTiming(bps=1e7, latency_s=0.03)
    assert crossover_tokens(UNIT, path, 1000, marginal=True) == 2450
    # with base_s: 5e-9·n² − 0.02 > 0 ⇔ n > 2000 (2000 itself only ties)
    assert crossover_tokens(UNIT, path, 1000) in (2000, 2001)


def test_a_latency_below_base_loads_from_the_first_token() -> None:
    assert crossover_tokens(UNIT, TransportTiming(bps=1e11, latency_s=1e-3), 1000) == 1


def test_without_a_context_term_the_crossover_is_the_linear_zero_or_never() -> None:
    flat = replace(UNIT, prefill=PrefillTiming(base_s=0.01, per_token_s=1e-4, per_token_ctx_s=0.0))
    # 1e-4 − 1000/2e7 = 5e-5 per token against 0.02012 − 0.01 s: n > 202.4
    assert crossover_tokens(flat, TransportTiming(bps=2e7, latency_s=0.02012), 1000) == 203
    # slower per token than prefill: recompute stays cheaper however long the prompt
    assert crossover_tokens(flat, TransportTiming(bps=1e6, latency_s=0.0), 1000) is None


def test_bytes_per_token_must_be_positive() -> None:
    with pytest.raises(ValueError):
        crossover_tokens(UNIT, TransportTiming(bps=1e9, latency_s=0.0), 0)


@settings(max_examples=40, deadline=None)
@given(
    base=st.sampled_from([0.0, 1e-3, 0.01]),
    a=st.sampled_from([1e-5, 1e-4]),
    c=st.sampled_from([0.0, 1e-9, 1e-8]),
    bps=st.sampled_from([1e6, 1e7, 1e8, 1e10]),
    lat=st.sampled_from([0.0, 1e-3, 0.05]),
    marginal=st.booleans(),
)
def test_the_crossover_is_the_first_token_count_from_which_loading_always_wins(
    base: float, a: float, c: float, bps: float, lat: float, marginal: bool
) -> None:
    # an exact per-token tie leaves only rounding to decide: not a crossover to pin down
    assume(c > 0 or a != 1000 / bps)
    prof = replace(UNIT, prefill=PrefillTiming(base_s=base, per_token_s=a, per_token_ctx_s=c))
    path = TransportTiming(bps=bps, latency_s=lat)
    n = crossover_tokens(prof, path, 1000, marginal=marginal)

    def wins(m: int) -> bool:
        return load_beats_recompute(prof, path, 1000, m, marginal=marginal)

    if n is None:
        assert not any(wins(m) for m in (10**3, 10**5, 10**7))
    else:
        assert n == 1 or not wins(n - 1)
        assert all(wins(m) for m in range(n, n + 3000))
