"""The vLLM backend: health, load from `/metrics`, the P/D protocol over a KV connector
(NixlConnector), and vLLM's KV events.

P/D protocol (vLLM's disaggregated prefill, as vllm-router speaks it): the prefill worker gets
the request with `max_tokens=1`, `stream=false` and `kv_transfer_params={"do_remote_decode":
true, ...}`; its response carries `kv_transfer_params` naming the KV blocks it holds for pickup.
The decode worker gets the original request plus those params unchanged and pulls the KV before
decoding. KV events: codec in `ownerserve.vllm_events`, subscriber in `router.backends.kv_events`.

`VLLMBackend` is what the router's pool and plan executor call (bodies in, answers parsed);
`VllmClient` is a small async HTTP client over the same pieces for tests and tools.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ownerserve.chunks import PARAMS_KEY as CHUNK_PARAMS_KEY
from ownerserve.config import WorkerSettings
from ownerserve.errors import UpstreamError
from ownerserve.types import BackendKind
from router.backends.base import PDHandoff, WorkerAddress, WorkerLoad, parse_load_metrics
from router.backends.kv_events import KVEventSink, KVEventSubscriber, subscriber_for

# Prefill-side request for a remote decode; the engine fills in the rest.
REMOTE_DECODE_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass(frozen=True, slots=True)
class VllmLoad:
    """One `/metrics` scrape, summed over engines: queue depth, KV usage, prefix-cache counters.

    `prompt_tokens_by_source` maps vLLM's source label (`local_compute`, `local_cache_hit`,
    `external_kv_transfer`) to its cumulative prompt token count.
    """

    num_requests_running: float = 0.0
    num_requests_waiting: float = 0.0
    kv_cache_usage_perc: float = 0.0
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    prompt_tokens_by_source: Mapping[str, float] = field(default_factory=dict)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Cumulative hit fraction of prefix-cache queries (0 before the first query)."""
        if self.prefix_cache_queries <= 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries


_GAUGES = {
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage_perc",
}
_COUNTERS = {
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
}


def parse_metrics(text: str) -> VllmLoad:
    """A `VllmLoad` from vLLM's Prometheus text exposition (missing series read as 0)."""
    values: dict[str, float] = {}
    by_source: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _GAUGES:
                key = _GAUGES[sample.name]
                values[key] = values.get(key, 0.0) + float(sample.value)
            elif sample.name in _COUNTERS:
                key = _COUNTERS[sample.name]
                values[key] = values.get(key, 0.0) + float(sample.value)
            elif sample.name == "vllm:prompt_tokens_by_source_total":
                source = sample.labels.get("source", "")
                by_source[source] = by_source.get(source, 0.0) + float(sample.value)
    return VllmLoad(prompt_tokens_by_source=by_source, **values)


