"""Program-level admission: while every worker that could serve a request has its KV working
set full, the request waits in the router's queue instead of pushing the engines into
preemption thrash; a session whose worker's programs are over the watermark is paused at its
tool boundary; the queue releases started sessions before new ones (the least served first,
the oldest first past an aging bound) and answers 429 to new sessions past its bounds
(`router/README.md`, *Admission*)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ownerserve.config import AdmissionSettings, WorkerSettings
from ownerserve.errors import RateLimitError
from ownerserve.profiles import load_profile
from ownerserve.tasks import cancel_and_wait
from ownerserve.types import Role
from planner.admission import (
    AdmissionQueue,
    Queued,
    admits_now,
    is_started,
    kv_paused,
    needs_programs_room,
    pauses_at_tool_boundary,
    programs_closed,
    resident_on,
)
from planner.admission import cluster_full as _full_after
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


@dataclass(frozen=True, slots=True)
class AdmissionShown:
    """One worker as admission sees it (`Admission.shown`)."""

    kv_usage: float
    """`WorkingSet.usage`: its KV pool's share in use, the router's requests since the last
    scrape counted; paused at `high_watermark`."""
    kv_capacity_tokens: int
    programs_tokens: int
    """The sessions' working set counted there (`planner.workingset`, and what the queue
    released onto it)..."""
    programs_budget_tokens: int
    """... against its KV pool plus its CPU tier: closed to new sessions past the high
    watermark of this."""
    sessions: int
    paused: bool
    closed: bool


@dataclass(eq=False, slots=True)
class Waiter:
    """A request in the admission queue (the key of its `planner.admission.Queued`)."""

    model: str
    session_id: str | None
    tokens: int
    queued_at: float
    started: bool
    """`planner.admission.is_started`: never refused, released before new sessions."""
    granted: asyncio.Future[None]
    reserved_on: WorkingSet | None = None
    bound: asyncio.TimerHandle | None = None
    """Fires once it has waited `max_queue_wait_s`."""


_PREFILL = Role.PREFILL  # an enum member looked up per worker costs ~0.1 µs

_Room = tuple[bool, WorkingSet | None]
"""Whether a request may go, and the worker's working set its prompt is reserved on."""

_EARLY_S = 1e-3
"""How far to look again when a wait bound's timer fired before the admission's clock shows
it passed (the loop may fire a timer up to its clock resolution early; a test's clock lags)."""


