"""What every backend shares: the worker's address, its scraped load, and the `Backend`
protocol: one worker kind's wire protocol, as the router's pool and plan executor call it.

Backends only build request bodies and parse worker answers; the router owns the HTTP
connections (one pool per worker), so a backend is cheap, stateless and shared by its workers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol
from urllib.parse import urlparse

from ownerserve.config import WorkerSettings
from ownerserve.types import BackendKind
from router.backends.kv_events import KVEventSink, KVEventSubscriber


@dataclass(frozen=True, slots=True)
class WorkerAddress:
    """Where a worker listens: its HTTP base URL and, for P/D protocols, its side ports."""

    worker_id: str
    url: str
    bootstrap_port: int | None = None
    sidecar_url: str | None = None

    @property
    def host(self) -> str:
        return urlparse(self.url).hostname or "127.0.0.1"


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's own view of its load, scraped from its Prometheus `/metrics`."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    kv_capacity_tokens: int = 0
    """Tokens of KV the worker's pool holds (vLLM's `vllm:cache_config_info`: num_gpu_blocks ·
    block_size; SGLang's `sglang:max_total_num_tokens`); 0 when the worker does not say."""
    offloads: bool = False
    """The worker offloads evicted KV to a CPU tier (it exports vLLM's KV-offloading gauge
    `vllm:kv_offload_cpu_cache_usage_perc`)."""


# vLLM's metric names; the emulated engine exports the same ones.
_LOAD_METRICS = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
    # SGLang's names
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    "sglang:token_usage": "kv_usage",
    "sglang:prompt_tokens_total": "prefix_cache_queries",
    "sglang:cached_tokens_total": "prefix_cache_hits",
    "sglang:max_total_num_tokens": "capacity",
    "vllm:kv_offload_cpu_cache_usage_perc": "offload_usage",
}


_CACHE_INFO = "vllm:cache_config_info{"


def _cache_capacity_tokens(line: str) -> int:
    """num_gpu_blocks · block_size from the labels of a `vllm:cache_config_info` sample (0 when
    either is missing or not a number, e.g. "None" before the engine profiled its memory)."""
    labels: dict[str, str] = {}
    for part in line[len(_CACHE_INFO) : line.rfind("}")].split(","):
        key, eq, value = part.partition("=")
        if eq:
            labels[key.strip()] = value.strip().strip('"')
    try:
        return max(0, int(labels["num_gpu_blocks"]) * int(labels["block_size"]))
    except (KeyError, ValueError):
        return 0


def parse_load_metrics(text: str) -> WorkerLoad:
    """Sum the load gauges of a Prometheus text exposition (all label sets of one name); the
    pool's size from vLLM's cache config info (summed over its engines) or SGLang's
    `sglang:max_total_num_tokens` (its schedulers' token pools; each data-parallel rank's
    scheduler reports its own)."""
    acc: dict[str, float] = {}
    capacity = 0
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        if line.startswith(_CACHE_INFO):
            capacity += _cache_capacity_tokens(line)
            continue
        name_end = len(line)
        for i, ch in enumerate(line):
            if ch in "{ ":
                name_end = i
                break
        field = _LOAD_METRICS.get(line[:name_end])
        if field is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[-1])
        except ValueError:
            continue
        if value != value:  # NaN
            continue
        acc[field] = acc.get(field, 0.0) + value
    return WorkerLoad(
        running=int(acc.get("running", 0.0)),
        waiting=int(acc.get("waiting", 0.0)),
        kv_usage=min(1.0, acc.get("kv_usage", 0.0)),
        prefix_cache_queries=acc.get("prefix_cache_queries", 0.0),
        prefix_cache_hits=acc.get("prefix_cache_hits", 0.0),
        kv_capacity_tokens=capacity or int(acc.get("capacity", 0.0)),
        offloads="offload_usage" in acc,
    )


class PDHandoff(Enum):
    """How a remote prefill's KV reaches the decode worker; it fixes the order of the two calls."""

    AFTER_PREFILL = "after_prefill"
    """P answers first and its answer names the KV that D pulls (vLLM's `kv_transfer_params`)."""
    RENDEZVOUS = "rendezvous"
    """P and D are called at once and meet at a room on P (SGLang's bootstrap room)."""


class Backend(Protocol):
    """One worker kind's wire protocol, its methods named for the moment the router calls them.

    Pool side (between requests): `health_path`, `metrics_path`, `parse_load` and, when the
    worker joins the router, `kv_event_subscriber`. Request side, on the prefill worker's backend
    when the plan is a remote prefill: `prefill_body`, then `decode_body` (in the order
    `pd_handoff` says), and `handoff_release` if the router gives up on the decode after P
    answered; on a worker that is the destination or source of an artifact fetch or state
    migration: `kv_api_url`.
    """

    kind: BackendKind
    health_path: str
    metrics_path: str
    pd_handoff: PDHandoff
    rebuilds_windows: bool
    """A hybrid model's prefix hit whose sliding windows the worker does not hold at the
    sealed boundary: whether its engine rebuilds them there by recomputing the last n_win·L
    tokens over the cached sealed KV (True), or only cuts the hit back to the deepest
    boundary whose windows it holds (False)."""

    def parse_load(self, metrics_text: str) -> WorkerLoad:
        """After each scrape: the worker's load from its `/metrics` text."""
        ...

    def kv_event_subscriber(
        self, settings: WorkerSettings, sink: KVEventSink
    ) -> KVEventSubscriber | None:
        """When the worker joins the router: a subscriber (not yet started) feeding its KV
        events to `sink`, or None when it publishes none."""
        ...

    def prefill_body(self, body: Mapping[str, Any], prefill: WorkerAddress) -> dict[str, Any]:
        """The plan is a remote prefill on `prefill`: the body P receives. Raises `ValueError`
        when `prefill`'s settings cannot serve the protocol (the router tries other workers)."""
        ...

    def decode_body(
        self,
        body: Mapping[str, Any],
        prefill_body: Mapping[str, Any],
        prefill_answer: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        """The body D receives: built from P's answer (`AFTER_PREFILL`; raises `UpstreamError`
        when the answer hands nothing over) or from P's body alone (`RENDEZVOUS`, answer None)."""
        ...

    def handoff_release(self, prefill_answer: Mapping[str, Any]) -> tuple[str, bytes] | None:
        """The router gave up on the decode that was to take the KV P holds since answering
        `prefill_answer` (`AFTER_PREFILL`): (path, JSON body) of the POST that tells P to free
        it now, or None when the protocol has none (P then frees it after its own timeout)."""
        ...

    def kv_api_url(self, address: WorkerAddress) -> str | None:
        """Base URL of the worker's OwnerServe KV API (an artifact fetch's destination pulls
        through it, its source serves through it), or None when the worker has none."""
        ...