def for_remote_decode(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill worker's copy of an OpenAI body: one token, no stream, remote decode."""
    out = dict(body)
    params = dict(REMOTE_DECODE_PARAMS)
    ktp = body.get("kv_transfer_params")
    if isinstance(ktp, Mapping) and CHUNK_PARAMS_KEY in ktp:
        # the chunk layout the router added (chunk reuse on): P reuses the chunks it holds
        params[CHUNK_PARAMS_KEY] = ktp[CHUNK_PARAMS_KEY]
    out.update(max_tokens=1, stream=False, kv_transfer_params=params)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    if "min_tokens" in out:
        out["min_tokens"] = 1
    out.pop("stream_options", None)
    return out


def transfer_params_of(prefill_answer: Mapping[str, Any]) -> dict[str, Any]:
    """The `kv_transfer_params` a prefill answer hands to the decoder."""
    params = prefill_answer.get("kv_transfer_params")
    if not isinstance(params, Mapping):
        raise UpstreamError("prefill answer has no kv_transfer_params (not a kv_producer?)")
    return dict(params)


def with_transfer_params(
    body: Mapping[str, Any], kv_transfer_params: Mapping[str, Any]
) -> dict[str, Any]:
    """The decode worker's copy: the original body plus the prefill's params, unchanged."""
    return dict(body, kv_transfer_params=dict(kv_transfer_params))


class VLLMRequestFlow:
    """What vLLM and the emulated engine share: vLLM's health and metrics endpoints, and P/D by
    handing the prefill's `kv_transfer_params` to the decoder."""

    health_path = "/health"
    metrics_path = "/metrics"
    pd_handoff = PDHandoff.AFTER_PREFILL

    def parse_load(self, metrics_text: str) -> WorkerLoad:
        return parse_load_metrics(metrics_text)

    def prefill_body(self, body: Mapping[str, Any], prefill: WorkerAddress) -> dict[str, Any]:
        return for_remote_decode(body)

    def decode_body(
        self,
        body: Mapping[str, Any],
        prefill_body: Mapping[str, Any],
        prefill_answer: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        if not isinstance(prefill_answer, Mapping):
            raise UpstreamError("prefill answer is not a JSON object")
        return with_transfer_params(body, transfer_params_of(prefill_answer))

    def handoff_release(self, prefill_answer: Mapping[str, Any]) -> tuple[str, bytes] | None:
        """None: vLLM's API has no call for it; its NIXL connector frees KV that no decoder
        holds when its lease runs out (`kv_lease_duration` in `kv_connector_extra_config`,
        30 s by default, renewed by the decode side's heartbeats)."""
        return None


class VLLMBackend(VLLMRequestFlow):
    """Real vLLM servers; an artifact fetch goes through the worker's sidecar."""

    kind = BackendKind.VLLM
    # vLLM 0.32's hybrid KV cache coordinator resumes only where every window group holds its
    # blocks (`SlidingWindowManager.find_longest_cache_hit`): it never rebuilds a window
    rebuilds_windows = False
    kv_event_sources_path = "/kv_event_sources"

    def kv_event_subscriber(
        self, settings: WorkerSettings, sink: KVEventSink
    ) -> KVEventSubscriber | None:
        endpoint = settings.kv_events_endpoint or ""
        # vLLM binds wildcard and ipc:// endpoints and connects to host:port ones (then the
        # subscriber binds)
        bind = endpoint.startswith("tcp://") and "*" not in endpoint
        return subscriber_for(settings, sink, bind=bind)

    def kv_api_url(self, address: WorkerAddress) -> str | None:
        return address.sidecar_url


# vLLM's API server closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s by default);
# httpx's default expiry is also 5 s, so a request could go out on a connection the server was
# closing at that moment and fail with an empty ReadError. Drop idle connections well before.
KEEPALIVE_EXPIRY_S = 2.0


class VllmClient:
    """HTTP client for one vLLM server (`base_url` like `http://127.0.0.1:8000`)."""

    def __init__(
        self,
        name: str,
        base_url: str,
        client: httpx.AsyncClient | None = None,
        timeout_s: float = 300.0,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.name = name
        self.base_url = base_url.rstrip("/")
        self._client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S),
        )
        self._owns_client = client is None
        self.backend = VLLMBackend()

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    def _bound(self, timeout_s: float) -> httpx.Timeout:
        """`timeout_s` for the call's reads; the connect keeps the client's own bound (a
        shared machine's stall can outlast a short one: it is not the server's answer)."""
        return httpx.Timeout(timeout_s, connect=self._client.timeout.connect)

    async def health(self, timeout_s: float = 2.0) -> bool:
        """True when `/health` answers 200 within `timeout_s`."""
        try:
            r = await self._client.get(
                self.base_url + self.backend.health_path, timeout=self._bound(timeout_s)
            )
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    async def load(self, timeout_s: float = 30.0) -> VllmLoad:
        """Scrape `/metrics` (its answer within `timeout_s`)."""
        try:
            r = await self._client.get(
                self.base_url + self.backend.metrics_path, timeout=self._bound(timeout_s)
            )
            r.raise_for_status()
        except httpx.HTTPError as exc:
            raise UpstreamError(f"{self.name}: /metrics failed: {exc}") from exc
        return parse_metrics(r.text)

    async def kv_event_sources(self) -> dict[int, dict[str, Any]]:
        """`/kv_event_sources`: per data-parallel rank, the publisher's resolved KV events config
        (`endpoint`, `replay_endpoint`, `topic`)."""
        try:
            r = await self._client.get(self.base_url + self.backend.kv_event_sources_path)
            r.raise_for_status()
        except httpx.HTTPError as exc:
            raise UpstreamError(f"{self.name}: /kv_event_sources failed: {exc}") from exc
        return {int(rank): dict(cfg) for rank, cfg in r.json().items()}

    async def post(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """A non-streaming OpenAI call; an error status raises `UpstreamError`."""
        try:
            r = await self._client.post(self.base_url + path, json=dict(body))
        except httpx.HTTPError as exc:
            raise UpstreamError(f"{self.name}: {path} failed: {exc!r}") from exc
        if r.status_code != 200:
            raise UpstreamError(f"{self.name}: {path} returned {r.status_code}: {r.text[:500]}")
        data: dict[str, Any] = r.json()
        return data

    async def stream(self, path: str, body: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """A streaming OpenAI call as parsed SSE chunks; ends at `[DONE]`; a connection lost
        before `[DONE]` raises `UpstreamError`."""
        req = dict(body, stream=True)
        try:
            async with self._client.stream("POST", self.base_url + path, json=req) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")
                    raise UpstreamError(f"{self.name}: {path} returned {r.status_code}: {text}")
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    yield json.loads(data)
        except httpx.HTTPError as exc:
            raise UpstreamError(f"{self.name}: {path} stream broke: {exc!r}") from exc
        raise UpstreamError(f"{self.name}: {path} stream ended without [DONE]")

    async def prefill_for_remote_decode(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Run the prefill half of P/D here; returns the `kv_transfer_params` for the decoder."""
        resp = await self.post(path, for_remote_decode(body))
        return transfer_params_of(resp)
