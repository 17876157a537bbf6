"""Timing profiles: the formulas of `ownerserve.profiles` on hand-computed numbers."""

from typing import Any

import pytest
import yaml

from ownerserve.errors import ConfigError
from ownerserve.profiles import (
    PROFILES_DIR,
    TransportTiming,
    kv_transport_into,
    load_profile,
    profile_from_dict,
)
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


def _with(extra: dict[str, Any]) -> dict[str, Any]:
    base = yaml.safe_load((PROFILES_DIR / "h100-llama3-8b.yaml").read_text())
    base.update(extra)
    return base


def test_a_profile_without_kv_transports_prices_them_by_its_link_fields() -> None:
    link = load_profile("h100-llama3-8b").link
    assert link.path(KVTransport.SAME_HOST) == TransportTiming(4e11, 2e-4)
    assert link.path(KVTransport.STORE_RDMA) == TransportTiming(2.5e10, 2e-4)
    assert link.path(KVTransport.STORE_TCP) == TransportTiming(2.5e10, 2e-4)


def test_kv_transports_price_each_named_path_and_leave_the_others_at_the_defaults() -> None:
    p = profile_from_dict(_with({"kv_transports": {"store_tcp": {"bps": 1e9, "latency_s": 5e-4}}}))
    assert p.link.path(KVTransport.STORE_TCP) == TransportTiming(1e9, 5e-4)
    assert p.link.path(KVTransport.STORE_RDMA) == TransportTiming(2.5e10, 2e-4)
    # 1 MiB over TCP: 0.5 ms + 2^20 / 1e9
    assert p.link.transfer_s(2**20, KVTransport.STORE_TCP) == pytest.approx(5e-4 + 2**20 / 1e9)
    assert p.link.transfer_s(0, KVTransport.STORE_TCP) == 0.0


@pytest.mark.parametrize(
    ("section", "error"),
    [
        ([1], "kv_transports: not a mapping"),
        ({"nvlink": {"bps": 1, "latency_s": 0}}, "unknown transport 'nvlink'"),
        ({"store_tcp": {"bps": 1}}, "needs exactly bps and latency_s"),
        ({"store_tcp": {"bps": "x", "latency_s": 0}}, "must be numbers"),
        ({"store_tcp": {"bps": -1, "latency_s": 0}}, "bps must be > 0"),
    ],
)
def test_a_bad_kv_transports_section_is_a_config_error(section: object, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        profile_from_dict(_with({"kv_transports": section}), "p.yaml")


def test_the_path_into_a_worker_is_same_host_only_on_its_node_and_when_it_takes_host_memory() -> (
    None
):
    rdma, tcp, host = KVTransport.STORE_RDMA, KVTransport.STORE_TCP, KVTransport.SAME_HOST
    assert kv_transport_into(True, True, rdma) is host
    assert kv_transport_into(True, False, tcp) is tcp
    assert kv_transport_into(False, True, tcp) is tcp
    assert kv_transport_into(False, True, rdma) is rdma
