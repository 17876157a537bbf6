"""Program-level gates in front of the simulated cluster: the router's admission queue
(`router/admission.py`, router/README.md *Admission*) for OwnerServe's policies, and
ThunderAgent's program scheduler for its peer model, behind one protocol the engine drives.

The simulator plans a released request at once, so the router's reservations (released, not
yet sent) and scrape lag have no counterpart: a worker's KV usage is what its running sequences
hold (exact), which the engine reports whenever it changes; its programs' working set is the
simulator's `planner.workingset.WorkingSets` over its HBM plus CPU tier, as the router counts
it."""

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

    def spawned(self, session: Hashable, spawner: Hashable) -> None:
        """`session` (arriving next) is a subagent of `spawner`, a session under way."""
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
    pause_watermark: float | None = None


class RouterAdmission:
    """The router's admission (`router/admission.py`, router/README.md *Admission*).

    Request level: while every decode-capable worker is paused (the KV its running requests
    hold, `usage`, reached `high_watermark`, and not yet back under `low_watermark`), requests
    wait. Program level, when `programs` and `home` are given (the sessions' working sets,
    `planner.workingset`, as shares of each worker's pool, and the worker a session's KV is
    counted on): a worker whose programs reach `high_watermark` is closed to programs until
    they are back under `low_watermark`; a new session (no attained service yet) starts only
    while some worker is open to programs; a started session resumes after its KV was released
    the same way (or once it has waited `max_queue_wait_s`); a session whose KV is counted on a
    closed worker is paused at its tool boundary — its request waits and its KV is released
    (`release`), so the programs that run keep theirs.

    Order: started sessions first — those waiting `aging_s` or longer oldest first, then least
    attained service — then new sessions, first come first served; below the knee (the
    programs under `pause_watermark` of the cluster) a started session's request waiting
    `aging_s` needs only KV headroom; a new session's does not age. Only new sessions are
    refused (429): past `max_queued` new ones waiting, or after `max_queue_wait_s`. A session
    spawned by one under way (`spawned`: a subagent) is a started one, with its own attained
    service (none yet), resident on its spawner's KV until it has its own."""

    tick_s = 0.0

    def __init__(
        self,
        workers: list[str],
        usage: Callable[[str], float],
        config: AdmissionConfig | None = None,
        *,
        programs: Callable[[str, float], float] | None = None,
        sessions: Callable[[str, float], int] | None = None,
        home: Callable[[Hashable, float], str | None] | None = None,
        release: Callable[[Hashable, float], None] | None = None,
    ) -> None:
        self.config = config or AdmissionConfig()
        self._usage = usage
        self._programs = programs
        self._sessions = sessions
        self._home = home
        self._release = release
        if programs is not None:
            self.tick_s = 0.5  # idle sessions' KV leaves the working sets with time
        self._open: set[str] = set(workers)
        """Workers not paused."""
        self._workers = list(workers)
        self._closed: set[str] = set()
        """Workers closed to programs (program level)."""
        self._waiting: dict[Hashable, tuple[int, float, bool]] = {}
        """session -> (seq, queued_at, started)."""
        self._fifo: deque[tuple[float, int, Hashable]] = deque()  # started, arrival order
        self._las: list[tuple[int, int, Hashable]] = []  # started: (attained, seq, session)
        self._new: deque[tuple[float, int, Hashable]] = deque()  # new sessions
        self._new_waiting = 0
        self._seq = 0
        self._rejected: list[Hashable] = []
        self._spawners: dict[Hashable, Hashable] = {}
        """Subagents about to arrive -> the session under way that spawned them."""
        self.queued = 0
        """Requests that waited."""
        self.waits_s: list[float] = []
        self.rejected_full = 0
        self.rejected_timeout = 0
        self.paused_total = 0
        self._full = False
        self._full_at = -1.0

    @property
    def programs_paused(self) -> int:
        return self.paused_total

    def spawned(self, session: Hashable, spawner: Hashable) -> None:
        self._spawners[session] = spawner

    def arrive(self, session: Hashable, tokens: int, attained: int, now: float) -> bool:
        self._expire(now)
        spawner = self._spawners.pop(session, None) if not attained else None
        started = attained > 0 or spawner is not None
        home = self._home(session, now) if self._home is not None and started else None
        if home is None and spawner is not None and self._home is not None:
            home = self._home(spawner, now)  # a subagent starts on its spawner's KV
        if home is not None and attained > 0 and self._over(home, now) and self._cluster_full(now):
            # its worker's programs are over the watermark: pause it at this tool boundary
            assert self._release is not None
            self._release(session, now)
            self.paused_total += 1
        elif not self._waiting and self._open:
            if home is not None or self._programs is None or self._any_program_open(now):
                return True
        elif home is not None and self._open:
            return True  # its KV is in a working set on an open worker: it runs on
        if not started and self._new_waiting >= self.config.max_queued:
            self.rejected_full += 1
            self._rejected.append(session)
            return False
        seq = self._seq = self._seq + 1
        self._waiting[session] = (seq, now, started)
        if started:
            self._fifo.append((now, seq, session))
            # a queued session has nothing in flight: its attained service is fixed while it waits
            heapq.heappush(self._las, (attained, seq, session))
        else:
            self._new.append((now, seq, session))
            self._new_waiting += 1
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
        waiting = self._waiting
        fifo = self._fifo
        while fifo and waiting.get(fifo[0][2], (None,))[0] != fifo[0][1]:
            fifo.popleft()  # released through the other order
        programs_open = self._programs is None or self._any_program_open(now)
        aged = now - self.config.aging_s
        session: Hashable | None = None
        if (
            fifo
            and fifo[0][0] <= aged
            and (
                programs_open
                or fifo[0][0] <= now - self.config.max_queue_wait_s
                or not self._cluster_full(now)
            )
        ):
            session = fifo.popleft()[2]
        elif programs_open:
            las = self._las
            while las:
                _, seq, s = heapq.heappop(las)
                if waiting.get(s, (None,))[0] == seq:
                    session = s
                    break
            else:
                session = self._pop_new()
        if session is None:
            return None
        _, queued_at, _ = waiting.pop(session)
        self.waits_s.append(now - queued_at)
        return session

    def _pop_new(self) -> Hashable | None:
        """The first new session still waiting, taken out of the new sessions' queue."""
        new, waiting = self._new, self._waiting
        while new:
            _, seq, s = new.popleft()
            if waiting.get(s, (None,))[0] == seq:
                self._new_waiting -= 1
                return s
        return None

    def rejected(self, now: float) -> list[Hashable]:
        self._expire(now)
        out, self._rejected = self._rejected, []
        return out

    def _update(self, worker: str) -> None:
        """The worker's running KV changed: pause it at the high watermark, open it again
        below the low one."""
        if worker not in self._workers:
            return
        u = self._usage(worker)
        if worker in self._open:
            if u >= self.config.high_watermark:
                self._open.discard(worker)
        elif u < self.config.low_watermark:
            self._open.add(worker)

    def _program_open(self, worker: str, now: float) -> bool:
        """Whether `worker` is open to programs: closed when its working set reaches the high
        watermark, open again below the low one; never closed while it holds one session (or
        none), as the router's `Admission._closed`."""
        if self._programs is None:
            return True
        if self._sessions is not None and self._sessions(worker, now) <= 1:
            self._closed.discard(worker)
            return True
        share = self._programs(worker, now)
        if worker in self._closed:
            if share >= self.config.low_watermark:
                return False
            self._closed.discard(worker)
            return True
        if share >= self.config.high_watermark:
            self._closed.add(worker)
            return False
        return True

    def closed_to_programs(self, worker: str, now: float) -> bool:
        """Whether `worker` is closed to programs now (`WorkerView.programs_closed`): only
        while the programs fill the whole cluster, as the router's `cluster_full`."""
        return (
            self._programs is not None
            and self._cluster_full(now)
            and not self._program_open(worker, now)
        )

    def _cluster_full(self, now: float) -> bool:
        """Whether the programs fill the cluster (the mean of the workers' shares; the
        simulator's workers have equal pools) at `pause_watermark`, until back under it by
        high − low; looked at once per instant."""
        on = self.config.pause_watermark
        if on is None:
            return False
        if now == self._full_at:
            return self._full
        self._full_at = now
        assert self._programs is not None
        share = sum(self._programs(w, now) for w in self._workers) / len(self._workers)
        cfg = self.config
        self._full = share >= (on - (cfg.high_watermark - cfg.low_watermark) if self._full else on)
        return self._full

    def _over(self, worker: str, now: float) -> bool:
        """Whether `worker`'s programs are at or over the high watermark now (pausing brings
        them just under it; the low watermark is for letting programs in again)."""
        assert self._programs is not None
        return self._programs(worker, now) >= self.config.high_watermark

    def _any_program_open(self, now: float) -> bool:
        return any(w in self._open and self._program_open(w, now) for w in self._workers)

    def _expire(self, now: float) -> None:
        """Refuse the new sessions' requests queued longer than `max_queue_wait_s`."""
        new, waiting = self._new, self._waiting
        limit = now - self.config.max_queue_wait_s
        while new and new[0][0] < limit:
            _, seq, session = new.popleft()
            if waiting.get(session, (None,))[0] == seq:
                del waiting[session]
                self._new_waiting -= 1
                self.rejected_timeout += 1
                self._rejected.append(session)


