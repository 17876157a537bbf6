"""Worker metrics for benchmarks: scrape Prometheus text and turn it into cluster-wide numbers.

Reads vLLM's metric names (so it works on real vLLM too) and the emulated engine's
`ownerserve_emulator_*` counters: prefill tokens computed, KV bytes received by transfer (P->D
and artifact fetch), resident blocks. The HBM duplicate factor is bytes of KV held across workers
over bytes of distinct KV: held block hashes per worker, summed, over the size of their union.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import httpx

from loadgen.report import ClusterStats

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Sample = tuple[str, tuple[tuple[str, str], ...], float]


def parse_prometheus(text: str) -> list[Sample]:
    """`(name, sorted labels, value)` for every sample line of a text exposition."""
    out: list[Sample] = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(3) or "")))
        out.append((m.group(1), labels, value))
    return out


def metric_sum(samples: Iterable[Sample], name: str, **match: str) -> float | None:
    """Sum of `name` over samples whose labels include `match`; None when absent."""
    total = None
    for n, labels, v in samples:
        if n != name:
            continue
        d = dict(labels)
        if all(d.get(k) == val for k, val in match.items()):
            total = (total or 0.0) + v
    return total


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """One worker's counters at one moment."""

    url: str
    samples: tuple[Sample, ...]
    held_hashes: frozenset[int] | None = None

    def get(self, name: str, **match: str) -> float | None:
        return metric_sum(self.samples, name, **match)


P = "ownerserve_emulator_"
HELD_BLOCKS_PATH = "/kv_blocks"


async def _held_hashes(client: httpx.AsyncClient, url: str) -> frozenset[int] | None:
    try:
        resp = await client.get(url + HELD_BLOCKS_PATH)
        if resp.status_code != 200:
            return None
        data = resp.json()
        hashes = data.get("block_hashes") if isinstance(data, dict) else data
        return frozenset(int(h) for h in hashes or ())
    except (httpx.HTTPError, ValueError, TypeError):
        return None


async def snapshot(
    client: httpx.AsyncClient, url: str, *, with_hashes: bool = True
) -> WorkerSnapshot:
    resp = await client.get(url + "/metrics")
    resp.raise_for_status()
    held = await _held_hashes(client, url) if with_hashes else None
    return WorkerSnapshot(url, tuple(parse_prometheus(resp.text)), held)


async def snapshot_all(urls: Sequence[str], *, with_hashes: bool = True) -> list[WorkerSnapshot]:
    async with httpx.AsyncClient(timeout=10.0) as client:
        return list(
            await asyncio.gather(*(snapshot(client, u, with_hashes=with_hashes) for u in urls))
        )


def duplicate_factor(held: Sequence[frozenset[int]]) -> tuple[float | None, int, int]:
    """`(sum of held blocks / distinct blocks, held, distinct)`; blocks are equal-sized."""
    total = sum(len(h) for h in held)
    distinct = len(frozenset().union(*held)) if held else 0
    return (total / distinct if distinct else None), total, distinct


def _sum(snaps: Sequence[WorkerSnapshot], name: str, **match: str) -> float | None:
    vals = [v for s in snaps if (v := s.get(name, **match)) is not None]
    return sum(vals) if vals else None


def _int(x: float | None) -> int | None:
    return None if x is None else round(x)


def cluster_stats(
    after: Sequence[WorkerSnapshot],
    before: Sequence[WorkerSnapshot] | None = None,
    dup_samples: Sequence[float] = (),
) -> ClusterStats:
    """Cluster totals over a run: counters of `after` minus `before` (per worker URL)."""
    base: Mapping[str, WorkerSnapshot] = {s.url: s for s in before or ()}

    def delta(name: str, **match: str) -> float | None:
        total = None
        for s in after:
            v = s.get(name, **match)
            if v is None:
                continue
            b = base[s.url].get(name, **match) if s.url in base else None
            total = (total or 0.0) + v - (b or 0.0)
        return total

    prompt = delta("vllm:prompt_tokens_total")
    computed = delta(f"{P}prefill_tokens_computed_total")
    if computed is None:
        computed = delta("vllm:prompt_tokens_by_source_total", source="local_compute")
    queries = delta("vllm:prefix_cache_queries_total")
    hits = delta("vllm:prefix_cache_hits_total")
    cpu_hits = delta("vllm:prompt_tokens_cached_by_source_total", source="host")
    cpu_held = [v for s in after if (v := s.get(f"{P}cpu_kv_blocks_held")) is not None]
    pd = delta(f"{P}kv_received_bytes_total", kind="pd")
    fetch = delta(f"{P}kv_received_bytes_total", kind="fetch")
    held = [s.held_hashes for s in after if s.held_hashes is not None]
    dup = held_blocks = distinct = None
    if held and len(held) == len(after):
        dup, held_blocks, distinct = duplicate_factor(held)
    samples = [*dup_samples, *([dup] if dup is not None else [])]
    return ClusterStats(
        prompt_tokens=_int(prompt),
        prefill_tokens_computed=_int(computed),
        prefix_hit_rate=(hits / queries) if hits is not None and queries else None,
        kv_bytes_pd=_int(pd),
        kv_bytes_fetch=_int(fetch),
        duplicate_factor=(sum(samples) / len(samples)) if samples else None,
        duplicate_factor_peak=max(samples) if samples else None,
        held_blocks=held_blocks,
        distinct_blocks=distinct,
        cpu_hit_tokens=_int(cpu_hits),
        cpu_blocks_held=_int(sum(cpu_held)) if cpu_held else None,
        preemptions=_int(delta("vllm:num_preemptions_total")),
        kv_transfers_expired=_int(delta(f"{P}kv_transfers_expired_total")),
    )


class DuplicateSampler:
    """Samples the cluster's duplicate factor every `interval_s` while a run goes on."""

    def __init__(self, urls: Sequence[str], interval_s: float = 2.0) -> None:
        self.urls = list(urls)
        self.interval_s = interval_s
        self.samples: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _loop(self) -> None:
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                await asyncio.sleep(self.interval_s)
                held = await asyncio.gather(*(_held_hashes(client, u) for u in self.urls))
                sets = [h for h in held if h is not None]
                if sets and len(sets) == len(held):
                    dup, _, _ = duplicate_factor(sets)
                    if dup is not None:
                        self.samples.append(dup)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> list[float]:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        return self.samples


ADMISSION_QUEUED = "ownerserve_admission_queued"
"""The router's gauge of requests waiting in its admission queue (OwnerServe's router)."""


class RouterQueueSampler:
    """Samples the router's admission queue (`ADMISSION_QUEUED`) every `interval_s` while a run
    goes on; `stop()` gives the peak, None when the router exposes no such gauge."""

    def __init__(self, router_url: str, interval_s: float = 2.0) -> None:
        self.url = router_url + "/metrics"
        self.interval_s = interval_s
        self.peak: float | None = None
        self._task: asyncio.Task[None] | None = None

    async def _loop(self) -> None:
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                await asyncio.sleep(self.interval_s)
                try:
                    resp = await client.get(self.url)
                except httpx.HTTPError:
                    continue
                if resp.status_code != 200:
                    return  # a peer router without /metrics on its serving port
                queued = metric_sum(parse_prometheus(resp.text), ADMISSION_QUEUED)
                if queued is not None:
                    self.peak = queued if self.peak is None else max(self.peak, queued)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> float | None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        return self.peak
