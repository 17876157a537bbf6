"""The worker pool: static workers from the config plus those added at runtime, each with its
role, backend kind, health, load (router-side in-flight counts and scraped engine gauges)
and a circuit breaker. A background loop probes each worker's `/health` and scrapes its
`/metrics`, every worker on its own schedule: a worker whose probe hangs delays no other's."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from ownerserve.config import WorkerSettings
from ownerserve.tasks import cancel_and_wait
from ownerserve.types import PD_PATHS, KVPath, Role, Tier
from router.backends import Backend, WorkerAddress, WorkerLoad, backend_for
from router.upstream import UpstreamPool

FRESH_COMMITS = 256
"""Prefixes per worker whose commit `WorkerState.fresh_lease` remembers (a few seconds of a
busy worker's requests: what its KV events may lag behind)."""

log = logging.getLogger(__name__)


class BreakerState(IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


@dataclass(slots=True)
class CircuitBreaker:
    """Opens after `threshold` consecutive failures; after `cooldown_s` lets one trial through
    (half-open): success closes it, failure opens it again."""

    threshold: int = 3
    cooldown_s: float = 5.0
    failures: int = 0
    opened_at: float = 0.0
    state: BreakerState = BreakerState.CLOSED
    trial_in_flight: bool = False

    def allow(self, now: float | None = None) -> bool:
        if self.state is BreakerState.CLOSED:
            return True
        now = time.monotonic() if now is None else now
        if self.state is BreakerState.OPEN and now - self.opened_at >= self.cooldown_s:
            self.state = BreakerState.HALF_OPEN
            self.trial_in_flight = False
        return self.state is BreakerState.HALF_OPEN and not self.trial_in_flight

    def on_attempt(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self.trial_in_flight = True

    def record_success(self) -> None:
        self.failures = 0
        self.state = BreakerState.CLOSED
        self.trial_in_flight = False

    def record_failure(self, now: float | None = None) -> None:
        self.failures += 1
        self.trial_in_flight = False
        if self.state is BreakerState.HALF_OPEN or self.failures >= self.threshold:
            self.state = BreakerState.OPEN
            self.opened_at = time.monotonic() if now is None else now


@dataclass(slots=True)
class WorkerState:
    """One worker: its settings, backend, health, load and breaker."""

    settings: WorkerSettings
    backend: Backend
    address: WorkerAddress
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    healthy: bool = True
    draining: bool = False
    health_failures: int = 0
    inflight: int = 0
    inflight_prefill_tokens: int = 0
    inflight_kv_tokens: int = 0
    """Prompt tokens of the requests in flight whose sequence lives here (their decode
    worker): the KV its running requests hold now, which the last scrape of `kv_usage` (up to
    a scrape interval old) may not show yet, or still shows after they ended."""
    shared_inflight: int = 0
    """Requests in flight here over every router process sharing the Redis directory, as of
    this process's last reservation on it (`router.reservations`; 0 without them)."""
    load: WorkerLoad = field(default_factory=WorkerLoad)
    last_seen: float = 0.0
    kv_paths: frozenset[KVPath] = frozenset()
    """How KV moves into and out of it (`WorkerSettings.kv_paths_of`)."""
    pd_group: str | None = None
    """The P/D hand-over it takes part in (its backend kind's, when `kv_paths` has it)."""
    kv_api_ok: bool = True
    """Its KV API answered one of its last `dead_after_failures` probes (a sidecar's
    `/health`) and no fetch has failed to reach it since."""
    kv_api_failures: int = 0
    """Probes of its KV API failed in a row (one alone, a dropped packet or a pause, does not
    take the worker out of KV moves: as many as `health_failures` that make it dead do)."""
    directory_life: int | None = None
    """The directory's `worker_life` of it when this router last saw it come alive (None:
    not read): its death drops that life only (`Directory.drop_worker`)."""
    death_unrecorded: bool = False
    """Its death hook failed (the directory may still name its dead life): retried at its
    next probe, and before it counts as back."""
    view_cache: tuple[Any, Any] | None = None
    """The router's last planner view of this worker, with the inputs it was built from."""
    events_ts: float = float("-inf")
    """The newest engine timestamp (wall clock) of its KV event batches applied so far."""
    fresh_commits: OrderedDict[int, float] = field(default_factory=OrderedDict)
    """The chain tips of the last `FRESH_COMMITS` prefixes this router committed here, with
    the wall time of each commit (`note_commit`, `fresh_lease`)."""

    def note_commit(self, tip: int, wall: float) -> None:
        """This router committed the prefix ending in block `tip` here at `wall` (time.time())."""
        commits = self.fresh_commits
        commits[tip] = wall
        commits.move_to_end(tip)
        if len(commits) > FRESH_COMMITS:
            commits.popitem(last=False)

    def fresh_lease(self, tip: int) -> bool:
        """The prefix ending in `tip` was committed here by this router after every KV event
        batch of the worker applied so far was published: its events have not caught up with
        the engine's storing it (they are published at the step that seals the blocks, before
        the answer the commit follows), so the lease is the news, not a stale record."""
        wall = self.fresh_commits.get(tip)
        return wall is not None and wall > self.events_ts

    gpu_blocks: int = 0
    """Blocks its KV events say its HBM holds, running and idle alike: stored less removed
    (untagged events, or group 0's where the engine tags its KV cache groups;
    `router.membership.count_kv_blocks`)."""
    block_tokens: int = 0
    """The block size of its GPU KV events (0: none seen yet)."""
    cpu_blocks: int = 0
    ssd_blocks: int = 0
    """Blocks its KV events say its CPU and SSD tiers hold (vLLM's KV offloading: medium
    CPU, DISK), counted as `gpu_blocks` is."""
    offload_block_tokens: int = 0
    """The block size of its CPU and SSD KV events (0: none seen yet)."""

    def tier_blocks(self, tier: Tier) -> tuple[int, int]:
        """(blocks, tokens per block) its KV events say `tier` holds (tokens per block 0
        while no event of the tier came)."""
        if tier == Tier.GPU:
            return self.gpu_blocks, self.block_tokens
        blocks = self.cpu_blocks if tier == Tier.CPU else self.ssd_blocks
        return blocks, self.offload_block_tokens

    @property
    def cached_tokens(self) -> int:
        """Tokens of KV its HBM holds, as its KV events tell (`WorkerView.cached_tokens`)."""
        return self.gpu_blocks * self.block_tokens

    @property
    def worker_id(self) -> str:
        return self.settings.id

    @property
    def role(self) -> Role:
        return self.settings.role

    def routable(self, now: float | None = None) -> bool:
        """Can take new requests: healthy, not draining, breaker lets it through."""
        return self.healthy and not self.draining and self.breaker.allow(now)

    def serves(self, model: str) -> bool:
        return not self.settings.models or model in self.settings.models

    @property
    def kv_api(self) -> bool:
        """It can pull a fetched prefix in and serve its own now: a KV API, reachable."""
        return self.kv_api_ok and KVPath.SIDECAR in self.kv_paths

    @property
    def chunk_api(self) -> bool:
        """Its KV API can pull chunks from other holders and serve its own now."""
        return self.kv_api_ok and KVPath.CHUNK_FETCH in self.kv_paths

    def sidecar_url(self) -> str | None:
        """Its KV API's base URL when that is a process of its own (a sidecar), to probe."""
        url = self.backend.kv_api_url(self.address)
        return url if url is not None and url != self.address.url else None


def worker_state(settings: WorkerSettings) -> WorkerState:
    address = WorkerAddress(
        worker_id=settings.id,
        url=settings.url,
        bootstrap_port=settings.bootstrap_port,
        sidecar_url=settings.sidecar_url,
    )
    paths = settings.kv_paths_of()
    return WorkerState(
        settings=settings,
        backend=backend_for(settings.kind),
        address=address,
        kv_paths=paths,
        pd_group=settings.kind.value if PD_PATHS[settings.kind] in paths else None,
    )


WorkerDeathHook = Callable[[str], Awaitable[None]]
WorkerBackHook = Callable[[str], Awaitable[None]]


class WorkerPool:
    """All workers the router may use, by id."""

    def __init__(
        self,
        workers: Iterable[WorkerSettings] = (),
        *,
        health_interval_s: float = 2.0,
        health_timeout_s: float = 2.0,
        dead_after_failures: int = 2,
    ) -> None:
        self._workers: dict[str, WorkerState] = {}
        self._by_model: dict[str, list[WorkerState]] = {}
        for w in workers:
            self.add(w)
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.dead_after_failures = dead_after_failures
        self.on_worker_dead: WorkerDeathHook | None = None
        self.on_worker_back: WorkerBackHook | None = None
        """Called when a worker held dead answers again."""
        self._task: asyncio.Task[None] | None = None
        self._http: UpstreamPool | None = None

    # --- membership ------------------------------------------------------------------------

    def add(self, settings: WorkerSettings) -> WorkerState:
        if settings.id in self._workers:
            raise ValueError(f"worker {settings.id!r} already exists")
        state = worker_state(settings)
        self._workers[settings.id] = state
        self._by_model.clear()
        return state

    def remove(self, worker_id: str) -> WorkerState | None:
        self._by_model.clear()
        return self._workers.pop(worker_id, None)

    def drain(self, worker_id: str, draining: bool = True) -> WorkerState | None:
        state = self._workers.get(worker_id)
        if state is not None:
            state.draining = draining
        return state

    def get(self, worker_id: str) -> WorkerState | None:
        return self._workers.get(worker_id)

    def __len__(self) -> int:
        return len(self._workers)

    def all(self) -> list[WorkerState]:
        return list(self._workers.values())

    def for_model(self, model: str) -> list[WorkerState]:
        """Workers configured for `model` (healthy or not); cached until membership changes."""
        found = self._by_model.get(model)
        if found is None:
            found = [w for w in self._workers.values() if w.serves(model)]
            if len(self._by_model) < 1024:  # client input must not grow it without bound
                self._by_model[model] = found
        return list(found)

    def models(self) -> list[str]:
        seen: dict[str, None] = {}
        for w in self._workers.values():
            for m in w.settings.models:
                seen[m] = None
        return list(seen)

    # --- health and load ------------------------------------------------------------------

    async def start(self, http: UpstreamPool) -> None:
        self._http = http
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="worker-health")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _loop(self) -> None:
        """Every `health_interval_s`, a check of each worker whose last one has ended: each
        runs as its own task, so a worker whose check is slow (every GET up to
        `health_timeout_s`) skips its own turns, never another worker's."""
        probes: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                for state in self.all():
                    task = probes.get(state.worker_id)
                    if task is None or task.done():
                        probes[state.worker_id] = asyncio.create_task(
                            self._check_logged(state), name=f"worker-health:{state.worker_id}"
                        )
                for worker_id in [w for w in probes if w not in self._workers]:
                    probes.pop(worker_id).cancel()
                await asyncio.sleep(self.health_interval_s)
        finally:
            for task in probes.values():
                task.cancel()
            await asyncio.gather(*probes.values(), return_exceptions=True)

    async def _check_logged(self, state: WorkerState) -> None:
        try:
            await self.check(state)
        except Exception:
            log.exception("worker %s: health check failed", state.worker_id)

    async def check_all(self) -> None:
        """One check of every worker, side by side (each GET bounded by `health_timeout_s`)."""
        await asyncio.gather(*(self.check(w) for w in self.all()))

    async def check(self, state: WorkerState) -> None:
        """Probe one worker's `/health` and scrape its `/metrics`; marks it dead after
        `dead_after_failures` failed probes in a row."""
        url = state.address.url
        if await self._get(url, state.backend.health_path) is not None:
            if state.death_unrecorded:
                await self._record_death(state)  # its old life goes before its new one counts
            await self._probe_kv_api(state)
            was_dead = not state.healthy
            state.healthy = True
            state.health_failures = 0
            state.last_seen = time.monotonic()
            if was_dead:
                state.breaker.record_success()
                log.info("worker %s is healthy again", state.worker_id)
                if self.on_worker_back is not None:
                    try:
                        await self.on_worker_back(state.worker_id)
                    except Exception:
                        log.exception("worker %s: back-alive hook failed", state.worker_id)
            metrics = await self._get(url, state.backend.metrics_path)
            if metrics is not None:
                state.load = state.backend.parse_load(metrics.decode("utf-8", errors="replace"))
            return
        state.health_failures += 1
        if state.healthy and state.health_failures >= self.dead_after_failures:
            await self.mark_dead(state)
        elif state.death_unrecorded:
            await self._record_death(state)

    async def _get(self, url: str, path: str) -> bytes | None:
        """The body of a 200 answer to `GET url+path` within `health_timeout_s`; None when it
        failed, timed out or answered otherwise."""
        http = self._http
        assert http is not None
        try:
            async with asyncio.timeout(self.health_timeout_s):
                status, body = await http.call(url, b"GET", path)
        except (OSError, TimeoutError):
            return None
        return body if status == 200 else None

    async def _probe_kv_api(self, state: WorkerState) -> None:
        """`kv_api_ok` from the worker's sidecar's `/health` (a worker with no sidecar of its
        own serves its KV API itself: up while the worker is)."""
        url = state.sidecar_url() if KVPath.SIDECAR in state.kv_paths else None
        if url is None:
            state.kv_api_ok = True
            return
        if await self._get(url, "/health") is not None:
            state.kv_api_failures = 0
            ok = True
        else:
            state.kv_api_failures += 1
            ok = state.kv_api_ok and state.kv_api_failures < self.dead_after_failures
        if ok != state.kv_api_ok:
            log.log(
                logging.INFO if ok else logging.WARNING,
                "worker %s: KV API at %s %s",
                state.worker_id,
                url,
                "is up again" if ok else "is unreachable: no fetch or migration involves it",
            )
        state.kv_api_ok = ok

    async def mark_dead(self, state: WorkerState) -> None:
        """The worker stopped answering: stop routing to it and tell the directory."""
        if not state.healthy:
            return
        state.healthy = False
        log.warning("worker %s is unreachable; marking it dead", state.worker_id)
        await self._record_death(state)

    async def _record_death(self, state: WorkerState) -> None:
        """Run the death hook (the directory forgets the life that ended); one that fails is
        run again at the worker's next probe (`WorkerState.death_unrecorded`): a directory
        error at the wrong moment must not leave a dead life named until its entries expire."""
        if self.on_worker_dead is None:
            return
        try:
            await self.on_worker_dead(state.worker_id)
        except Exception:
            state.death_unrecorded = True
            log.exception("worker %s: death hook failed (retried next probe)", state.worker_id)
        else:
            state.death_unrecorded = False
