"""The resume rule (`ownerserve.kvstate.resume`), by hand on the h100 profile (prefill base_s
0.004, per_token_s 4e-5, per_token_ctx_s 1.3e-9): C(lo, hi) = 4e-5·n + 1.3e-9·n·(lo·B + n/2)
for n = (hi − lo)·B tokens, a rebuild prefill_s(R, S − R) − base_s."""

from __future__ import annotations

import pytest

from ownerserve.kvstate import load_spec
from ownerserve.kvstate.resume import (
    HostHit,
    Resume,
    ResumeRule,
    moved_windows,
    rebuild_s,
    resume_point,
)
from ownerserve.profiles import load_profile

PREFILL = load_profile("h100-llama3-8b").prefill
DENSE = ResumeRule.of(load_spec("llama3-8b"))
QWEN = ResumeRule.of(load_spec("qwen3-8b-swa"))
V4 = ResumeRule.of(load_spec("deepseek-v4"))


def test_each_spec_s_rule_is_its_block_and_its_n_win_times_l() -> None:
    assert ResumeRule(16, 0) == DENSE and not DENSE.hybrid
    assert ResumeRule(16, 27 * 4096) == QWEN  # 27 window layers of 4096 tokens
    assert ResumeRule(128, 61 * 128) == V4  # 61 window layers of 128 tokens
    assert ResumeRule.of(load_spec("deepseek-v3")) == ResumeRule(64, 0)  # MLA: no windows
    assert ResumeRule.of(load_spec("deepseek-v4"), 256) == ResumeRule(256, 7808)
    assert V4.rebuild(50) == 6400 and V4.rebuild(100) == 7808


def test_a_dense_hit_resumes_at_its_sealed_blocks_capped_by_the_prompt() -> None:
    assert resume_point(DENSE, PREFILL, 10, 3) == Resume(10, 0, 0, "cached")
    assert resume_point(DENSE, PREFILL, 10, 0, limit=7) == Resume(7, 0, 0, "cached")
    assert resume_point(DENSE, PREFILL, 0, 0) == Resume(0, 0, 0, "cold")
    assert resume_point(DENSE, PREFILL, 4, 0, host=HostHit(6, 0.1)) == Resume(4, 6, 0, "cached")


def test_v4_rebuilds_or_cuts_back_whichever_reaches_the_sealed_boundary_sooner() -> None:
    # sealed 100 blocks = 12800 tokens; rebuilding recomputes 7808 over 4992 of context:
    # 4e-5·7808 + 1.3e-9·7808·(4992 + 3904) = 0.40262 s
    assert rebuild_s(PREFILL, 7808, 12800) == pytest.approx(0.4026179584)
    # windows at 40: computing [40, 100) = 7680 tokens over 5120: 0.39666 s < 0.40262 s
    assert resume_point(V4, PREFILL, 100, 40) == Resume(40, 0, 0, "truncated")
    # windows at 30: 8960 tokens over 3840: 0.45531 s > 0.40262 s
    assert resume_point(V4, PREFILL, 100, 30) == Resume(100, 0, 7808, "rebuilt")
    # windows at the sealed boundary (or past it): cached
    assert resume_point(V4, PREFILL, 100, 100) == Resume(100, 0, 0, "cached")
    assert resume_point(V4, PREFILL, 100, 120) == Resume(100, 0, 0, "cached")
    # under n_win·L both recompute the whole prefix: the tie goes to the rebuild
    assert resume_point(V4, PREFILL, 11, 0) == Resume(11, 0, 1408, "rebuilt")


def test_qwen_s_4096_token_windows_cut_a_short_hit_back_to_its_cached_windows() -> None:
    # sealed 277 blocks = 4432 tokens < n_win·L: the rebuild recomputes all 4432 from scratch
    # (0.19005 s), computing [1, 277) = 4416 tokens over 16 costs 0.18941 s
    assert resume_point(QWEN, PREFILL, 277, 1) == Resume(1, 0, 0, "truncated")
    assert resume_point(QWEN, PREFILL, 277, 0) == Resume(277, 0, 4432, "rebuilt")  # a tie
    assert resume_point(QWEN, PREFILL, 277, 277, limit=276) == Resume(276, 0, 0, "cached")


def test_an_engine_that_never_rebuilds_resumes_at_its_windows_or_its_sealed_boundary() -> None:
    # vLLM: the rebuild that was the cheaper (windows at 30 of 100) is no option, nor is the tie
    assert resume_point(V4, PREFILL, 100, 30, rebuild=False) == Resume(30, 0, 0, "truncated")
    assert resume_point(V4, PREFILL, 11, 0, rebuild=False) == Resume(0, 0, 0, "cold")
    assert resume_point(QWEN, PREFILL, 277, 0, rebuild=False) == Resume(0, 0, 0, "cold")
    assert resume_point(V4, PREFILL, 100, 100, rebuild=False) == Resume(100, 0, 0, "cached")
    # a CPU continuation whose windows are not held at its end is not loaded to rebuild them
    none = HostHit(20, 0.001, windows_at_end=False, checkpoint=10)
    assert resume_point(V4, PREFILL, 10, 10, host=none, rebuild=False) == Resume(10, 0, 0, "cached")
    held = HostHit(20, 0.001, windows_at_end=True, checkpoint=30)
    assert resume_point(V4, PREFILL, 10, 10, host=held, rebuild=False) == Resume(
        10, 20, 0, "cached"
    )


def test_a_cpu_continuation_loads_or_stops_at_the_deepest_held_windows() -> None:
    # HBM 10 blocks (windows there), CPU 20 more in 0.01 s: loading wins over computing
    # [10, 30) = 2560 tokens over 1280 (0.1109 s)
    held = HostHit(20, 0.01, windows_at_end=True, checkpoint=30)
    assert resume_point(V4, PREFILL, 10, 10, host=held) == Resume(10, 20, 0, "cached")
    # the windows at 30 not held: load + rebuild 3840 tokens (0.173 s) against loading to the
    # checkpoint at 20 (0.005 s) and computing [20, 30) = 1280 tokens over 2560 (0.0565 s)
    ckpt = HostHit(20, 0.01, windows_at_end=False, checkpoint=20)
    assert resume_point(V4, PREFILL, 10, 10, host=ckpt) == Resume(10, 10, 0, "truncated")
    # no checkpoint past the HBM hit: computing [10, 30) (0.1109 s) beats the load and the
    # rebuild of 3840 tokens (0.01 + 0.1632 s)
    none = HostHit(20, 0.01, windows_at_end=False, checkpoint=10)
    assert resume_point(V4, PREFILL, 10, 10, host=none) == Resume(10, 0, 0, "cached")
    # a CPU prefix shorter than n_win·L with no windows held: rebuilding recomputes all of it,
    # so loading it (however fast) only adds its load time: a cold start
    cold = HostHit(30, 0.001, windows_at_end=False, checkpoint=0)
    assert resume_point(V4, PREFILL, 0, 0, host=cold) == Resume(0, 0, 0, "cold")


def test_a_move_resumes_where_the_destination_holds_windows_unless_it_brings_them() -> None:
    # a fetch leaving 100 sealed blocks on a worker whose windows are at 40: cut back to 40
    assert moved_windows(40, 100, brings=False) == 40
    assert resume_point(V4, PREFILL, 100, moved_windows(40, 100, False)).blocks == 40
    brought = resume_point(V4, PREFILL, 100, moved_windows(40, 100, True))
    assert brought == Resume(100, 0, 0, "cached")
    assert moved_windows(120, 100, brings=False) == 100