class ThunderAgentGate:
    """ThunderAgent's program scheduler (`planner.policies.peers.thunderagent`) as a gate: its
    control loop runs every `interval_s` of simulated time.

    ThunderAgent takes one program id a request. By default each session is a program of its
    own, a subagent too. With `tree`, a subagent's requests carry its root session's program
    id, as a client that labels the whole agent tree as one program would send them: they run
    while that program is active, and the program ends when its last session does."""

    def __init__(self, scheduler: ProgramScheduler, *, tree: bool = False) -> None:
        self.scheduler = scheduler
        self.tick_s = scheduler.config.interval_s
        self.tree = tree
        self._since: dict[Hashable, float] = {}
        self._program: dict[Hashable, Hashable] = {}
        """A subagent -> the program id it sends (its root session's), with `tree`."""
        self._members: dict[Hashable, int] = {}
        """A program with subagents -> its sessions not yet done."""
        self._held: dict[Hashable, list[Hashable]] = {}
        """A program -> its sessions whose request waits for its resume."""
        self._resumed: list[Hashable] = []
        self.queued = 0
        self.waits_s: list[float] = []

    @property
    def programs_paused(self) -> int:
        return self.scheduler.paused_total

    def spawned(self, session: Hashable, spawner: Hashable) -> None:
        if self.tree:
            root = self._program.get(spawner, spawner)
            self._program[session] = root
            self._members[root] = self._members.get(root, 1) + 1

    def arrive(self, session: Hashable, tokens: int, attained: int, now: float) -> bool:
        program = self._program.get(session, session)
        if self.scheduler.arrive(program, tokens, now):
            return True
        self._held.setdefault(program, []).append(session)
        self._since[session] = now
        self.queued += 1
        return False

    def started(self, session: Hashable, worker: str, tokens: int, now: float) -> None:
        self.scheduler.started(self._program.get(session, session), worker, tokens)

    def ended(self, session: Hashable, worker: str, tokens: int, now: float, last: bool) -> None:
        program = self._program.get(session, session)
        if last and program in self._members:
            left = self._members[program] - 1
            if left:
                self._members[program] = left
                last = False
            else:
                del self._members[program]
        self.scheduler.ended(program, tokens, now, last)

    def tick(self, now: float) -> None:
        self.scheduler.tick(now)

    def next_release(self, now: float) -> Hashable | None:
        while not self._resumed:  # a resumed program lets all its waiting sessions go
            program = self.scheduler.next_release()
            if program is None:
                return None
            self._resumed = self._held.pop(program, [])
        session = self._resumed.pop(0)
        self.waits_s.append(now - self._since.pop(session, now))
        return session

    def rejected(self, now: float) -> list[Hashable]:
        return []
