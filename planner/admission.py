"""Program-level admission's rules (`router/README.md`, *Admission*; formulas in
`planner/README.md`, *Admission*): who goes at once, what waits and in which order the queue
releases it, what is refused, when a worker is paused or closed to programs and when the
cluster is full.

Pure: no I/O, no clock of its own. The router (`router.admission`: futures, timers, metrics,
the workers' scraped loads) and the simulator (`loadgen.sim.admission`: simulated events)
feed it what they see with their own `now`; the numbers are `AdmissionSettings`
(`admission.*` of the router's settings, declared once in `ownerserve.config`). An input
that costs a look at the cluster is passed as a callable, asked only when the rule needs it
(both callers' hysteresis states are updated only where they are asked)."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ownerserve.config import AdmissionSettings

__all__ = [
    "AdmissionQueue",
    "AdmissionSettings",
    "Queued",
    "admits_now",
    "cluster_full",
    "is_started",
    "kv_paused",
    "needs_programs_room",
    "pauses_at_tool_boundary",
    "programs_closed",
    "release_key",
    "release_order",
    "resident_on",
    "timed_out",
]

K = TypeVar("K", bound=Hashable)

# --- the workers ----------------------------------------------------------------------------------


def kv_paused(paused: bool, usage: float, s: AdmissionSettings) -> bool:
    """Whether a worker is paused (takes nothing from the queue) after a look at `usage`, the
    share of its KV pool in use, when it was `paused` before (hysteresis):

        paused' = usage ≥ (low_watermark if paused else high_watermark)"""
    return usage >= (s.low_watermark if paused else s.high_watermark)


def programs_closed(closed: bool, share: float, sessions: int, s: AdmissionSettings) -> bool:
    """Whether a worker is closed to programs (takes no session not resident there) after a
    look at `share`, its sessions' working set over its pool plus CPU tier, of `sessions`
    sessions, when it was `closed` before:

        closed' = sessions > 1 ∧ share ≥ (low_watermark if closed else high_watermark)

    Never while one session (or none) fills it: holding others back would run whole programs
    one after another, the worker idle through each tool gap, and keep nothing but that one
    session's KV from itself."""
    if sessions <= 1:
        return False
    return share >= (s.low_watermark if closed else s.high_watermark)


def cluster_full(full: bool, share: float, s: AdmissionSettings) -> bool:
    """Whether the sessions' working sets fill the whole cluster (past the knee) after a look
    at `share`, all their tokens over all pools plus CPU tiers, when it was `full` before:

        full' = pause_watermark ≠ None ∧ share ≥ (pause − (high − low) if full else pause)

    Only then are sessions paused at their tool boundaries, closed workers marked in the
    planner's view, and queued requests kept from ageing into the cluster."""
    on = s.pause_watermark
    if on is None:
        return False
    return share >= (on - (s.high_watermark - s.low_watermark) if full else on)


# --- a request ------------------------------------------------------------------------------------


def is_started(attained: int, spawner_known: bool) -> bool:
    """Whether a session is part of a program under way: `attained > 0` (it was served
    before) ∨ `spawner_known` (a subagent of a session the caller knows). A started session's
    request is never refused and goes before new sessions'."""
    return attained > 0 or spawner_known


def resident_on(
    own: str | None, attained: int, spawner_home: Callable[[], str | None] | None
) -> str | None:
    """The worker a request's KV is counted on (it is *resident*: it continues a program whose
    KV the engines hold): its session's own home `own`; else, for a subagent with no service
    yet (`attained == 0`), its spawner's (`spawner_home`: it starts on that KV)."""
    if own is not None or attained or spawner_home is None:
        return own
    return spawner_home()


def pauses_at_tool_boundary(
    attained: int,
    home_share: Callable[[], float],
    full: Callable[[], bool],
    s: AdmissionSettings,
) -> bool:
    """Whether a resident session's request is paused at its tool boundary (its KV is released
    and it waits):

        attained > 0 ∧ home_share ≥ high_watermark ∧ cluster_full

    `home_share`: its home worker's working set over that worker's pool plus CPU tier; the
    cluster is asked last (the costlier look), and neither without a pause watermark (the
    cluster is never full then)."""
    return (
        attained > 0
        and s.pause_watermark is not None
        and home_share() >= s.high_watermark
        and full()
    )


def admits_now(queued: bool, resident: bool, room: Callable[[bool], bool]) -> bool:
    """Whether a request goes at once, past the queue:

        (¬queued ∨ resident) ∧ room(resident)

    `queued`: requests wait already (a new one does not pass them, a resident one does);
    `room(resident)`: some worker that could hold its KV is not paused — and, for a request not
    resident, not closed to programs (or none is routable: the planner then answers)."""
    return (not queued or resident) and room(resident)


