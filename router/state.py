"""`Router`: what one router process shares between requests (pool, directory, caches, HTTP
connection pool, telemetry, the planner), its lifecycle, and the narrow services each stage of
the request path is given (`services`, `router.services`). The request path's runner is
`router.pipeline.respond`; worker membership is `router.membership`."""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import time
from collections import deque
from collections.abc import Awaitable, Mapping
from typing import Any

from ownerserve.config import Settings
from ownerserve.directory.base import CachedCounts, Directory
from ownerserve.errors import AuthenticationError
from ownerserve.kvstate import KVStateSpec, load_spec
from ownerserve.profiles import load_profile
from ownerserve.tasks import cancel_and_wait, finish_or_cancel
from ownerserve.types import TIER_ORDER, Tier
from planner.calibration import Calibrator
from planner.copyreuse import CopyReuse
from planner.policies import Planner
from planner.types import Action
from planner.workingset import RetentionConfig, WorkingSets
from router import membership
from router.admission import Admission, AdmissionShown
from router.aftermath import REPLICA_TTL_S
from router.commit import CommittedLeases, Lifetimes, PendingCommits
from router.executor import PlanExecutor
from router.heap import trim_heap
from router.lease import LeaseLedger, LeaseServices
from router.links import NicLedger
from router.plans import PlanRecord, kv_prices_field
from router.pool import WorkerPool
from router.reservations import InflightReservations, shared_reservations
from router.services import (
    ClusterServices,
    CommitServices,
    ExecuteServices,
    LookUpServices,
    ObserveServices,
    ParseServices,
    RequestServices,
    StreamServices,
    ViewServices,
)
from router.session import DerivedSessionCache, SessionTable
from router.telemetry import TOP_SESSIONS, Telemetry
from router.tokens import TokenizationCache
from router.upstream import UpstreamPool

log = logging.getLogger(__name__)


