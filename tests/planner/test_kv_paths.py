"""Which KV data path a move takes and what it costs (`RequestCosts.link`, `CostModel.
restore_plan`): a same-node peer through host memory, or the worker's store transport; and a
probe's measured price in place of the configured one (`CostModel(measurements=...)`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from ownerserve.errors import ConfigError
from ownerserve.kvprobe import PriceSource, load_measurements
from ownerserve.kvstate import load_spec
from ownerserve.profiles import TransportTiming
from ownerserve.types import KVTransport, Role, Tier
from planner.cost import CostModel, RequestCosts
from tests.planner.util import UNIT, UNIT_CONFIG, request, worker

# UNIT's link: intra 1e11, inter 1e10, latency 1e-3; store_tcp priced here at 1e9, 5e-3
TCP = TransportTiming(bps=1e9, latency_s=5e-3)
PRICED = replace(UNIT, link=replace(UNIT.link, store_tcp=TCP))


def _costs() -> RequestCosts:
    return RequestCosts(CostModel(UNIT_CONFIG, {"unit": PRICED}), request(1000))


def test_a_same_node_peer_through_host_memory_pays_the_same_host_price() -> None:
    k = _costs()
    d = worker("d", Role.DECODE, "n0")
    # 1e-3 + 1e6 B / 1e11
    assert k.link(d, 1e6, True) == pytest.approx(1e-3 + 1e-5)


def test_across_nodes_the_destinations_store_transport_is_priced() -> None:
    k = _costs()
    rdma = worker("d", Role.DECODE, "n1")
    tcp = replace(rdma, kv_transport=KVTransport.STORE_TCP)
    assert k.link(rdma, 1e6, False) == pytest.approx(1e-3 + 1e6 / 1e10)  # the link default
    assert k.link(tcp, 1e6, False) == pytest.approx(5e-3 + 1e6 / 1e9)  # its kv_transports price
    # scaled by the destination's calibration
    assert k.link(replace(tcp, link_scale=2.0), 1e6, False) == pytest.approx(2 * (5e-3 + 1e-3))


def test_a_worker_without_host_memory_path_takes_the_store_within_its_node_too() -> None:
    k = _costs()
    src = worker("s", Role.DECODE, "n0")
    dst = worker("d", Role.DECODE, "n0", kv_same_host=False, kv_transport=KVTransport.STORE_TCP)
    assert k.transfer_s(src, dst, 1e6) == pytest.approx(5e-3 + 1e-3)
    # within a node no NIC backlog is waited for, whatever the path
    busy = replace(src, nic_backlog_s=3.0)
    assert k.transfer_s(busy, dst, 1e6) == pytest.approx(5e-3 + 1e-3)


def test_a_peer_restore_loads_over_the_path_it_takes() -> None:
    # a TCP path fast enough that the plan loads (131072 B/token / 5e10 ≪ per_token_s)
    fast = TransportTiming(bps=5e10, latency_s=5e-3)
    model = CostModel(UNIT_CONFIG, {"unit": replace(UNIT, link=replace(UNIT.link, store_tcp=fast))})
    spec = load_spec("llama3-8b")
    w = worker("d", Role.DECODE, "n1", kv_transport=KVTransport.STORE_TCP)
    _, load_tcp, nbytes = model.restore_plan(w, spec, 4096, Tier.GPU, 0, KVTransport.STORE_TCP)
    _, load_host, _ = model.restore_plan(w, spec, 4096, Tier.GPU, 0, KVTransport.SAME_HOST)
    assert nbytes > 0
    assert load_tcp == pytest.approx(5e-3 + nbytes / 5e10)
    assert load_host == pytest.approx(1e-3 + nbytes / 1e11)


def test_a_same_host_path_slower_than_a_store_path_is_a_config_error() -> None:
    slow_host = replace(UNIT, link=replace(UNIT.link, same_host=TransportTiming(1e9, 1e-3)))
    with pytest.raises(ConfigError, match="same_host KV transport is slower than store_tcp"):
        CostModel(UNIT_CONFIG, {"unit": slow_host})
    laggy_host = replace(UNIT, link=replace(UNIT.link, same_host=TransportTiming(1e11, 1.0)))
    with pytest.raises(ConfigError, match="same_host KV transport is slower"):
        CostModel(UNIT_CONFIG, {"unit": laggy_host})


def test_a_measured_price_replaces_the_configured_one_in_every_profile(tmp_path: Path) -> None:
    f = tmp_path / "m.yaml"
    f.write_text("store_tcp: {bps: 2.0e+8, latency_s: 0.004}\n")
    other = replace(UNIT, name="other")
    model = CostModel(
        UNIT_CONFIG, {"unit": UNIT, "other": other}, measurements=lambda: load_measurements(f)
    )
    for name in ("unit", "other"):
        assert model.profiles[name].link.path(KVTransport.STORE_TCP) == TransportTiming(2e8, 4e-3)
        assert model.profiles[name].link.path(KVTransport.STORE_RDMA) == TransportTiming(1e10, 1e-3)
    sources = {p.transport: p.source for p in model.kv_prices}
    assert sources == {
        KVTransport.SAME_HOST: PriceSource.CONFIGURED,
        KVTransport.STORE_TCP: PriceSource.MEASURED,
        KVTransport.STORE_RDMA: PriceSource.CONFIGURED,
    }
    k = RequestCosts(model, request(1000))
    tcp = worker("d", Role.DECODE, "n1", kv_transport=KVTransport.STORE_TCP)
    assert k.link(tcp, 1e6, False) == pytest.approx(4e-3 + 1e6 / 2e8)


def test_a_missing_measurements_file_plans_at_the_configured_prices(tmp_path: Path) -> None:
    model = CostModel(
        UNIT_CONFIG, {"unit": UNIT}, measurements=lambda: load_measurements(tmp_path / "no.yaml")
    )
    assert model.profiles["unit"] is UNIT
    assert {p.source for p in model.kv_prices} == {PriceSource.CONFIGURED}
    assert all("cannot read KV measurements" in p.detail for p in model.kv_prices)
