"""Program-level admission: while every worker that could serve a request has its KV working
set full, the request waits in the router's queue instead of pushing the engines into
preemption thrash; a session whose worker's programs are over the watermark is paused at its
tool boundary; the queue releases started sessions before new ones (the least served first,
the oldest first past an aging bound) and answers 429 to new sessions past its bounds
(`router/README.md`, *Admission*)."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ownerserve.config import AdmissionSettings, WorkerSettings
from ownerserve.errors import RateLimitError
from ownerserve.profiles import load_profile
from ownerserve.tasks import cancel_and_wait
from ownerserve.types import Role
from planner.workingset import WorkingSets
from router.backends import WorkerLoad
from router.pool import WorkerPool, WorkerState
from router.session import SessionTable
from router.telemetry import RouterMetrics

if TYPE_CHECKING:
    from router.writer import ResponseWriter


@dataclass(slots=True)
class WorkingSet:
    """One worker's KV working set as the router estimates it, in tokens of its KV pool: its
    last scraped usage plus what the router did since."""

    of: WorkerSettings
    """The worker it is of (a worker added again under its id gets a new one)."""
    profile_capacity_tokens: int
    """The pool's size by the worker's timing profile, where the worker does not say
    (`WorkerLoad.kv_capacity_tokens`, from `vllm:cache_config_info`)."""
    pending: int = 0
    """Prompt tokens of requests sent to it and not answered yet: in its queue, which its
    usage gauge does not show, or prefilling."""
    reserved: int = 0
    """Prompt tokens of requests released from the queue onto it and not sent yet."""
    reserved_sessions: int = 0
    """How many requests `reserved` is of."""
    scrape: WorkerLoad | None = None
    """The scrape `since_scrape` counts from."""
    since_scrape: int = 0
    """Prompt tokens of the answers that started streaming since that scrape, less those
    that ended since (the scrape shows neither)."""
    paused: bool = False
    """Over the high watermark and not yet back under the low one."""
    closed: bool = False
    """Its sessions' working set (`planner.workingset`) is over the high watermark and not yet
    back under the low one: it takes no new session (program-level admission)."""

    def sync(self, load: WorkerLoad) -> None:
        """A new scrape shows what happened before it: count from it."""
        if load is not self.scrape:
            self.scrape = load
            self.since_scrape = 0

    def usage(self, load: WorkerLoad) -> float:
        """Share of the KV pool in use: `kv_usage + (pending + reserved + since_scrape) /
        capacity_tokens`, the capacity as the worker says, else as its profile does."""
        self.sync(load)
        tokens = self.pending + self.reserved + self.since_scrape
        return load.kv_usage + tokens / self.capacity(load)

    def capacity(self, load: WorkerLoad) -> int:
        """The pool's size in tokens: as the worker says, else as its profile does."""
        return load.kv_capacity_tokens or self.profile_capacity_tokens


@dataclass(eq=False, slots=True)
class Waiter:
    """A request in the admission queue."""

    model: str
    session_id: str | None
    tokens: int
    queued_at: float
    seq: int
    granted: asyncio.Future[None]
    resident: bool
    """Its session's KV is counted in a working set already (it only continues a program)."""
    started: bool = False
    """Its session was served before (attained service > 0): a program under way, never
    refused by the queue's bounds and released before new sessions."""
    reserved_on: WorkingSet | None = None


def release_order(
    waiters: Iterable[Waiter], attained: Callable[[str | None], int], now: float, aging_s: float
) -> list[Waiter]:
    """The order the queue releases `waiters` in: started sessions first — those queued
    `aging_s` or longer oldest first, then by their session's attained service (`attained`),
    least first — then new sessions in arrival order."""
    aged = now - aging_s

    def key(w: Waiter) -> tuple[int, int, int]:
        if not w.started:
            return (2, 0, w.seq)
        if w.queued_at <= aged:
            return (0, 0, w.seq)
        return (1, attained(w.session_id), w.seq)

    return sorted(waiters, key=key)


