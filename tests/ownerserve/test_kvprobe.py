"""The KV transports' measured prices (`ownerserve.kvprobe`): the fit of a probe's samples on
exact numbers, the fall-back to the configured price when a probe or its file fails, and the
measurements file's errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from ownerserve.errors import ConfigError
from ownerserve.kvprobe import (
    PriceSource,
    ProbeError,
    ProbeSample,
    TransportPrice,
    fit_transport,
    load_measurements,
    measure_price,
    resolve_prices,
    with_prices,
    write_measurements,
)
from ownerserve.profiles import TransportTiming, load_profile
from ownerserve.types import KVTransport

MiB = 1 << 20


def test_samples_on_a_line_fit_its_latency_and_bandwidth() -> None:
    # 1 ms + bytes / 1 GB/s, at 1, 4 and 16 MiB
    samples = [ProbeSample(n, 1e-3 + n / 1e9) for n in (MiB, 4 * MiB, 16 * MiB)]
    t = fit_transport(samples)
    assert t.bps == pytest.approx(1e9, rel=1e-9)
    assert t.latency_s == pytest.approx(1e-3, rel=1e-6)


def test_a_negative_intercept_is_clamped_and_the_rate_refitted_through_the_origin() -> None:
    # seconds = n / 1e9 − 1 ms would be a negative latency: 0, and bps = Σn² / Σn·s
    samples = [ProbeSample(n, n / 1e9 - 1e-3) for n in (4 * MiB, 16 * MiB)]
    t = fit_transport(samples)
    assert t.latency_s == 0.0
    ns = [4 * MiB, 16 * MiB]
    want = sum(n * n for n in ns) / sum(n * (n / 1e9 - 1e-3) for n in ns)
    assert t.bps == pytest.approx(want, rel=1e-12)


def test_unfittable_samples_raise_probe_error() -> None:
    with pytest.raises(ProbeError, match="two sizes"):
        fit_transport([ProbeSample(MiB, 1e-3), ProbeSample(MiB, 2e-3)])
    with pytest.raises(ProbeError, match="does not grow"):
        fit_transport([ProbeSample(MiB, 2e-3), ProbeSample(4 * MiB, 1e-3)])
    with pytest.raises(ProbeError, match="seconds > 0"):
        fit_transport([ProbeSample(MiB, 0.0), ProbeSample(4 * MiB, 1e-3)])


def test_a_failed_probe_falls_back_to_the_configured_price_and_says_why() -> None:
    configured = TransportTiming(bps=2.5e10, latency_s=2e-4)
    # a probe whose samples cannot be fitted (every read the same size)
    price = measure_price(KVTransport.STORE_TCP, configured, lambda: [ProbeSample(MiB, 1e-3)] * 3)
    assert price.source is PriceSource.CONFIGURED
    assert price.timing == configured
    assert "probe failed: ProbeError" in price.detail
    none = measure_price(KVTransport.STORE_TCP, configured, None)
    assert (none.source, none.timing, none.detail) == (
        PriceSource.CONFIGURED,
        configured,
        "not probed",
    )
    ok = measure_price(
        KVTransport.STORE_TCP,
        configured,
        lambda: [ProbeSample(n, n / 5e8) for n in (MiB, 2 * MiB)],
    )
    assert ok.source is PriceSource.MEASURED
    assert ok.timing.bps == pytest.approx(5e8)
    assert ok.detail == "2 samples"


def test_measurements_round_trip_and_replace_only_their_transport(tmp_path: Path) -> None:
    f = tmp_path / "m.yaml"
    measured = TransportPrice(
        KVTransport.STORE_TCP, TransportTiming(6e8, 4e-3), PriceSource.MEASURED
    )
    skipped = TransportPrice(
        KVTransport.STORE_RDMA, TransportTiming(1.0, 1.0), PriceSource.CONFIGURED
    )
    write_measurements(f, [measured, skipped])
    assert load_measurements(f) == {KVTransport.STORE_TCP: TransportTiming(6e8, 4e-3)}

    prof = load_profile("h100-llama3-8b")
    prices = resolve_prices(prof, lambda: load_measurements(f))
    by = {p.transport: p for p in prices}
    assert by[KVTransport.STORE_TCP].source is PriceSource.MEASURED
    assert by[KVTransport.STORE_RDMA].source is PriceSource.CONFIGURED
    assert by[KVTransport.STORE_RDMA].timing == TransportTiming(2.5e10, 2e-4)
    priced = with_prices(prof, prices)
    assert priced.link.path(KVTransport.STORE_TCP) == TransportTiming(6e8, 4e-3)
    assert priced.link.path(KVTransport.STORE_RDMA) == prof.link.path(KVTransport.STORE_RDMA)
    assert priced.link.path(KVTransport.SAME_HOST) == TransportTiming(4e11, 2e-4)


def test_an_unusable_measurements_file_leaves_every_price_configured(tmp_path: Path) -> None:
    prof = load_profile("h100-llama3-8b")
    missing = tmp_path / "none.yaml"
    prices = resolve_prices(prof, lambda: load_measurements(missing))
    assert all(p.source is PriceSource.CONFIGURED for p in prices)
    assert all("cannot read KV measurements" in p.detail for p in prices)
    assert [p.timing for p in prices] == [prof.link.path(t) for t in KVTransport]
    unset = resolve_prices(prof, None)
    assert {p.detail for p in unset} == {"no measurement configured"}


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("[1, 2]", "must be a mapping"),
        ("store_udp: {bps: 1, latency_s: 0}", "unknown transport 'store_udp'"),
        ("store_tcp: 5", "needs bps and latency_s"),
        ("store_tcp: {bps: fast, latency_s: 0}", "must be numbers"),
        ("store_tcp: {bps: 0, latency_s: 0}", "bps must be > 0"),
        ("store_tcp: {bps: 1, latency_s: -1}", "latency_s >= 0"),
        ("store_tcp: {bps: [", "invalid YAML in KV measurements"),
    ],
)
def test_a_malformed_measurements_file_is_a_config_error(
    tmp_path: Path, text: str, error: str
) -> None:
    f = tmp_path / "m.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=error):
        load_measurements(f)
