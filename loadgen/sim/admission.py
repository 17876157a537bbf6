"""Program-level gates in front of the simulated cluster: the router's admission queue
(`router/admission.py`, router/README.md *Admission*) for OwnerServe's policies, and
ThunderAgent's program scheduler for its peer model, behind one protocol the engine drives.

The simulator plans a released request at once, so the router's reservations (released, not
yet sent) and scrape lag have no counterpart: a worker's KV usage is what its running sequences
hold (exact), which the engine reports whenever it changes; its programs' working set is the
simulator's `planner.workingset.WorkingSets` over its HBM plus CPU tier, as the router counts
it."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Protocol

from planner.admission import (
    AdmissionQueue,
    AdmissionSettings,
    admits_now,
    cluster_full,
    is_started,
    kv_paused,
    pauses_at_tool_boundary,
    programs_closed,
    resident_on,
)
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


AdmissionConfig = AdmissionSettings
"""`admission.*` of the router's settings, with the router's defaults (the one declaration)."""

_UNCOUNTED = 2
"""The sessions on a worker when they are not counted (`sessions` not given): more than one,
so `programs_closed` goes by the share alone."""


class RouterAdmission:
    """The router's admission (`router/admission.py`, router/README.md *Admission*), its rules
    `planner.admission`'s, on simulated events.

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
    service (none yet), resident on its spawner's KV until it has its own.

    The usage hysteresis is looked at whenever a worker's running KV changes (`started`,
    `ended`: exact, where the router looks at each scrape and request); a session has one
    request at a time, so its attained service is fixed while it waits."""

    tick_s = 0.0

    def __init__(
        self,
        workers: list[str],
        usage: Callable[[str], float],
        config: AdmissionSettings | None = None,
        *,
        programs: Callable[[str, float], float] | None = None,
        sessions: Callable[[str, float], int] | None = None,
        home: Callable[[Hashable, float], str | None] | None = None,
        release: Callable[[Hashable, float], None] | None = None,
    ) -> None:
        self.config = config or AdmissionSettings()
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
        self._known = set(workers)
        self._closed: set[str] = set()
        """Workers closed to programs (program level)."""
        self._queue: AdmissionQueue[Hashable] = AdmissionQueue(self.config)
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
        started = is_started(attained, spawner is not None)
        look = self._home
        own = look(session, now) if look is not None and started else None
        home = resident_on(
            own,
            attained,
            (lambda: look(spawner, now)) if look is not None and spawner is not None else None,
        )
        paused = home is not None and pauses_at_tool_boundary(
            attained,
            lambda: self._share(home, now),
            lambda: self._cluster_full(now),
            self.config,
        )
        if paused:
            # its worker's programs are over the watermark: pause it at this tool boundary
            assert self._release is not None
            self._release(session, now)
            self.paused_total += 1
        elif admits_now(bool(self._queue), home is not None, lambda r: self._room(r, now)):
            return True
        if self._queue.refuses(started):
            self.rejected_full += 1
            self._rejected.append(session)
            return False
        self._queue.add(session, now, started=started, attained=attained)
        self.queued += 1
        return False

    def started(self, session: Hashable, worker: str, tokens: int, now: float) -> None:
        self._update(worker)

    def ended(self, session: Hashable, worker: str, tokens: int, now: float, last: bool) -> None:
        self._update(worker)

    def tick(self, now: float) -> None:
        return None

    def next_release(self, now: float) -> Hashable | None:
        if not self._queue or not self._open:
            return None
        self._expire(now)
        programs_open = self._programs is None or self._any_program_open(now)
        e = self._queue.next(
            now, lambda _group, kv_only: kv_only or programs_open, lambda: self._cluster_full(now)
        )
        if e is None:
            return None
        self.waits_s.append(now - e.queued_at)
        return e.key

    def rejected(self, now: float) -> list[Hashable]:
        self._expire(now)
        out, self._rejected = self._rejected, []
        return out

    def _room(self, resident: bool, now: float) -> bool:
        """`admits_now`'s room: a worker not paused, and for a request not resident one open
        to programs too."""
        if not self._open:
            return False
        return resident or self._programs is None or self._any_program_open(now)

    def _update(self, worker: str) -> None:
        """The worker's running KV changed: look at its usage (`kv_paused`)."""
        if worker not in self._known:
            return
        was = worker not in self._open
        if kv_paused(was, self._usage(worker), self.config) != was:
            if was:
                self._open.add(worker)
            else:
                self._open.discard(worker)

    def _program_open(self, worker: str, now: float) -> bool:
        """Whether `worker` is open to programs now (`programs_closed`, as the router's
        `Admission.closed_to_programs`)."""
        if self._programs is None:
            return True
        sessions = self._sessions(worker, now) if self._sessions is not None else _UNCOUNTED
        closed = worker in self._closed
        if programs_closed(closed, self._programs(worker, now), sessions, self.config):
            if not closed:
                self._closed.add(worker)
            return False
        if closed:
            self._closed.discard(worker)
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
        """`cluster_full` over the mean of the workers' shares (the simulator's workers have
        equal pools); looked at once per instant."""
        if self.config.pause_watermark is None:
            return False
        if now == self._full_at:
            return self._full
        self._full_at = now
        assert self._programs is not None
        share = sum(self._programs(w, now) for w in self._workers) / len(self._workers)
        self._full = cluster_full(self._full, share, self.config)
        return self._full

    def _share(self, worker: str | None, now: float) -> float:
        assert self._programs is not None and worker is not None
        return self._programs(worker, now)

    def _any_program_open(self, now: float) -> bool:
        return any(w in self._open and self._program_open(w, now) for w in self._workers)

    def _expire(self, now: float) -> None:
        """Refuse the new sessions' requests `timed_out` at `now`."""
        for e in self._queue.timed_out(now):
            self.rejected_timeout += 1
            self._rejected.append(e.key)


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