class Router:
    """Shared state of one router process."""

    def __init__(
        self,
        settings: Settings,
        *,
        directory: Directory | None = None,
        planner: Planner | None = None,
        calibrator: Calibrator | None = None,
    ) -> None:
        self.settings = settings
        self.pool = WorkerPool(
            settings.workers,
            health_interval_s=settings.server.health_interval_s,
            health_timeout_s=settings.server.connect_timeout_s,
        )
        self.pool.on_worker_dead = functools.partial(membership.on_worker_dead, self)
        self.pool.on_worker_back = functools.partial(membership.on_worker_back, self)
        self.tokenizers = TokenizationCache(
            settings.models,
            settings.server.tokenizer_cache_mib * 1024 * 1024,
            settings.server.tokenizer_cache_sessions,
        )
        self.telemetry = Telemetry(settings.telemetry)
        self.metrics = self.telemetry.metrics
        self.directory: Directory | None = directory
        self._owns_directory = directory is None
        self.planner = planner if planner is not None else Planner.from_settings(settings)
        """The policies by name over one cost model (the default and per-request overrides)."""
        for price in self.planner.model.kv_prices:
            log.info(
                "KV transport %s: %.4g B/s, latency %.4g s (%s: %s)",
                price.transport.value,
                price.timing.bps,
                price.timing.latency_s,
                price.source.value,
                price.detail,
            )
        self.calibrator = calibrator if calibrator is not None else Calibrator()
        # the KV transfers this router's plans queued on each node's NIC (T_network's backlog)
        self.nics = NicLedger()
        self.http: UpstreamPool | None = None
        self.executor: PlanExecutor | None = None
        self.recent_plans: deque[PlanRecord] = deque(maxlen=256)
        self.sessions = SessionTable()
        p = settings.planner
        self.working_sets = WorkingSets(
            RetentionConfig(
                prior_gap_s=p.retention_prior_gap_s,
                max_gap_s=p.retention_max_gap_s,
                factor=p.retention_factor,
                max_sessions=p.retention_max_sessions,
                max_tools=p.retention_max_tools,
            )
        )
        """The sessions' KV working sets per worker (the planner's W_disp)."""
        self.copy_reuse = CopyReuse()
        """How often the replicas the plans fetch and the prompts remote prefills keep on P
        are hit again (`planner.copyreuse`: the planner's X_dup weighs them by it); fed by
        every plan (`router.stages.plan`)."""
        self.derived_sessions = DerivedSessionCache()
        self.admission = Admission(
            settings.admission,
            self.pool,
            self.sessions,
            self.metrics,
            default_profile=settings.planner.profile,
            # a new scrape comes every health interval: look a few times per interval
            recheck_s=settings.server.health_interval_s / 4,
            working_sets=self.working_sets,
        )
        """The admission queue: requests wait there while no worker has KV headroom."""
        self.background: set[asyncio.Task[Any]] = set()
        self.subscribers: list[Any] = []
        """KV event subscriptions, one per worker that publishes its events."""
        self.undropped: set[str] = set()
        """Removed workers the directory failed to forget (removing them again retries)."""
        self.reservations: InflightReservations | None = None
        """In-flight requests per worker shared over the router processes through Redis
        (`router.reservations`): with `server.processes` > 1 or
        `admission.max_inflight_per_worker`, and the Redis directory."""
        self.started = False
        self.inline_commit = False
        """True with the in-process directory: commits run inline (its calls never wait)."""
        self._sweeper: asyncio.Task[None] | None = None
        self._start_lock = asyncio.Lock()
        self.api_keys = tuple(k.encode() for k in settings.server.api_keys)
        self.kv_bytes_per_token = load_profile(settings.planner.profile).kv_bytes_per_token
        # each model's HeteroCache spec, loaded once (the request view's `kv_spec`)
        self.kv_specs: dict[str, KVStateSpec | None] = {
            m.name: None if m.kv_spec is None else load_spec(m.kv_spec) for m in settings.models
        }
        d = settings.directory
        self.lifetimes = Lifetimes(d.lease_s, d.session_ttl_s, REPLICA_TTL_S)
        self.refresh_period_s = min(d.lease_s, d.session_ttl_s) / 4
        """A session's unchanged directory records are rewritten at most this often."""
        self.leases = LeaseLedger()
        """The requests' open `RequestLease`s (`open`: how many hold something now)."""
        self.pending_commits = PendingCommits()
        """Each session's directory commit still in flight (a directory whose calls wait)."""
        self.committed_leases = CommittedLeases()
        """The blocks of the leases this router's commits hold, per worker without KV events
        (`ownerserve_kv_blocks{source="leases"}`)."""
        self._block_sizes = {m.name: m.block_size for m in settings.models}
        self._economics: asyncio.Task[None] | None = None
        self._heap_trimmer: asyncio.Task[None] | None = None
        self.heap_trims = 0
        """Times the heap trim loop released memory to the OS (`router/heap.py`)."""
        self.cached_counts: CachedCounts | None = None
        """The directory's GPU-cached blocks over every worker, as last read
        (`ownerserve_kv_blocks_distinct`, `_kv_block_copies`; None before the first read)."""
        self.admission_view: tuple[tuple[str, AdmissionShown], ...] = ()
        """Each worker as admission saw it at the last economics read (`ownerserve_admission_*`
        gauges)."""
        self.admission_full = False
        """`Admission.cluster_full` at the last economics read."""
        self.top_sessions: tuple[tuple[str, str, int], ...] = ()
        """The sessions holding the most KV at the last economics read: (session, worker,
        tokens), `ownerserve_session_kv_tokens`."""
        self.services = self.request_services()
        """Each stage's services (rebuilt when the directory opens and when the router
        starts: the directory and the executor come then)."""
        self._model_names = tuple(m.name for m in settings.models)
        self.metrics.start_at_zero(
            self._model_names, self.planner.default.name, [a.value for a in Action]
        )
        self.metrics.admission_high.set(settings.admission.high_watermark)
        self.metrics.on_read(self._observe_metrics)

    def _observe_metrics(self) -> None:
        """The gauges of the workers' states and of the open leases, set as each read of the
        metrics begins (`RouterMetrics.on_read`), each worker's KV per tier (from its KV
        events, or the leases this router holds for it), the directory's GPU-cached counts as
        last read, and each worker's error counters and prefix reuse counters (per model it
        serves) there."""
        m = self.metrics
        every_model = self._model_names
        for w in self.pool.all():
            wid = w.worker_id
            m.of(m.breaker, wid).set(int(w.breaker.state))
            m.of(m.healthy, wid).set(1 if w.healthy else 0)
            m.of(m.inflight, wid).set(w.inflight)
            m.worker_at_zero(wid)
            models = w.settings.models or every_model
            for model in models:
                m.prefix_tokens_of(model, wid)
            if w.settings.kv_events_endpoint:
                for tier in TIER_ORDER:
                    blocks, per_block = w.tier_blocks(tier)
                    m.of(m.kv_blocks, wid, tier.value, "events").set(blocks)
                    m.of(m.kv_tokens, wid, tier.value, "events").set(blocks * per_block)
            else:
                blocks = self.committed_leases.blocks(wid)
                per_block = self._block_sizes.get(models[0], 0) if models else 0
                m.of(m.kv_blocks, wid, Tier.GPU.value, "leases").set(blocks)
                m.of(m.kv_tokens, wid, Tier.GPU.value, "leases").set(blocks * per_block)
        for wid, a in self.admission_view:
            m.of(m.admission_kv_usage, wid).set(a.kv_usage)
            budget = a.programs_budget_tokens
            m.of(m.admission_ws_ratio, wid).set(a.programs_tokens / budget if budget else 0.0)
            m.of(m.admission_closed, wid).set(1 if a.closed else 0)
        m.admission_full.set(1 if self.admission_full else 0)
        m.show_top_sessions(self.top_sessions)
        m.leases_open.set(self.leases.open)
        counts = self.cached_counts
        if counts is not None:
            m.of(m.kv_distinct, Tier.GPU.value).set(counts.distinct)
            m.of(m.kv_copies, Tier.GPU.value).set(counts.copies)

    # --- lifecycle -------------------------------------------------------------------------

    async def open_directory(self) -> None:
        """Open `settings.directory` unless a directory was given."""
        if self.directory is None:
            from ownerserve.directory import open_directory

            self.directory = open_directory(self.settings.directory)
        from ownerserve.directory.memory import InMemoryDirectory

        self.inline_commit = type(self.directory) is InMemoryDirectory
        self.services = self.request_services()

    async def start(self) -> None:
        if self.started:
            return
        async with self._start_lock:
            if self.started:
                return
            await self.open_directory()
            self.http = UpstreamPool(self.settings.server.connect_timeout_s)
            self.executor = PlanExecutor(
                self.pool, self.http, self.telemetry.start_span, limits=self.settings.server
            )
            for w in self.pool.all():
                await membership.register(self, w.worker_id)
            await self.pool.start(self.http)
            self.reservations = shared_reservations(self.settings)
            if self.reservations is not None:
                await self.reservations.start()
            if self.settings.directory.sweep_interval_s > 0:
                self._sweeper = asyncio.create_task(self._sweep_loop(), name="directory-sweep")
            self._economics = asyncio.create_task(self._economics_loop(), name="kv-economics")
            if self.settings.server.heap_trim_interval_s > 0:
                self._heap_trimmer = asyncio.create_task(self._heap_trim_loop(), name="heap-trim")
            self.services = self.request_services()
            self.started = True

    async def _sweep_loop(self) -> None:
        """Purge what expired from the directory every `directory.sweep_interval_s`: leases,
        replicas and sessions are never read once expired, but without this they would stay in
        memory (in-process) or in Redis for good. Router replicas sharing a Redis directory
        take turns: about one sweep per interval among them all."""
        interval = self.settings.directory.sweep_interval_s
        while True:
            await asyncio.sleep(interval)
            directory = self.directory
            if directory is None:
                continue
            try:
                self.metrics.swept.inc(await directory.sweep(min_interval_s=0.9 * interval))
            except Exception as exc:
                self.metrics.sweep_errors.inc()
                log.warning("directory sweep failed: %r", exc)

    async def _economics_loop(self) -> None:
        """Every health interval, what the KV economics metrics read and a read must not do
        (a metrics read may run on the OTLP export's thread, and only reads): the expired
        leases leave `committed_leases`, admission's view and the top sessions are taken
        (`read_economics`), and the directory's GPU-cached counts are read (one round trip,
        `Directory.cached_counts`; a failed read keeps the last)."""
        interval = self.settings.server.health_interval_s
        while True:
            self.read_economics(time.monotonic())
            directory = self.directory
            if directory is not None:
                try:
                    self.cached_counts = await directory.cached_counts()
                except Exception as exc:
                    log.debug("reading the directory's cached counts failed: %r", exc)
            await asyncio.sleep(interval)

    def read_economics(self, now: float) -> None:
        """What `_observe_metrics` sets the admission and session gauges from, taken on the
        event loop (reading them expires sessions and working sets)."""
        self.committed_leases.expire()
        self.top_sessions = tuple(self.working_sets.largest(TOP_SESSIONS, now))
        admission = self.admission
        self.admission_view = tuple((w.worker_id, admission.shown(w, now)) for w in self.pool.all())
        self.admission_full = admission.cluster_full(now)

    async def _heap_trim_loop(self) -> None:
        """Every `server.heap_trim_interval_s`, malloc's free pages back to the OS
        (`router/heap.py`): RSS follows the heap in use instead of its high-water mark."""
        interval = self.settings.server.heap_trim_interval_s
        while True:
            await asyncio.sleep(interval)
            if trim_heap():
                self.heap_trims += 1

    async def close(self) -> None:
        if self.reservations is not None:
            await self.reservations.close()
            self.reservations = None
        await cancel_and_wait(self._heap_trimmer)
        self._heap_trimmer = None
        await cancel_and_wait(self._sweeper)
        self._sweeper = None
        await cancel_and_wait(self._economics)
        self._economics = None
        await self.admission.close()
        await self.pool.close()
        for sub in self.subscribers:
            await membership.close_subscriber(self, sub)
        self.subscribers.clear()
        # what requests left running (commits, probes) finishes, or is stopped after 2 s
        await finish_or_cancel(list(self.background), grace_s=2.0)
        if self.http is not None:
            await self.http.close()
            self.http = None
        if self.directory is not None and self._owns_directory:
            await self.directory.close()
        # exporters flush synchronously over HTTP: not on the event loop
        await asyncio.to_thread(self.telemetry.shutdown)
        self.started = False

    # --- shared services of the request path -----------------------------------------------

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        """Run `coro` in the background; `close` waits for it a little."""
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    def check_auth(self, headers: Mapping[str, str]) -> None:
        """The client API key (`Authorization: Bearer …`), when `server.api_keys` are set."""
        if not self.api_keys:
            return
        auth = headers.get("authorization", "")
        key = auth[7:].strip().encode() if auth[:7].lower() == "bearer " else b""
        ok = False
        if key:  # an empty key matches nothing, not even an empty key in the settings
            for k in self.api_keys:
                ok |= bool(k) and hmac.compare_digest(key, k)
        if not ok:
            raise AuthenticationError("missing or invalid API key")

    def request_services(self) -> RequestServices:
        """Each stage of the request path's services, as they are now (`router.services`)."""
        metrics = self.metrics
        tel = self.telemetry
        p = self.settings.planner
        return RequestServices(
            parse=ParseServices(self.tokenizers, self.pool),
            derived_sessions=self.derived_sessions,
            sessions=self.sessions,
            admission=self.admission,
            look_up=LookUpServices(self.directory, self.pending_commits, metrics.directory_errors),
            view=ViewServices(
                self.planner,
                p.allow_policy_header,
                self.sessions,
                self.working_sets,
                self.kv_bytes_per_token,
                self.kv_specs,
                self.copy_reuse,
            ),
            cluster=ClusterServices(
                self.pool,
                self.calibrator,
                self.nics,
                self.working_sets,
                self.admission,
                self.settings,
                self.copy_reuse,
            ),
            execute=ExecuteServices(self.executor, self.pool, self.settings.server, metrics),
            stream=StreamServices(
                metrics,
                self.pool,
                self.spawn,
                self.recent_plans,
                kv_prices_field(self.planner.model.kv_prices),
            ),
            commit=CommitServices(
                self.directory,
                self.inline_commit,
                self.sessions,
                self.lifetimes,
                self.refresh_period_s,
                self.kv_bytes_per_token,
                self.executor,
                self.pool,
                tel.start_span,
                self.spawn,
                self.pending_commits,
                metrics.commit_errors,
                self.committed_leases,
            ),
            observe=ObserveServices(metrics, self.calibrator),
            lease=LeaseServices(
                self.leases, self.pool, self.admission, self.working_sets, self.nics
            ),
        )