def needs_programs_room(
    started: bool, queued_at: float, now: float, full: Callable[[], bool], s: AdmissionSettings
) -> bool:
    """Whether a queued request waits for a worker open to programs (else KV headroom is
    enough):

        ¬(started ∧ (waited ≥ max_queue_wait_s ∨ (waited ≥ aging_s ∧ ¬cluster_full)))

    with `waited = now − queued_at`: a started session's request past the wait bound, or
    past the aging bound below the knee, no longer waits for the programs' room (nothing it
    began starves); a new session's never ages past it (it waits for room or its 429). A
    request resident when it came (queued because every worker was paused) waits the same
    way (`planner/README.md`, *Admission*, says why)."""
    if not started:
        return True
    if queued_at <= now - s.max_queue_wait_s:
        return False
    return not (queued_at <= now - s.aging_s and not full())


def timed_out(started: bool, queued_at: float, now: float, s: AdmissionSettings) -> bool:
    """Whether a queued request is refused (429 `queue_timeout`) for its wait:

        ¬started ∧ queued_at < now − max_queue_wait_s

    A started session's request is never refused (`max_queued` bounds new ones only)."""
    return not started and queued_at < now - s.max_queue_wait_s


def release_key(
    started: bool, queued_at: float, attained: int, seq: int, now: float, aging_s: float
) -> tuple[int, int, int]:
    """A queued request's place in the release order (least first):

        (0, 0, seq)         a started session's, queued aging_s or longer: oldest first
        (1, attained, seq)  another started session's: least attained service first
        (2, 0, seq)         a new session's: first come, first served

    `seq` is the arrival order; `attained` the session's attained service now (tokens it was
    served: short programs pass long ones)."""
    if not started:
        return (2, 0, seq)
    if queued_at <= now - aging_s:
        return (0, 0, seq)
    return (1, attained, seq)


# --- the queue ------------------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class Queued(Generic[K]):
    """A request in an `AdmissionQueue`."""

    key: K
    """The caller's handle of it (the router's waiter, the simulator's session)."""
    group: Hashable
    """What may release it: requests of one group share the workers that could serve them
    (the router's model)."""
    queued_at: float
    seq: int
    """Arrival order."""
    started: bool
    """`is_started`."""
    attained: int
    """Its session's attained service when last looked at."""
    live: bool = True
    """False once released, refused or taken out (the lanes drop it lazily)."""


@dataclass(slots=True)
class _Lane(Generic[K]):
    """One group's queued requests, in the orders `release_key` needs."""

    fifo: deque[Queued[K]]
    """Started sessions' requests, arrival order (those past `aging_s` come out first)."""
    las: list[tuple[int, int, Queued[K]]]
    """Started sessions' requests, a heap of (attained, seq)."""
    new: deque[Queued[K]]
    """New sessions' requests, arrival order."""
    live: int = 0


def _lane() -> _Lane[K]:
    return _Lane(deque(), [], deque())


