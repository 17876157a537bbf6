"""Measured prices of the KV transports: a probe's timed moves fitted to `latency_s + bytes / bps`,
and the price each transport is planned with (measured, or the profile's configured one when no
measurement came or it failed).

A probe (`workers.mooncake_store.probe`, run by a `--store` sidecar's `--probe-store-out` or on
its own: timed store reads of a few sizes at start-up)
writes its fit to a measurements file; the router reads it once (`planner.kv_measurements`) and
plans every move over that transport with the measured price (`with_prices`). Pure except
`load_measurements` and `write_measurements`, which read and write that file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path

import yaml

from ownerserve.errors import ConfigError
from ownerserve.profiles import TimingProfile, TransportTiming
from ownerserve.types import KVTransport
from ownerserve.yamlfile import load_yaml


class ProbeError(Exception):
    """A probe's samples cannot be fitted (too few sizes, no positive bandwidth)."""


class PriceSource(StrEnum):
    """Where a transport's price comes from."""

    MEASURED = "measured"
    CONFIGURED = "configured"


@dataclass(frozen=True, slots=True)
class ProbeSample:
    """One timed move: `nbytes` took `seconds`."""

    nbytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class TransportPrice:
    """The price a transport is planned with, where it came from, and why (a failed probe's
    reason, or the samples' count)."""

    transport: KVTransport
    timing: TransportTiming
    source: PriceSource
    detail: str = ""


def fit_transport(samples: Sequence[ProbeSample]) -> TransportTiming:
    """Least squares of seconds = latency_s + nbytes / bps over the samples (at least two
    distinct sizes); a negative intercept is clamped to 0 (bps refitted through the origin).
    `ProbeError` when the slope is not positive (time does not grow with size)."""
    sizes = {s.nbytes for s in samples}
    if len(sizes) < 2:
        raise ProbeError(f"needs samples of two sizes at least, got {sorted(sizes)}")
    if any(s.nbytes <= 0 or not s.seconds > 0 for s in samples):
        raise ProbeError("every sample needs nbytes > 0 and seconds > 0")
    n = len(samples)
    mx = sum(s.nbytes for s in samples) / n
    my = sum(s.seconds for s in samples) / n
    sxx = sum((s.nbytes - mx) ** 2 for s in samples)
    sxy = sum((s.nbytes - mx) * (s.seconds - my) for s in samples)
    slope = sxy / sxx
    if not slope > 0:
        raise ProbeError(f"time does not grow with size (slope {slope:.3g} s/B)")
    latency = my - slope * mx
    if latency < 0:
        latency = 0.0
        slope = sum(s.nbytes * s.seconds for s in samples) / sum(s.nbytes**2 for s in samples)
    return TransportTiming(bps=1.0 / slope, latency_s=latency)


def measure_price(
    transport: KVTransport,
    configured: TransportTiming,
    measure: Callable[[], Sequence[ProbeSample]] | None,
) -> TransportPrice:
    """The transport's price: the fit of `measure()`'s samples, or `configured` when there is no
    probe or it fails (any exception: the store down, a timeout, an unfittable fit), with the
    reason in `detail`."""
    if measure is None:
        return TransportPrice(transport, configured, PriceSource.CONFIGURED, "not probed")
    try:
        samples = measure()
        timing = fit_transport(samples)
    except Exception as exc:  # a probe must never stop the router: fall back, say why
        reason = f"probe failed: {type(exc).__name__}: {exc}"
        return TransportPrice(transport, configured, PriceSource.CONFIGURED, reason)
    return TransportPrice(transport, timing, PriceSource.MEASURED, f"{len(samples)} samples")


def with_prices(profile: TimingProfile, prices: Iterable[TransportPrice]) -> TimingProfile:
    """`profile` with each measured price in place of its transport's configured one (the
    configured ones as they are); `profile` itself when none is measured."""
    link = profile.link
    for p in prices:
        if p.source is PriceSource.MEASURED:
            link = link.with_path(p.transport, p.timing)
    return profile if link is profile.link else replace(profile, link=link)


def write_measurements(path: Path, prices: Iterable[TransportPrice]) -> None:
    """Write the measured prices (`{transport: {bps, latency_s}}`) for `load_measurements`."""
    data = {
        p.transport.value: {"bps": p.timing.bps, "latency_s": p.timing.latency_s}
        for p in prices
        if p.source is PriceSource.MEASURED
    }
    path.write_text(yaml.safe_dump(data, sort_keys=True))


def load_measurements(path: Path) -> dict[KVTransport, TransportTiming]:
    """A measurements file as `write_measurements` writes it; `ConfigError` when it cannot be
    read or is malformed (names the file and the entry)."""
    data = load_yaml(path, "KV measurements")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: KV measurements must be a mapping of transports")
    out: dict[KVTransport, TransportTiming] = {}
    for name, entry in data.items():
        try:
            transport = KVTransport(name)
        except ValueError:
            known = sorted(t.value for t in KVTransport)
            raise ConfigError(f"{path}: unknown transport {name!r} (one of {known})") from None
        if not isinstance(entry, dict):
            raise ConfigError(f"{path}: {name}: needs bps and latency_s")
        bps, lat = entry.get("bps"), entry.get("latency_s")
        if not isinstance(bps, int | float) or not isinstance(lat, int | float):
            raise ConfigError(f"{path}: {name}: bps and latency_s must be numbers")
        if not bps > 0 or not lat >= 0:
            raise ConfigError(f"{path}: {name}: bps must be > 0, latency_s >= 0")
        out[transport] = TransportTiming(float(bps), float(lat))
    return out


def resolve_prices(
    profile: TimingProfile, measurements: Callable[[], Mapping[KVTransport, TransportTiming]] | None
) -> tuple[TransportPrice, ...]:
    """Each transport's price for `profile`: measured where `measurements()` names it, else
    configured; when `measurements()` fails (a missing or malformed file) every one is
    configured, with the reason."""
    if measurements is None:
        got: Mapping[KVTransport, TransportTiming] = {}
        why = "no measurement configured"
    else:
        try:
            got = measurements()
            why = "not measured"
        except ConfigError as exc:
            got, why = {}, f"measurements unusable: {exc}"
    out = []
    for t in KVTransport:
        m = got.get(t)
        if m is not None:
            out.append(TransportPrice(t, m, PriceSource.MEASURED, "probe"))
        else:
            out.append(TransportPrice(t, profile.link.path(t), PriceSource.CONFIGURED, why))
    return tuple(out)
