"""Program-level gates in front of the simulated cluster: the router's admission queue
(`router/admission.py`, router/README.md *Admission*) for OwnerServe's policies, and
ThunderAgent's program scheduler for its peer model, behind one protocol the engine drives.

The simulator plans a released request at once, so the router's reservations (released, not
yet sent) and scrape lag have no counterpart: a worker's working set is the KV its running
sequences hold (`kv_usage`, exact), which the engine reports whenever it changes."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

from planner.policies.peers.thunderagent import ProgramScheduler


class ProgramGate(Protocol):
    """What the engine asks a gate; sessions are the engine's keys, workers their ids."""

    tick_s: float
    """How often `tick` runs (0: never; the gate then releases on `ended` alone)."""
    queued: int
    """Requests that waited."""
    waits_s: list[float]
    """How long each released request waited."""

    @property
    def programs_paused(self) -> int:
        """Programs (sessions) the gate paused so far."""
        ...

    def arrive(self, session: Hashable, tokens: int, attained: int, now: float) -> bool:
        """A request of `session` (prompt `tokens`; the session's attained service so far)
        arrived: True = send it now; False = it waits (`next_release`) or was refused
        (`rejected`)."""
        ...

    def started(self, session: Hashable, worker: str, tokens: int, now: float) -> None:
        """The request was planned onto decode worker `worker`."""
        ...

    def ended(self, session: Hashable, worker: str, tokens: int, now: float, last: bool) -> None:
        """The request ended on `worker` with `tokens` of KV; `last`: the session is done."""
        ...

    def tick(self, now: float) -> None: ...

    def next_release(self, now: float) -> Hashable | None:
        """A waiting session whose request may go now; None when none may."""
        ...

    def rejected(self, now: float) -> list[Hashable]:
        """Sessions whose waiting request was refused (queue full, waited too long)."""
        ...


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """`admission.*` of the router's settings, with the router's defaults."""

    high_watermark: float = 0.95
    low_watermark: float = 0.80
    max_queued: int = 1024
    max_queue_wait_s: float = 60.0
    aging_s: float = 10.0


class RouterAdmission:
    """The router's admission queue: while every decode-capable worker is paused (its working
    set reached `high_watermark`, and not yet back under `low_watermark`), requests wait; the
    queue releases those queued `aging_s` or longer first, oldest first, then the least
    attained service per session; past `max_queued` or `max_queue_wait_s` a request is
    refused (429).

    `usage(worker)` is the worker's working set as a share of its pool."""

    tick_s = 0.0

    def __init__(
        self,
        workers: list[str],
        usage: Callable[[str], float],
        config: AdmissionConfig | None = None,
    ) -> None:
        self.config = config or AdmissionConfig()
        self._usage = usage
        self._open: set[str] = set(workers)
        """Workers not paused."""
        self._workers = set(workers)
        self._waiting: dict[Hashable, tuple[int, float]] = {}  # session -> (seq, queued_at)
        self._fifo: deque[tuple[float, int, Hashable]] = deque()
        self._las: list[tuple[int, int, Hashable]] = []  # (attained, seq, session), a heap
        self._seq = 0
        self._rejected: list[Hashable] = []
        self.queued = 0
        """Requests that waited."""
        self.waits_s: list[float] = []
        self.rejected_full = 0
        self.rejected_timeout = 0

    @property
    def programs_paused(self) -> int:
        return 0  # it holds requests, not programs

    def arrive(self, session: Hashable, tokens: int, attained: int, now: float) -> bool:
        if not self._waiting and self._open:
            return True
        self._expire(now)
        if len(self._waiting) >= self.config.max_queued:
            self.rejected_full += 1
            self._rejected.append(session)
            return False
        seq = self._seq = self._seq + 1
        self._waiting[session] = (seq, now)
        self._fifo.append((now, seq, session))
        # a queued session has nothing in flight: its attained service is fixed while it waits
        heapq.heappush(self._las, (attained, seq, session))
        self.queued += 1
        return False

    def started(self, session: Hashable, worker: str, tokens: int, now: float) -> None:
        self._update(worker)

    def ended(self, session: Hashable, worker: str, tokens: int, now: float, last: bool) -> None:
        self._update(worker)

    def tick(self, now: float) -> None:
        return None

    def next_release(self, now: float) -> Hashable | None:
        if not self._waiting or not self._open:
            return None
        self._expire(now)
        fifo, waiting = self._fifo, self._waiting
        while fifo and waiting.get(fifo[0][2], (None,))[0] != fifo[0][1]:
            fifo.popleft()  # released through the other order
        if fifo and fifo[0][0] <= now - self.config.aging_s:
            session = fifo.popleft()[2]
        else:
            las = self._las
            while las:
                _, seq, session = heapq.heappop(las)
                if waiting.get(session, (None,))[0] == seq:
                    break
            else:
                return None
        _, queued_at = waiting.pop(session)
        self.waits_s.append(now - queued_at)
        return session

    def rejected(self, now: float) -> list[Hashable]:
        self._expire(now)
        out, self._rejected = self._rejected, []
        return out

    def _update(self, worker: str) -> None:
        """The worker's working set changed: pause it at the high watermark, open it again
        below the low one."""
        if worker not in self._workers:
            return
        u = self._usage(worker)
        if worker in self._open:
            if u >= self.config.high_watermark:
                self._open.discard(worker)
        elif u < self.config.low_watermark:
            self._open.add(worker)

    def _expire(self, now: float) -> None:
        """Refuse the requests queued longer than `max_queue_wait_s` (the oldest first)."""
        fifo, waiting = self._fifo, self._waiting
        limit = now - self.config.max_queue_wait_s
        while fifo and fifo[0][0] < limit:
            _, seq, session = fifo.popleft()
            if waiting.get(session, (None,))[0] == seq:
                del waiting[session]
                self.rejected_timeout += 1
                self._rejected.append(session)


class ThunderAgentGate:
    """ThunderAgent's program scheduler (`planner.policies.peers.thunderagent`) as a gate: its
    control loop runs every `interval_s` of simulated time."""

    def __init__(self, scheduler: ProgramScheduler) -> None:
        self.scheduler = scheduler
        self.tick_s = scheduler.config.interval_s
        self._since: dict[Hashable, float] = {}
        self.queued = 0
        self.waits_s: list[float] = []

    @property
    def programs_paused(self) -> int:
        return self.scheduler.paused_total

    def arrive(self, session: Hashable, tokens: int, attained: int, now: float) -> bool:
        if self.scheduler.arrive(session, tokens, now):
            return True
        self._since[session] = now
        self.queued += 1
        return False

    def started(self, session: Hashable, worker: str, tokens: int, now: float) -> None:
        self.scheduler.started(session, worker, tokens)

    def ended(self, session: Hashable, worker: str, tokens: int, now: float, last: bool) -> None:
        self.scheduler.ended(session, tokens, now, last)

    def tick(self, now: float) -> None:
        self.scheduler.tick(now)

    def next_release(self, now: float) -> Hashable | None:
        session = self.scheduler.next_release()
        if session is not None:
            self.waits_s.append(now - self._since.pop(session, now))
        return session

    def rejected(self, now: float) -> list[Hashable]:
        return []