class AdmissionQueue(Generic[K]):
    """The requests that wait, and which one goes next: the first in `release_order` whose
    room is there (`room(group, needs only KV headroom)`), in O(log n) a release (plus a scan
    of the started ones past the wait bound, where it is shorter than the aging bound).

    A session's attained service grows while its request waits when another of its requests
    is answered: `next` looks it up again (`attained`) at the top of the heap, which is exact
    for growth (a session forgotten meanwhile, whose service drops to 0, may go later than a
    full sort would let it)."""

    def __init__(self, settings: AdmissionSettings) -> None:
        self.settings = settings
        self._entries: dict[K, Queued[K]] = {}
        self._lanes: dict[Hashable, _Lane[K]] = {}
        self._seq = 0
        self.new_waiting = 0
        """Queued requests of new sessions (what `max_queued` bounds)."""

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: K) -> bool:
        return key in self._entries

    def groups(self) -> list[Hashable]:
        """The groups with requests waiting."""
        return list(self._lanes)

    def refuses(self, started: bool) -> bool:
        """Whether a request is refused at once (429 `queue_full`): `¬started ∧ new_waiting ≥
        max_queued`."""
        return not started and self.new_waiting >= self.settings.max_queued

    def add(
        self,
        key: K,
        now: float,
        *,
        started: bool,
        attained: int = 0,
        group: Hashable = None,
    ) -> Queued[K]:
        """Queue the request `key` at `now` (not refused: the caller asked `refuses`)."""
        self.remove(key)
        self._seq += 1
        e = Queued(key, group, now, self._seq, started, attained)
        lane = self._lanes.get(group)
        if lane is None:
            lane = self._lanes[group] = _lane()
        if started:
            lane.fifo.append(e)
            heapq.heappush(lane.las, (attained, e.seq, e))
        else:
            lane.new.append(e)
            self.new_waiting += 1
        lane.live += 1
        self._entries[key] = e
        return e

    def remove(self, key: K) -> Queued[K] | None:
        """Take `key` out (its client went away); None when it is not queued."""
        e = self._entries.pop(key, None)
        if e is not None:
            self._drop(e)
        return e

    def timed_out(self, now: float) -> list[Queued[K]]:
        """Take out and return the requests `timed_out` at `now`, oldest first per group."""
        limit = now - self.settings.max_queue_wait_s
        out: list[Queued[K]] = []
        for lane in list(self._lanes.values()):
            new = lane.new
            while new and (new[0].queued_at < limit or not new[0].live):
                e = new.popleft()
                if e.live:
                    del self._entries[e.key]
                    self._drop(e)
                    out.append(e)
        return out

    def next(
        self,
        now: float,
        room: Callable[[Hashable, bool], bool],
        full: Callable[[], bool],
        attained: Callable[[K], int] | None = None,
    ) -> Queued[K] | None:
        """Take out and return the request that goes now: the first in `release_order` for
        which `room(group, ¬needs_programs_room)` holds; None when none may go.
        `room(group, True)` (KV headroom) must hold wherever `room(group, False)` (room for
        programs too) does; `full`: `cluster_full`, asked only where an aged request's room
        depends on it; `attained`: a session's attained service now (default: as queued)."""
        best: Queued[K] | None = None
        best_key: tuple[int, int, int] | None = None
        for group, lane in list(self._lanes.items()):
            if not room(group, True):
                continue
            found = self._first(lane, now, room(group, False), full, attained)
            if found is not None and (best_key is None or found[0] < best_key):
                best_key, best = found
        if best is not None:
            del self._entries[best.key]
            self._drop(best)
        return best

    def _first(
        self,
        lane: _Lane[K],
        now: float,
        programs_room: bool,
        full: Callable[[], bool],
        attained: Callable[[K], int] | None,
    ) -> tuple[tuple[int, int, int], Queued[K]] | None:
        """The first of `lane`'s requests in release order that may go, with its key: any
        while there is room for programs, else the first that `needs_programs_room` not."""
        s = self.settings
        aged = now - s.aging_s
        fifo = lane.fifo
        while fifo and not fifo[0].live:
            fifo.popleft()
        head = fifo[0] if fifo else None
        if programs_room:
            if head is not None and head.queued_at <= aged:
                return (0, 0, head.seq), head
            e = self._least_served(lane, attained)
            if e is not None:
                return (1, e.attained, e.seq), e
            new = lane.new
            while new and not new[0].live:
                new.popleft()
            return ((2, 0, new[0].seq), new[0]) if new else None
        # KV headroom only: the first that needs no room for programs (needs_programs_room
        # over the lane's orders): the oldest started one, aged below the knee or past the
        # wait bound; else (max_queue_wait_s < aging_s) the least served past the bound
        if head is None:
            return None
        bound = now - s.max_queue_wait_s
        if head.queued_at <= aged:
            if head.queued_at <= bound or not full():
                return (0, 0, head.seq), head
            return None  # none younger is past the bound, nor aged below the knee
        pick: Queued[K] | None = None
        pick_key = (0, 0)
        for e in fifo:
            if e.queued_at > bound:
                break
            if e.live:
                k = (self._attained(e, attained), e.seq)
                if pick is None or k < pick_key:
                    pick, pick_key = e, k
        if pick is None:
            return None
        return (1, pick_key[0], pick_key[1]), pick

    @staticmethod
    def _attained(e: Queued[K], attained: Callable[[K], int] | None) -> int:
        if attained is not None:
            e.attained = attained(e.key)
        return e.attained

    @staticmethod
    def _least_served(lane: _Lane[K], attained: Callable[[K], int] | None) -> Queued[K] | None:
        """The live started request of least attained service (then oldest), its heap entry
        re-keyed where its session's service grew since it was pushed."""
        las = lane.las
        while las:
            a, seq, e = las[0]
            if not e.live:
                heapq.heappop(las)
                continue
            if attained is not None:
                now_a = attained(e.key)
                if now_a != a:
                    e.attained = now_a
                    heapq.heapreplace(las, (now_a, seq, e))
                    continue
            return e
        return None

    def _drop(self, e: Queued[K]) -> None:
        e.live = False
        lane = self._lanes[e.group]
        lane.live -= 1
        if not e.started:
            self.new_waiting -= 1
        if not lane.live:
            del self._lanes[e.group]


def release_order(
    queued: Iterable[Queued[K]], now: float, aging_s: float, attained: Callable[[K], int]
) -> list[Queued[K]]:
    """`queued` sorted by `release_key` (the order `AdmissionQueue.next` takes them in where
    every one has room)."""
    return sorted(
        queued,
        key=lambda e: release_key(e.started, e.queued_at, attained(e.key), e.seq, now, aging_s),
    )
