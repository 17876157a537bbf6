"""An OTLP/HTTP receiver for tests: `POST /v1/metrics` and `POST /v1/traces` on loopback, as a
collector takes them (protobuf bodies, `application/x-protobuf`), each decoded with
opentelemetry-proto and kept in arrival order."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.router.fake_worker import free_port

PROTOBUF = "application/x-protobuf"


class OtlpReceiver:
    """`await OtlpReceiver().start()`; `url` is the exporters' endpoint (their base URL)."""

    def __init__(self) -> None:
        self.metric_exports: list[ExportMetricsServiceRequest] = []
        self.trace_exports: list[ExportTraceServiceRequest] = []
        self.refused: list[str] = []
        """Requests refused (wrong content type), as `path: content type`."""
        self.port = free_port()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> OtlpReceiver:
        app = web.Application()
        app.router.add_post("/v1/metrics", self._metrics)
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _decode(self, request: web.Request, message: Any) -> bool:
        if request.content_type != PROTOBUF:
            self.refused.append(f"{request.path}: {request.content_type}")
            return False
        message.ParseFromString(await request.read())  # aiohttp undoes a gzip encoding
        return True

    async def _metrics(self, request: web.Request) -> web.Response:
        export = ExportMetricsServiceRequest()
        if not await self._decode(request, export):
            return web.Response(status=415)
        self.metric_exports.append(export)
        body = ExportMetricsServiceResponse().SerializeToString()
        return web.Response(body=body, content_type=PROTOBUF)

    async def _traces(self, request: web.Request) -> web.Response:
        export = ExportTraceServiceRequest()
        if not await self._decode(request, export):
            return web.Response(status=415)
        self.trace_exports.append(export)
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(), content_type=PROTOBUF
        )

    def spans(self) -> list[Span]:
        """Every span received so far."""
        return [
            span
            for export in self.trace_exports
            for rs in export.resource_spans
            for ss in rs.scope_spans
            for span in ss.spans
        ]

    def latest_metrics(self) -> dict[str, Metric]:
        """The metrics of the last export received, by name (each export carries them all:
        cumulative)."""
        if not self.metric_exports:
            return {}
        return {
            m.name: m
            for rm in self.metric_exports[-1].resource_metrics
            for sm in rm.scope_metrics
            for m in sm.metrics
        }


def attributes(point_or_span: Any) -> dict[str, Any]:
    """A data point's or span's attributes as plain values."""
    out: dict[str, Any] = {}
    for kv in point_or_span.attributes:
        kind = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, kind) if kind else None
    return out
