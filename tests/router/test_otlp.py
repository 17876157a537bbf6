"""The router's Prometheus registry as OTLP metrics (`router.otlp`): each family converted to its
OTLP type — a histogram with its bounds, per-bucket counts, sum, count and unit — and the
periodic export, which sends a last export at shutdown, to a real OTLP/HTTP receiver."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.sdk.metrics.export import AggregationTemporality, Gauge, Histogram, Sum
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, Counter
from prometheus_client import Gauge as PromGauge
from prometheus_client import Histogram as PromHistogram

from ownerserve.config import settings_from_dict
from ownerserve.errors import ConfigError
from router.otlp import PeriodicExport, metrics_data, to_otlp, unit_of
from router.telemetry import RouterMetrics, Telemetry
from tests.otlp_receiver import OtlpReceiver, attributes
from tests.waiting import until, until_sync

NOW_NS = 2_000_000_000_000_000_000
START_NS = 1_000_000_000_000_000_000


def _family(registry: CollectorRegistry, name: str):
    return next(f for f in registry.collect() if f.name == name)


def test_a_histogram_keeps_its_bounds_counts_per_bucket_sum_and_unit():
    registry = CollectorRegistry()
    h = PromHistogram(
        "x_wait_seconds", "doc", ["action"], buckets=(0.1, 1.0, 10.0), registry=registry
    )
    for v in (0.05, 0.5, 0.7, 5.0, 50.0):
        h.labels("colocated").observe(v)
    metric = to_otlp(_family(registry, "x_wait_seconds"), NOW_NS, START_NS)
    assert metric is not None
    assert (metric.name, metric.unit, metric.description) == ("x_wait_seconds", "s", "doc")
    assert isinstance(metric.data, Histogram)
    assert metric.data.aggregation_temporality is AggregationTemporality.CUMULATIVE
    (point,) = metric.data.data_points
    assert point.attributes == {"action": "colocated"}
    assert list(point.explicit_bounds) == [0.1, 1.0, 10.0]
    assert list(point.bucket_counts) == [1, 2, 1, 1]  # the last: above 10 (+Inf)
    assert (point.count, point.sum) == (5, pytest.approx(56.25))
    # the series' start is when its label set was created (its `_created` sample)
    assert START_NS < point.start_time_unix_nano <= point.time_unix_nano == NOW_NS
    assert point.min is None and point.max is None  # Prometheus keeps neither


def test_a_counter_is_a_monotonic_cumulative_sum_named_as_scraped():
    registry = CollectorRegistry()
    c = Counter("x_requests_total", "doc", ["status"], registry=registry)
    c.labels("ok").inc(3)
    c.labels("500").inc()
    metric = to_otlp(_family(registry, "x_requests"), NOW_NS, START_NS)
    assert metric is not None and metric.name == "x_requests_total" and metric.unit == ""
    assert isinstance(metric.data, Sum)
    assert metric.data.is_monotonic
    assert metric.data.aggregation_temporality is AggregationTemporality.CUMULATIVE
    values = {dict(p.attributes or {})["status"]: p.value for p in metric.data.data_points}
    assert values == {"ok": 3.0, "500": 1.0}
    assert all(p.start_time_unix_nano > START_NS for p in metric.data.data_points)


def test_a_gauge_is_a_gauge_and_a_labelled_metric_without_series_is_left_out():
    registry = CollectorRegistry()
    PromGauge("x_queued", "doc", registry=registry).set(4)
    PromGauge("x_paused", "doc", ["worker"], registry=registry)  # no label set yet
    metric = to_otlp(_family(registry, "x_queued"), NOW_NS, START_NS)
    assert metric is not None and isinstance(metric.data, Gauge)
    assert [(p.value, p.time_unix_nano) for p in metric.data.data_points] == [(4.0, NOW_NS)]
    assert to_otlp(_family(registry, "x_paused"), NOW_NS, START_NS) is None


def test_the_stage_summary_is_a_histogram_of_one_bucket():
    metrics = RouterMetrics()
    metrics.stages.add(0, 0.25)
    metrics.stages.add(0, 0.5)
    family = _family(metrics.registry, "ownerserve_stage_seconds")
    metric = to_otlp(family, NOW_NS, START_NS)
    assert metric is not None and metric.unit == "s" and isinstance(metric.data, Histogram)
    parse = next(p for p in metric.data.data_points if p.attributes == {"stage": "parse"})
    assert (list(parse.explicit_bounds), list(parse.bucket_counts)) == ([], [2])
    assert (parse.count, parse.sum) == (2, 0.75)
    assert parse.start_time_unix_nano == START_NS  # a summary family has no `_created`


def test_units_come_from_the_names_unit_suffix():
    assert unit_of("ownerserve_ttft_seconds") == "s"
    assert unit_of("ownerserve_kv_bytes_total") == "By"
    assert unit_of("ownerserve_requests_total") == ""


def test_every_router_histogram_is_an_otlp_histogram():
    metrics = RouterMetrics()
    metrics.of(metrics.ttft, "remote_prefill").observe(0.2)
    metrics.overhead.observe(0.001)
    data = metrics_data(metrics.read(), Resource.create({"service.name": "t"}), START_NS)
    (scope,) = data.resource_metrics[0].scope_metrics
    by_name = {m.name: m for m in scope.metrics}
    histograms = {f.name for f in metrics.registry.collect() if f.type == "histogram"}
    seen = {n for n in histograms if n in by_name}
    assert seen == {"ownerserve_ttft_seconds", "ownerserve_router_overhead_seconds"}
    assert all(isinstance(by_name[n].data, Histogram) for n in seen)
    # counters with label values known from the start are there at 0
    lookups = by_name["ownerserve_owner_lookups_total"].data
    assert isinstance(lookups, Sum)
    values = {dict(p.attributes or {})["result"]: p.value for p in lookups.data_points}
    assert values == {"hit": 0, "miss": 0, "none": 0}


def test_grpc_without_its_exporter_package_is_a_config_error():
    try:
        import opentelemetry.exporter.otlp.proto.grpc  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("opentelemetry-exporter-otlp-proto-grpc is installed")
    with pytest.raises(ConfigError, match="opentelemetry-exporter-otlp-proto-grpc"):
        settings_from_dict({"telemetry": {"otlp_protocol": "grpc"}})


def _periodic(receiver: OtlpReceiver, metrics: RouterMetrics, interval_s: float) -> PeriodicExport:
    resource = Resource.create({"service.name": "t"})
    exporter = OTLPMetricExporter(endpoint=receiver.url + "/v1/metrics")
    return PeriodicExport(
        lambda: metrics_data(metrics.read(), resource, START_NS), exporter, interval_s
    )


async def test_the_periodic_export_sends_on_its_schedule():
    receiver = await OtlpReceiver().start()
    export = _periodic(receiver, RouterMetrics(), interval_s=0.05)
    try:
        await until(lambda: len(receiver.metric_exports) >= 3, what="three scheduled exports")
        resource = receiver.metric_exports[-1].resource_metrics[0].resource
        assert attributes(resource)["service.name"] == "t"
        assert not receiver.refused
    finally:
        await asyncio.to_thread(export.shutdown)
        await receiver.stop()


async def test_the_periodic_export_sends_once_more_at_shutdown():
    receiver = await OtlpReceiver().start()
    metrics = RouterMetrics()
    export = _periodic(receiver, metrics, interval_s=3600.0)  # none on the schedule here
    try:
        metrics.sessions_paused.inc(7)
        await asyncio.to_thread(export.shutdown)
        assert len(receiver.metric_exports) == 1
        paused = receiver.latest_metrics()["ownerserve_admission_sessions_paused_total"]
        assert [p.as_double for p in paused.sum.data_points] == [7.0]
    finally:
        await receiver.stop()


def test_over_grpc_metrics_and_spans_reach_a_grpc_receiver():
    """Runs where ownerserve[otlp-grpc] is installed (grpcio with it: the receiver's server)."""
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.metrics.v1 import (
        metrics_service_pb2,
        metrics_service_pb2_grpc,
    )
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    metric_exports: list = []
    trace_exports: list = []

    class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
        def Export(self, request, context):
            metric_exports.append(request)
            return metrics_service_pb2.ExportMetricsServiceResponse()

    class Traces(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            trace_exports.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), server)
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        settings = settings_from_dict(
            {
                "telemetry": {
                    "otlp_endpoint": f"http://127.0.0.1:{port}",
                    "otlp_protocol": "grpc",
                    "otlp_metrics_interval_s": 0.05,
                }
            }
        )
        telemetry = Telemetry(settings.telemetry)
        m = telemetry.metrics
        m.of(m.ttft, "colocated_prefill").observe(0.3)
        with telemetry.start_span("ownerserve.request", model="m"):
            pass
        until_sync(lambda: metric_exports, what="a metrics export over gRPC")
        telemetry.shutdown()  # flushes the span
        (scope,) = metric_exports[-1].resource_metrics[0].scope_metrics
        ttft = next(x for x in scope.metrics if x.name == "ownerserve_ttft_seconds")
        assert (ttft.unit, ttft.histogram.data_points[0].count) == ("s", 1)
        names = [s.name for r in trace_exports for rs in r.resource_spans for ss in rs.scope_spans
                 for s in ss.spans]  # fmt: skip
        assert names == ["ownerserve.request"]
    finally:
        server.stop(None)
