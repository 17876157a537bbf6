"""What every worker adapter shares: the worker's address, its scraped load, and the small
protocol the router's plan executor calls at each moment of a request's life.

Adapters only build request bodies and parse worker answers; the router owns the HTTP
connections (one pool per worker), so an adapter is cheap and stateless.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlparse

from ownerserve.types import BackendKind, Role


@dataclass(frozen=True, slots=True)
class WorkerAddress:
    """Where a worker listens: its HTTP base URL and, for P/D protocols, its side ports."""

    worker_id: str
    url: str
    role: Role = Role.HYBRID
    kind: BackendKind = BackendKind.EMULATOR
    bootstrap_port: int | None = None
    sidecar_url: str | None = None

    @property
    def host(self) -> str:
        return urlparse(self.url).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        parsed = urlparse(self.url)
        return parsed.port or (443 if parsed.scheme == "https" else 80)


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's own view of its load, scraped from its Prometheus `/metrics`."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0


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
}


def parse_load_metrics(text: str) -> WorkerLoad:
    """Sum the load gauges of a Prometheus text exposition (all label sets of one name)."""
    acc: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
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
    )


class WorkerAdapter(Protocol):
    """One worker kind's protocol, named for the moments the router calls it."""

    kind: BackendKind
    health_path: str
    metrics_path: str

    def parse_load(self, metrics_text: str) -> WorkerLoad:
        """Turn the worker's `/metrics` text into its load."""
        ...


def usage_of(response: Mapping[str, Any]) -> tuple[int, int, int]:
    """(prompt_tokens, completion_tokens, cached_tokens) of an OpenAI response or chunk."""
    usage = response.get("usage")
    if not isinstance(usage, Mapping):
        return 0, 0, 0
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return (
        int(usage.get("prompt_tokens") or 0),
        int(usage.get("completion_tokens") or 0),
        int(cached or 0),
    )
