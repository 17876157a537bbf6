"""Timing profiles: the formulas of `ownerserve.profiles` on hand-computed numbers."""

import pytest

from ownerserve.profiles import load_profile
from ownerserve.types import KVTransport


def test_h100_profile_formulas_match_hand_computation() -> None:
    p = load_profile("h100-llama3-8b")
    # 1000 new tokens on 3000 cached: 0.004 + 4e-5*1000 + 1.3e-9*1000*(3000+500)
    assert p.prefill_s(1000, 3000) == pytest.approx(0.004 + 0.04 + 0.00455)
    assert p.prefill_s(0, 3000) == 0.0
    # 8 sequences, 10k context tokens in all: 0.0065 + 8e-5 + 4.4e-4
    assert p.decode_step_s(8, 10_000) == pytest.approx(0.00702)
    # 1 GiB inter-node: 2e-4 + 2^30 / 2.5e10
    assert p.link.transfer_s(2**30, transport=KVTransport.STORE_RDMA) == pytest.approx(
        2e-4 + 2**30 / 2.5e10
    )


def test_every_shipped_profile_loads() -> None:
    for name in ("h100-llama3-8b", "fast-test"):
        assert load_profile(name).kv_bytes_per_token > 0