class Admission:
    """The admission queue of one router, and the working sets it is decided by; the rules
    are `planner.admission`'s, this keeps what they are decided on (the workers' loads and
    working sets) and the waiting (futures, timers, the recheck task, metrics)."""

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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._programs = working_sets if working_sets is not None else WorkingSets()
        """The sessions' working sets: a new session waits while they fill every worker."""
        self.enabled = settings.enabled
        self._pausing = settings.pause_watermark is not None
        self.clock = clock
        """What `now` is read from (a test sets its own; the wait bounds' timers run on the
        event loop's, and act by this one)."""
        self._pool = pool
        self._sessions = sessions
        self._metrics = metrics
        self._default_profile = default_profile
        self._recheck_s = recheck_s
        """How often a non-empty queue looks at the workers' scrapes again."""
        self._sets: dict[str, WorkingSet] = {}
        self._capacities: dict[str, int] = {}
        self._queue: AdmissionQueue[Waiter] = AdmissionQueue(settings)
        """Grouped by model."""
        self._full = False
        self._full_at = -1.0
        """`cluster_full`'s state (hysteresis) and when it was last looked at."""
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
        attained = self._sessions.attained(session_id)
        return self._home(session_id, parent, attained, self.clock()) is not None

    def _home(
        self, session_id: str | None, parent: str | None, attained: int, now: float
    ) -> str | None:
        """`resident_on`: the worker the session's KV is counted on; for a subagent with no
        service yet, its spawner's."""
        programs = self._programs
        return resident_on(
            programs.home(session_id, now)[0],
            attained,
            None if parent is None else lambda: programs.home(parent, now)[0],
        )

    def _holders(self, model: str) -> list[WorkerState]:
        """The workers that could hold a request's KV: decode-capable when there are any."""
        workers = self._pool.for_model(model)
        return [w for w in workers if w.settings.role is not _PREFILL] or workers

    def _open(self, w: WorkerState, ws: WorkingSet, usage: float) -> bool:
        """Whether `w` is not paused (`kv_paused` at `usage`); its state and gauge follow."""
        was = ws.paused
        paused = kv_paused(was, usage, self.settings)
        if paused is not was:
            ws.paused = paused
            self._metrics.admission_paused.labels(w.worker_id).set(1 if paused else 0)
        return not paused

    def _room(self, model: str, now: float, resident: bool) -> bool:
        """Whether a request for `model` may go now: some routable worker that could hold its
        KV is not paused — nor, for a request that is not `resident` (a new session, or one
        whose KV was released), closed to programs (`programs_closed`); True when no worker
        is routable (the planner then answers)."""
        routable = False
        for w in self._holders(model):
            if not w.routable(now):
                continue
            routable = True
            ws = self.working_set(w)
            if not self._open(w, ws, ws.usage(w.load)):
                continue
            if resident or not self._closed(
                ws, self._programs_share(w, ws, now), self._sessions_on(w, ws, now)
            ):
                return True
        return not routable

    def _roomiest(self, model: str, now: float) -> tuple[_Room, _Room]:
        """`_room` for a request that needs KV headroom only and for one that needs room for
        programs too, each with the emptiest such worker its prompt is reserved on (None when
        none is routable: (True, None) then; (False, None) when none has room), in one look at
        the workers."""
        s_best: WorkingSet | None = None
        p_best: WorkingSet | None = None
        s_usage = p_usage = math.inf
        routable = False
        for w in self._holders(model):
            if not w.routable(now):
                continue
            routable = True
            ws = self.working_set(w)
            usage = ws.usage(w.load)
            if not self._open(w, ws, usage):
                continue
            if usage < s_usage:
                s_best, s_usage = ws, usage
            programs = self._programs_share(w, ws, now)
            if self._closed(ws, programs, self._sessions_on(w, ws, now)):
                continue
            if programs > usage:
                usage = programs
            if usage < p_usage:
                p_best, p_usage = ws, usage
        none: _Room = (not routable, None)
        return (
            (True, s_best) if s_best is not None else none,
            (True, p_best) if p_best is not None else none,
        )

    def cluster_full(self, now: float) -> bool:
        """Whether the sessions' working sets fill the whole cluster (`planner.admission.
        cluster_full`): every routable worker that holds sessions (not prefill-only), their
        tokens over their pools plus CPU tiers, looked at every 50 ms at most. Only then are
        sessions paused at their tool boundaries and closed workers kept from sessions not
        resident there: below it, room exists somewhere, and the planner's W_disp spreads the
        sessions to it without making any wait."""
        if self.settings.pause_watermark is None:
            return False
        if now - self._full_at < 0.05:
            return self._full
        self._full_at = now
        tokens = budget = 0
        for w in self._pool.all():
            if w.settings.role is _PREFILL or not w.routable(now):
                continue
            t, b = self._programs_load(w, self.working_set(w), now)
            tokens += t
            budget += b
        share = tokens / budget if budget else 0.0
        self._full = _full_after(self._full, share, self.settings)
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

    def _home_share(self, worker_id: str, now: float) -> float:
        """`_programs_share` of the worker `worker_id` (0 once it left the pool)."""
        worker = self._pool.get(worker_id)
        if worker is None:
            return 0.0
        return self._programs_share(worker, self.working_set(worker), now)

    def _sessions_on(self, worker: WorkerState, ws: WorkingSet, now: float) -> int:
        """How many sessions its working set is of (and requests released onto it)."""
        return self._programs.sessions(worker.worker_id, now) + ws.reserved_sessions

    def _closed(self, ws: WorkingSet, programs: float, sessions: int) -> bool:
        """`programs_closed` at a working-set share of `programs` of `sessions` sessions; the
        worker's state follows."""
        closed = ws.closed = programs_closed(ws.closed, programs, sessions, self.settings)
        return closed

    def shown(self, worker: WorkerState, now: float) -> AdmissionShown:
        """What admission decides `worker`'s requests by, for the admin API: read, never
        decided (its paused and closed states are as last decided)."""
        ws = self.working_set(worker)
        tokens, budget = self._programs_load(worker, ws, now)
        return AdmissionShown(
            ws.usage(worker.load),
            ws.capacity(worker.load),
            tokens,
            budget,
            self._sessions_on(worker, ws, now),
            ws.paused,
            ws.closed,
        )

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
        """True when a request for `model` of `session_id` may go at once (`admits_now`):
        admission is off; or its session is resident and some worker has KV headroom; or
        nothing is queued and some worker has headroom and room for a new session (or none is
        routable); else it must `wait`. A started session whose KV is counted on a worker
        over the high watermark while the cluster is full is paused at this tool boundary
        (`pauses_at_tool_boundary`): its KV is released and its request waits. A subagent
        (`parent`: its spawner) with no service yet is resident while its spawner is."""
        if not self.enabled:
            return True
        now = self.clock()
        attained = self._sessions.attained(session_id)
        home = self._home(session_id, parent, attained, now)
        # (no pause without a pause watermark: its inputs are not even made then)
        if (
            home is not None
            and self._pausing
            and pauses_at_tool_boundary(
                attained,
                lambda: self._home_share(home, now),
                lambda: self.cluster_full(now),
                self.settings,
            )
        ):
            assert session_id is not None  # a session without an id has no home
            self._programs.release(session_id, now)
            self._metrics.sessions_paused.inc()
            return False
        if not admits_now(bool(self._queue), home is not None, lambda r: self._room(model, now, r)):
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
        request gets `RateLimitError` when `max_queued` new ones wait already (`refuses`) or
        its wait outlasts `max_queue_wait_s` (`timed_out`); a started session's is never
        refused (past that wait it needs only KV headroom). A session spawned by a session the
        router knows (`parent`: a subagent) is part of that program under way: started, with
        its own attained service (none yet, so it goes first). A cancel (the client went away,
        the request timed out) takes it out of the queue."""
        s = self.settings
        m = self._metrics
        queue = self._queue
        attained = self._sessions.attained(session_id)
        started = is_started(attained, self._sessions.get(parent) is not None)
        if queue.refuses(started):
            m.of(m.admission_rejected, "queue_full").inc()
            raise RateLimitError(
                f"the router's admission queue is full ({s.max_queued} requests wait for KV "
                "capacity)",
                code="queue_full",
                retry_after_s=s.retry_after_s,
            )
        loop = asyncio.get_running_loop()
        t0 = self.clock()
        waiter = Waiter(model, session_id, tokens, t0, started, loop.create_future())
        queue.add(waiter, t0, started=started, attained=attained, group=model)
        m.admission_queued.set(len(queue))
        if self._rechecks is None:
            self._rechecks = loop.create_task(self._recheck(), name="admission-recheck")
        waiter.bound = loop.call_later(s.max_queue_wait_s, self._at_bound, waiter)
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
            if waiter.bound is not None:
                waiter.bound.cancel()
            if queue.remove(waiter) is not None:
                m.admission_queued.set(len(queue))
            # the request is sent right after this (no await in between), so its reservation
            # gives way to its in-flight count; not sent, it frees the headroom for others
            ws = waiter.reserved_on
            if ws is not None:
                ws.reserved -= tokens
                ws.reserved_sessions -= 1
                waiter.reserved_on = None
                if outcome != "admitted":
                    self.pump()
            waited = self.clock() - t0
            m.of(m.admission_wait, outcome).observe(waited)
        m.of(m.admitted, "queued").inc()
        return waited

    def pump(self) -> None:
        """Refuse the queued requests `timed_out`, then release queued requests, in release
        order (`AdmissionQueue.next`), while a worker that could serve them has headroom; each
        released one reserves its prompt on the emptiest such worker."""
        queue = self._queue
        if not queue:
            return
        now = self.clock()
        self._refuse(queue.timed_out(now))
        room = self._rooms(now)
        if not any(ok for ok, _ in room.values()):
            return
        s = self.settings
        # a started session's request queued `aging_s` waits for KV headroom only below the
        # knee (nothing it began starves behind programs that keep running), past it after
        # the wait bound; a new session's waits for a worker open to programs, or its 429:
        # starting it where the programs fill the KV would evict the KV of sessions under way
        past_knee = self.cluster_full(now)

        def full() -> bool:
            return past_knee

        def may_go(model: Hashable, kv_only: bool) -> bool:
            return room[(str(model), kv_only)][0]

        while (e := queue.next(now, may_go, full, self._attained)) is not None:
            waiter = e.key
            if waiter.granted.done():  # cancelled, its task not yet out of `wait`
                continue
            kv_only = not needs_programs_room(e.started, e.queued_at, now, full, s)
            ws = room[(waiter.model, kv_only)][1]
            if ws is not None:
                ws.reserved += waiter.tokens
                ws.reserved_sessions += 1
                waiter.reserved_on = ws
            waiter.granted.set_result(None)
            if ws is not None:  # models may share workers: look again at them all
                room = self._rooms(now)
                if not any(ok for ok, _ in room.values()):
                    break
        self._metrics.admission_queued.set(len(queue))

    def _attained(self, waiter: Waiter) -> int:
        return self._sessions.attained(waiter.session_id)

    def _rooms(self, now: float) -> dict[tuple[str, bool], _Room]:
        """`_roomiest` of every model with requests queued, for requests that need only KV
        headroom (True) and for those that need room for programs too (False)."""
        rooms: dict[tuple[str, bool], _Room] = {}
        for group in self._queue.groups():
            model = str(group)
            rooms[(model, True)], rooms[(model, False)] = self._roomiest(model, now)
        return rooms

    def _at_bound(self, waiter: Waiter) -> None:
        """`waiter` has waited `max_queue_wait_s` by the loop's clock: a new session's request
        is refused (`timed_out`), a started one's may go on KV headroom alone (`pump`) — once
        the admission's clock shows it too, else this looks again then."""
        waiter.bound = None
        queue = self._queue
        if waiter not in queue:
            return
        now = self.clock()
        left = waiter.queued_at + self.settings.max_queue_wait_s - now
        if waiter.queued_at >= now - self.settings.max_queue_wait_s:
            loop = asyncio.get_running_loop()
            waiter.bound = loop.call_later(max(left, _EARLY_S), self._at_bound, waiter)
        elif waiter.started:
            self.pump()
        else:
            self._refuse(queue.timed_out(now))

    def _refuse(self, refused: list[Queued[Waiter]]) -> None:
        """Answer the requests `timed_out` took out of the queue with their 429."""
        if not refused:
            return
        m = self._metrics
        s = self.settings
        for e in refused:
            m.of(m.admission_rejected, "queue_timeout").inc()
            if not e.key.granted.done():
                e.key.granted.set_exception(
                    RateLimitError(
                        f"no worker had KV capacity for the request within "
                        f"{s.max_queue_wait_s:g} s",
                        code="queue_timeout",
                        retry_after_s=s.retry_after_s,
                    )
                )
        m.admission_queued.set(len(self._queue))

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