class Admission:
    """The admission queue of one router, and the working sets it is decided by."""

    def __init__(
        self,
        settings: AdmissionSettings,
        pool: WorkerPool,
        sessions: SessionTable,
        metrics: RouterMetrics,
        *,
        default_profile: str,
        recheck_s: float,
        working_sets: WorkingSets | None = None,
    ) -> None:
        self.settings = settings
        self._programs = working_sets if working_sets is not None else WorkingSets()
        """The sessions' working sets: a new session waits while they fill every worker."""
        self.enabled = settings.enabled
        self._pool = pool
        self._sessions = sessions
        self._metrics = metrics
        self._default_profile = default_profile
        self._recheck_s = recheck_s
        """How often a non-empty queue looks at the workers' scrapes again."""
        self._sets: dict[str, WorkingSet] = {}
        self._capacities: dict[str, int] = {}
        self._queue: dict[Waiter, None] = {}
        """Insertion-ordered: arrival order, and O(1) removal."""
        self._models: dict[str, int] = {}
        """Queued requests per model."""
        self._new_waiting = 0
        """Queued requests of new sessions (what `max_queued` bounds)."""
        self._full = False
        self._full_at = -1.0
        """`cluster_full`'s state (hysteresis) and when it was last looked at."""
        self._seq = itertools.count()
        self._rechecks: asyncio.Task[None] | None = None
        self._admitted_now = metrics.admitted.labels("immediate")

    @property
    def queued(self) -> int:
        """Requests waiting in the queue now."""
        return len(self._queue)

    # --- the working sets --------------------------------------------------------------------

    def working_set(self, worker: WorkerState) -> WorkingSet:
        """The worker's working set (its profile's pool size: `hbm_kv_bytes` in tokens)."""
        ws = self._sets.get(worker.worker_id)
        if ws is None or ws.of is not worker.settings:
            profile = worker.settings.profile or self._default_profile
            capacity = self._capacities.get(profile)
            if capacity is None:
                p = load_profile(profile)
                capacity = self._capacities[profile] = max(
                    1, int(p.hbm_kv_bytes // p.kv_bytes_per_token)
                )
            ws = self._sets[worker.worker_id] = WorkingSet(worker.settings, capacity)
        return ws

    def sent(self, worker_id: str, tokens: int) -> WorkingSet | None:
        """A request was sent for `worker_id` to decode (its KV will live there); undo with
        `unsent` once it is answered or failed."""
        worker = self._pool.get(worker_id)
        if worker is None:
            return None
        ws = self.working_set(worker)
        ws.pending += tokens
        return ws

    def unsent(self, ws: WorkingSet, tokens: int) -> None:
        ws.pending -= tokens

    def streaming(self, worker: WorkerState, tokens: int) -> WorkingSet:
        """`worker` started streaming an answer: its prompt's KV is there until `ended`."""
        ws = self.working_set(worker)
        ws.sync(worker.load)
        ws.since_scrape += tokens
        return ws

    def ended(self, worker: WorkerState, ws: WorkingSet, tokens: int) -> None:
        """The answer `streaming` counted ended: its KV is free, and the queue may go on."""
        ws.sync(worker.load)
        ws.since_scrape -= tokens
        if self._queue:
            self.pump()

    def resident(self, session_id: str | None, parent: str | None = None) -> bool:
        """True when the session's KV is counted in a working set now: its request continues
        a program whose KV the engines already hold. So is a subagent's first request while
        its spawner's (`parent`) is: it starts on that KV."""
        return self._home(session_id, parent, time.monotonic()) is not None

    def _home(self, session_id: str | None, parent: str | None, now: float) -> str | None:
        """The worker the session's KV is counted on; for a subagent with no service yet, its
        spawner's."""
        home = self._programs.home(session_id, now)[0]
        if home is None and parent is not None and self._sessions.attained(session_id) == 0:
            home = self._programs.home(parent, now)[0]
        return home

    def _room(
        self, model: str, now: float, roomiest: bool, resident: bool
    ) -> tuple[bool, WorkingSet | None]:
        """Whether a request for `model` may go now, and onto which worker's working set:
        the first (or, `roomiest`, the emptiest) routable worker that could hold its KV
        (decode-capable when there are any) and is not paused — nor, for a request that is
        not `resident` (a new session, or one whose KV was released), closed to new sessions
        by its sessions' working set; (True, None) when no worker is routable (the planner
        then answers), (False, None) when all are paused."""
        workers = self._pool.for_model(model)
        holders = [w for w in workers if w.settings.role is not Role.PREFILL] or workers
        high, low = self.settings.high_watermark, self.settings.low_watermark
        best: WorkingSet | None = None
        best_usage = math.inf
        routable = False
        for w in holders:
            if not w.routable(now):
                continue
            routable = True
            ws = self.working_set(w)
            usage = ws.usage(w.load)
            if ws.paused:
                if usage >= low:
                    continue
                ws.paused = False
                self._metrics.admission_paused.labels(w.worker_id).set(0)
            elif usage >= high:
                ws.paused = True
                self._metrics.admission_paused.labels(w.worker_id).set(1)
                continue
            if not resident:
                programs = self._programs_share(w, ws, now)
                if self._closed(ws, programs, self._sessions_on(w, ws, now)):
                    continue
                if programs > usage:
                    usage = programs
            if not roomiest:
                return True, ws
            if usage < best_usage:
                best, best_usage = ws, usage
        if best is not None:
            return True, best
        return not routable, None

    def cluster_full(self, now: float) -> bool:
        """Whether the sessions' working sets fill the whole cluster: every routable worker
        that holds sessions (not prefill-only), their tokens over their pools plus CPU tiers,
        at `pause_watermark`, and until back under it by high − low (looked at every 50 ms at
        most). Only then are sessions paused at their tool boundaries and closed workers kept
        from sessions not resident there: below it, room exists somewhere, and the planner's
        W_disp spreads the sessions to it without making any wait."""
        on = self.settings.pause_watermark
        if on is None:
            return False
        if now - self._full_at < 0.05:
            return self._full
        self._full_at = now
        tokens = budget = 0
        for w in self._pool.all():
            if w.settings.role is Role.PREFILL or not w.routable(now):
                continue
            t, b = self._programs_load(w, self.working_set(w), now)
            tokens += t
            budget += b
        share = tokens / budget if budget else 0.0
        s = self.settings
        self._full = share >= (on - (s.high_watermark - s.low_watermark) if self._full else on)
        return self._full

    def _programs_load(self, worker: WorkerState, ws: WorkingSet, now: float) -> tuple[int, int]:
        """(tokens, budget): the sessions' working set on `worker` (and what was released onto
        it), and its KV pool plus its CPU tier (`cpu_kv_tokens`)."""
        tokens = self._programs.tokens(worker.worker_id, now) + ws.reserved
        return tokens, ws.capacity(worker.load) + worker.settings.cpu_kv_tokens

    def _programs_share(self, worker: WorkerState, ws: WorkingSet, now: float) -> float:
        """`_programs_load` as a share: tokens over budget."""
        tokens, budget = self._programs_load(worker, ws, now)
        return tokens / budget

    def _sessions_on(self, worker: WorkerState, ws: WorkingSet, now: float) -> int:
        """How many sessions its working set is of (and requests released onto it)."""
        return self._programs.sessions(worker.worker_id, now) + ws.reserved_sessions

    def _closed(self, ws: WorkingSet, programs: float, sessions: int) -> bool:
        """Whether the worker is closed to programs at a working-set share of `programs` of
        `sessions` sessions: closed at the high watermark, open again below the low one —
        but never while one session (or none) fills it: holding others back from it would
        run whole programs one after another, the worker idle through each tool gap, and
        keep nothing but that one session's KV from itself."""
        if sessions <= 1:
            ws.closed = False
            return False
        if ws.closed:
            if programs >= self.settings.low_watermark:
                return True
            ws.closed = False
            return False
        if programs >= self.settings.high_watermark:
            ws.closed = True
            return True
        return False

    def closed_to_programs(self, worker: WorkerState, now: float) -> bool:
        """Whether `worker` is closed to programs now (`WorkerView.programs_closed`: no
        session starts or resumes there while another worker is open). Asked only past the
        knee (`enabled and cluster_full`, which the caller looks at once for all workers)."""
        ws = self.working_set(worker)
        return self._closed(
            ws, self._programs_share(worker, ws, now), self._sessions_on(worker, ws, now)
        )

    # --- admitting ---------------------------------------------------------------------------

    def admit_now(
        self, model: str, session_id: str | None = None, parent: str | None = None
    ) -> bool:
        """True when a request for `model` of `session_id` may go at once: admission is off;
        or its session is `resident` and some worker has KV headroom; or nothing is queued and
        some worker has headroom and room for a new session (or none is routable); else it
        must `wait`. A started session whose KV is counted on a worker closed to programs is
        paused at this tool boundary: its KV is released and its request waits. A subagent
        (`parent`: its spawner) with no service yet is resident while its spawner is."""
        if not self.enabled:
            return True
        now = time.monotonic()
        home = self._home(session_id, parent, now)
        resident = home is not None
        if home is not None and self._sessions.attained(session_id) > 0 and self.cluster_full(now):
            worker = self._pool.get(home)
            if worker is not None:
                ws = self.working_set(worker)
                if self._programs_share(worker, ws, now) >= self.settings.high_watermark:
                    assert session_id is not None
                    self._programs.release(session_id, now)
                    self._metrics.sessions_paused.inc()
                    return False
        if (self._queue and not resident) or not self._room(model, now, False, resident)[0]:
            return False
        self._admitted_now.inc()
        return True

    async def wait(
        self,
        model: str,
        session_id: str | None,
        tokens: int,
        out: ResponseWriter,
        parent: str | None = None,
    ) -> float:
        """Queue the request until `pump` releases it; the seconds it waited. A new session's
        request gets `RateLimitError` when `max_queued` new ones wait already or its wait
        outlasts `max_queue_wait_s`; a started session's is never refused (past that wait it
        needs only KV headroom). A session spawned by a session the router knows (`parent`:
        a subagent) is part of that program under way: started, with its own attained
        service (none yet, so it goes first). A cancel (the client went away, the request
        timed out) takes it out of the queue."""
        s = self.settings
        m = self._metrics
        started = self._sessions.started(session_id, parent)
        if not started and self._new_waiting >= s.max_queued:
            m.of(m.admission_rejected, "queue_full").inc()
            raise RateLimitError(
                f"the router's admission queue is full ({s.max_queued} requests wait for KV "
                "capacity)",
                code="queue_full",
                retry_after_s=s.retry_after_s,
            )
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        waiter = Waiter(
            model,
            session_id,
            tokens,
            t0,
            next(self._seq),
            loop.create_future(),
            self.resident(session_id, parent),
            started,
        )
        self._enqueue(waiter)
        if started:  # past the bound it needs only KV headroom: look again then
            expiry = loop.call_later(s.max_queue_wait_s, self.pump)
        else:
            expiry = loop.call_later(s.max_queue_wait_s, self._expire, waiter)
        outcome = "admitted"
        try:
            self.pump()
            await waiter.granted
        except RateLimitError:
            outcome = "rejected"
            raise
        except asyncio.CancelledError:
            outcome = "client_disconnected" if out.disconnected else "cancelled"
            m.of(m.admission_abandoned, outcome).inc()
            raise
        finally:
            expiry.cancel()
            if waiter in self._queue:
                self._dequeue(waiter)
            # the request is sent right after this (no await in between), so its reservation
            # gives way to its in-flight count; not sent, it frees the headroom for others
            ws = waiter.reserved_on
            if ws is not None:
                ws.reserved -= tokens
                ws.reserved_sessions -= 1
                waiter.reserved_on = None
                if outcome != "admitted":
                    self.pump()
            waited = time.monotonic() - t0
            m.of(m.admission_wait, outcome).observe(waited)
        m.of(m.admitted, "queued").inc()
        return waited

    def pump(self) -> None:
        """Release queued requests, in `release_order`, while a worker that could serve them
        has headroom; each released one reserves its prompt on the emptiest such worker."""
        if not self._queue:
            return
        now = time.monotonic()
        room = self._rooms(now)
        if not any(ok for ok, _ in room.values()):
            return
        attained = self._sessions.attained
        bound = now - self.settings.max_queue_wait_s
        aged = now - self.settings.aging_s
        # a started session's request queued `aging_s` waits for KV headroom only below the
        # knee (nothing it began starves behind programs that keep running), past it after
        # the wait bound; a new session's waits for a worker open to programs, or its 429:
        # starting it where the programs fill the KV would evict the KV of sessions under way
        past_knee = self.cluster_full(now)
        for waiter in release_order(self._queue, attained, now, self.settings.aging_s):
            program_free = waiter.resident or (
                waiter.started
                and (waiter.queued_at <= bound or (waiter.queued_at <= aged and not past_knee))
            )
            ok, ws = room.get((waiter.model, program_free), (False, None))
            if not ok:
                continue
            self._dequeue(waiter)
            if ws is not None:
                ws.reserved += waiter.tokens
                ws.reserved_sessions += 1
                waiter.reserved_on = ws
            waiter.granted.set_result(None)
            if ws is not None:  # models may share workers: look again at them all
                room = self._rooms(now)
                if not any(ok for ok, _ in room.values()):
                    return

    def _rooms(self, now: float) -> dict[tuple[str, bool], tuple[bool, WorkingSet | None]]:
        return {
            (model, resident): self._room(model, now, True, resident)
            for model in list(self._models)
            for resident in (False, True)
        }

    def _expire(self, waiter: Waiter) -> None:
        if waiter.granted.done():
            return
        self._dequeue(waiter)
        m = self._metrics
        m.of(m.admission_rejected, "queue_timeout").inc()
        s = self.settings
        waiter.granted.set_exception(
            RateLimitError(
                f"no worker had KV capacity for the request within {s.max_queue_wait_s:g} s",
                code="queue_timeout",
                retry_after_s=s.retry_after_s,
            )
        )

    def _enqueue(self, waiter: Waiter) -> None:
        self._queue[waiter] = None
        if not waiter.started:
            self._new_waiting += 1
        self._models[waiter.model] = self._models.get(waiter.model, 0) + 1
        self._metrics.admission_queued.set(len(self._queue))
        if self._rechecks is None:
            self._rechecks = asyncio.get_running_loop().create_task(
                self._recheck(), name="admission-recheck"
            )

    def _dequeue(self, waiter: Waiter) -> None:
        del self._queue[waiter]
        if not waiter.started:
            self._new_waiting -= 1
        left = self._models[waiter.model] - 1
        if left:
            self._models[waiter.model] = left
        else:
            del self._models[waiter.model]
        self._metrics.admission_queued.set(len(self._queue))

    async def _recheck(self) -> None:
        """While requests wait, pump every `recheck_s`: a new scrape of the workers' KV usage
        (every `server.health_interval_s`) may show the headroom they wait for."""
        try:
            while self._queue:
                await asyncio.sleep(self._recheck_s)
                self.pump()
        finally:
            self._rechecks = None

    async def close(self) -> None:
        await cancel_and_wait(self._rechecks)

