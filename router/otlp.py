"""The router's metrics over OTLP: each family of its Prometheus registry (`RouterMetrics`, the
one place they are defined) converted to its OTLP type and exported on a schedule, and the
OTLP exporters `telemetry.otlp_protocol` picks.

A counter becomes a monotonic cumulative Sum (started when its label set was first seen), a
gauge a Gauge read at each export, a histogram a cumulative Histogram with its explicit bucket
bounds, bucket counts, sum and count, a summary without quantiles (`ownerserve_stage_seconds`)
a Histogram without bounds (its sum and count). Units come from the names' Prometheus unit
suffix (`_seconds`: `s`). The mapping is the OpenTelemetry specification's Prometheus
compatibility notes read from the Prometheus side, as opentelemetry-go-contrib's Prometheus
bridge (`bridges/prometheus`) does it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client.metrics_core import Metric as Family

from ownerserve.config import TelemetrySettings

log = logging.getLogger(__name__)

SCOPE = InstrumentationScope("ownerserve.router")
_CUMULATIVE = AggregationTemporality.CUMULATIVE
_UNITS = (("_seconds", "s"), ("_bytes", "By"), ("_ratio", "1"))
_UNSET = cast(float, None)
"""Prometheus keeps no minimum or maximum of a histogram: left out (None encodes as absent)."""

Attributes = tuple[tuple[str, str], ...]


def unit_of(name: str) -> str:
    """The UCUM unit a Prometheus name's unit suffix says (`_seconds`: `s`, `_bytes`: `By`),
    or "" where it says none (counts)."""
    base = name.removesuffix("_total")
    return next((unit for suffix, unit in _UNITS if base.endswith(suffix)), "")


def _attributes(labels: Mapping[str, str], leave_out: str = "") -> Attributes:
    return tuple(sorted((k, v) for k, v in labels.items() if k != leave_out))


@dataclass(slots=True)
class _Series:
    """One label set of a histogram or summary, as its samples come."""

    buckets: list[tuple[float, float]] = field(default_factory=list)
    """(upper bound, cumulative count), the last bound +Inf."""
    count: float = 0.0
    sum: float = 0.0


def _histogram_points(
    family: Family, now_ns: int, started: Callable[[Attributes], int]
) -> list[HistogramDataPoint]:
    """A histogram's (or summary's) label sets as OTLP points: Prometheus's cumulative bucket
    counts turned into counts per bucket, the +Inf bucket the last."""
    series: dict[Attributes, _Series] = {}
    for s in family.samples:
        suffix = s.name[len(family.name) :]
        if suffix not in ("_bucket", "_count", "_sum"):
            continue  # _created (the start time), a summary's quantiles (the router has none)
        one = series.setdefault(_attributes(s.labels, "le"), _Series())
        if suffix == "_bucket":
            one.buckets.append((float(s.labels["le"]), s.value))
        elif suffix == "_count":
            one.count = s.value
        else:
            one.sum = s.value
    points = []
    for attrs, one in series.items():
        one.buckets.sort()
        bounds = [le for le, _ in one.buckets if not math.isinf(le)]
        cumulative = [c for _, c in one.buckets] or [one.count]
        counts = [int(c - b) for c, b in zip(cumulative, [0.0, *cumulative[:-1]], strict=True)]
        points.append(
            HistogramDataPoint(
                attributes=dict(attrs),
                start_time_unix_nano=started(attrs),
                time_unix_nano=now_ns,
                count=int(one.count),
                sum=one.sum,
                bucket_counts=counts,
                explicit_bounds=bounds,
                min=_UNSET,
                max=_UNSET,
            )
        )
    return points


def to_otlp(family: Family, now_ns: int, start_ns: int) -> Metric | None:
    """One Prometheus family as its OTLP metric at `now_ns`, or None when it has no sample yet
    (a labelled metric before its first label set) or is of a type the router never exports.
    `start_ns`: the start of a series whose `_created` sample is missing."""
    created = {
        _attributes(s.labels): int(s.value * 1e9)
        for s in family.samples
        if s.name == family.name + "_created"
    }

    def started(attrs: Attributes) -> int:
        return created.get(attrs, start_ns)

    name = family.name
    data: Any
    if family.type == "counter":
        name += "_total"
        points = [
            NumberDataPoint(
                attributes=dict(s.labels),
                start_time_unix_nano=started(_attributes(s.labels)),
                time_unix_nano=now_ns,
                value=s.value,
            )
            for s in family.samples
            if s.name == name
        ]
        data = Sum(points, _CUMULATIVE, is_monotonic=True)
    elif family.type == "gauge":
        points = [
            NumberDataPoint(
                attributes=dict(s.labels),
                start_time_unix_nano=0,
                time_unix_nano=now_ns,
                value=s.value,
            )
            for s in family.samples
        ]
        data = Gauge(points)
    elif family.type in ("histogram", "summary"):
        hist = _histogram_points(family, now_ns, started)
        if not hist:
            return None
        return Metric(name, family.documentation, unit_of(name), Histogram(hist, _CUMULATIVE))
    else:
        return None
    if not points:
        return None
    return Metric(name, family.documentation, unit_of(name), data)


def metrics_data(families: Iterable[Family], resource: Resource, start_ns: int) -> MetricsData:
    """Every family that has samples, as one OTLP export of the router's scope, read now."""
    now = time.time_ns()
    metrics = [m for f in families if (m := to_otlp(f, now, start_ns)) is not None]
    return MetricsData([ResourceMetrics(resource, [ScopeMetrics(SCOPE, metrics, "")], "")])


class PeriodicExport:
    """Read the metrics (`read`) and export them every `interval_s` from a thread of its own
    (an exporter blocks on the network), and once more at `shutdown`, so that a router that
    stops before its next interval still sends its last counts. Exports never overlap."""

    def __init__(
        self, read: Callable[[], MetricsData], exporter: MetricExporter, interval_s: float
    ) -> None:
        self._read = read
        self._exporter = exporter
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="otlp-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            self.export()

    def export(self) -> bool:
        """Read and export now; False (logged) when the export failed."""
        with self._lock:
            try:
                result = self._exporter.export(self._read())
            except Exception:
                log.warning("OTLP metrics export failed", exc_info=True)
                return False
        if result is not MetricExportResult.SUCCESS:
            log.warning("OTLP metrics export failed: %s", result.name)
            return False
        return True

    def shutdown(self) -> None:
        """Stop the schedule, export a last time, close the exporter."""
        self._stopped.set()
        self._thread.join()
        self.export()
        self._exporter.shutdown()


def exporters(settings: TelemetrySettings) -> tuple[SpanExporter, MetricExporter]:
    """The span and metric exporters to `telemetry.otlp_endpoint` over
    `telemetry.otlp_protocol`: OTLP/HTTP with protobuf bodies at `/v1/traces` and
    `/v1/metrics`, or OTLP/gRPC (plain for an `http://` endpoint, TLS for `https://`)."""
    endpoint = settings.otlp_endpoint
    assert endpoint is not None
    if settings.otlp_protocol == "grpc":
        # the package is optional (ownerserve[otlp-grpc]); the settings checked it is there
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter as GrpcMetricExporter,
        )
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcSpanExporter,
        )

        insecure = endpoint.startswith("http://")
        return (
            GrpcSpanExporter(endpoint=endpoint, insecure=insecure),
            GrpcMetricExporter(endpoint=endpoint, insecure=insecure),
        )
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return (
        OTLPSpanExporter(endpoint=endpoint + "/v1/traces"),
        OTLPMetricExporter(endpoint=endpoint + "/v1/metrics"),
    )
