"""ThunderAgent's program scheduler on top of Dynamo's KV routing: whole agent programs
(sessions) are paused at tool boundaries when a worker's KV working set fills, and resumed with
hysteresis, smallest first.

Sources: the ThunderAgent paper (Kang et al., 2026, arXiv 2602.13692) and its repository
(ThunderAgent-org/ThunderAgent: `ThunderAgent/scheduler/router.py`, `backend/state.py`), and
its port as Dynamo's `dynamo.thunderagent_router` (docs/components/thunder-agent-scheduler:
`--pause-threshold` 0.95, `--pause-target` 0.80, `--resume-hysteresis` 0.10,
`--scheduler-interval-seconds` 5, `--resume-timeout-seconds` 1800). The rule, as modelled:

- A program is REASONING while a request of it runs, ACTING (in a tool call) between its
  requests, PAUSED when the scheduler took it off its worker. A worker's working set is the
  tokens of its active (REASONING or ACTING) programs, each its last prompt plus output and a
  decode buffer (`buffer_tokens`, the repository's 256), over the worker's KV pool.
- Every `interval_s` the scheduler first resumes, then pauses. *Resume*: paused programs in
  priority order — a request waiting (REASONING) first, then new programs, then ACTING ones;
  smallest first within each — each onto the worker with the most room (best-fit decreasing)
  while that worker stays at or under `pause_threshold − resume_hysteresis` (0.85).
  *Pause*: on each worker at or over `pause_threshold` (0.95), ACTING programs smallest first,
  then REASONING ones smallest first (marked: paused when their request ends, at the tool
  boundary; no running request is cut), until it is at or under `pause_target` (0.80).
- A program's request arriving while it is paused waits for its resume (forced after
  `resume_timeout_s`). A new program goes at once only when nothing waits and some worker has
  room for it (its prompt and buffer); else it waits as a paused new program.
- Requests are routed by Dynamo's KV cost (`DynamoKVPolicy`); the working set follows the
  worker that serves each request. Not modelled: the soft-demote band, the resume priority
  boost, shared-prefix credit in the capacity sum, char-based token estimates (exact here).

`ThunderAgentPolicy` is the routing half (a `Policy`); `ProgramScheduler` the program half,
which a serving loop drives (the simulator: `loadgen.sim`)."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from enum import Enum

from planner.policies.peers.dynamo import DynamoKVPolicy
from planner.types import RequestView, WorkerView


@dataclass(frozen=True, slots=True)
class ThunderAgentConfig:
    """The scheduler's control loop (Dynamo's `dynamo.thunderagent_router` flags)."""

    pause_threshold: float = 0.95
    pause_target: float = 0.80
    resume_hysteresis: float = 0.10
    interval_s: float = 5.0
    resume_timeout_s: float = 1800.0
    buffer_tokens: int = 256
    """Tokens reserved per active program for its decode (the repository's `DECODE_BUFFER`)."""

    def __post_init__(self) -> None:
        if not 0 < self.pause_target <= self.pause_threshold:
            raise ValueError("thunderagent: need 0 < pause_target <= pause_threshold")
        if not 0 <= self.resume_hysteresis < self.pause_threshold:
            raise ValueError("thunderagent: need 0 <= resume_hysteresis < pause_threshold")
        if self.interval_s <= 0 or self.resume_timeout_s <= 0 or self.buffer_tokens < 0:
            raise ValueError("thunderagent: interval and timeout must be > 0, buffer >= 0")

    @property
    def resume_limit(self) -> float:
        """A resume may fill a worker up to this share: pause_threshold − resume_hysteresis."""
        return self.pause_threshold - self.resume_hysteresis


class Status(Enum):
    REASONING = "reasoning"
    ACTING = "acting"


class _Program:
    __slots__ = ("marked", "paused", "paused_at", "status", "steps", "tokens", "waiting", "worker")

    def __init__(self) -> None:
        self.worker: str | None = None
        self.tokens = 0
        self.status = Status.REASONING
        self.paused = False
        self.paused_at = 0.0
        self.waiting = False  # a request of it waits for its resume
        self.marked = False  # REASONING, to be paused when its request ends
        self.steps = 0


class ProgramScheduler:
    """Programs' states and the per-worker working sets they make; `tick` runs the control
    loop, `next_release` hands out the waiting requests it resumed.

    `capacity` maps each worker id to its KV pool in tokens."""

    def __init__(self, capacity: Mapping[str, int], config: ThunderAgentConfig | None = None):
        self.config = config or ThunderAgentConfig()
        self.capacity = dict(capacity)
        self.used: dict[str, int] = dict.fromkeys(self.capacity, 0)
        self._on: dict[str, dict[Hashable, _Program]] = {w: {} for w in self.capacity}
        """Per worker, its active programs (counted in `used`)."""
        self._programs: dict[Hashable, _Program] = {}
        self._paused: dict[Hashable, None] = {}  # insertion-ordered
        self._released: deque[Hashable] = deque()
        self.paused_total = 0
        """Pauses so far (a program paused twice counts twice)."""

    # --- what the serving loop reports -------------------------------------------------------

    def arrive(self, program: Hashable, tokens: int, now: float) -> bool:
        """A request of `program` with a prompt of `tokens` arrived: True when it may go now;
        False when it waits for a resume (`next_release` gives it back)."""
        p = self._programs.get(program)
        if p is None:
            p = self._programs[program] = _Program()
            p.tokens = tokens
            if self._paused or self._roomiest(tokens + self.config.buffer_tokens) is None:
                self._pause(program, p, now)
        if p.paused:
            p.waiting = True
            p.status = Status.REASONING
            return False
        p.status = Status.REASONING
        return True

    def started(self, program: Hashable, worker: str, tokens: int) -> None:
        """The request went to `worker` with a prompt of `tokens`: the program's KV lives
        there now."""
        p = self._programs.get(program)
        if p is None or p.paused:
            return
        self._uncount(program, p)
        p.worker = worker
        p.tokens = tokens
        p.steps += 1
        self._count(program, p)

    def ended(self, program: Hashable, tokens: int, now: float, last: bool) -> None:
        """The request ended with `tokens` of KV (prompt and output): the program is ACTING
        (a tool boundary), paused now when it was marked; `last`: the program is done."""
        p = self._programs.get(program)
        if p is None:
            return
        self._uncount(program, p)
        if last:
            self._paused.pop(program, None)
            del self._programs[program]
            return
        p.tokens = tokens
        p.status = Status.ACTING
        self._count(program, p)
        if p.marked:
            p.marked = False
            self._pause(program, p, now)

    # --- the control loop --------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """One scheduler interval: resume, then pause (the repository's order)."""
        self._resume(now)
        for w in self.capacity:
            if self.share(w) >= self.config.pause_threshold:
                self._pause_until_safe(w, now)

    def next_release(self) -> Hashable | None:
        """A program whose waiting request a resume released, to be sent now; None when none."""
        return self._released.popleft() if self._released else None

    def share(self, worker: str) -> float:
        """The worker's working set over its KV pool."""
        cap = self.capacity[worker]
        return self.used[worker] / cap if cap > 0 else 1.0

    def paused(self) -> list[Hashable]:
        return list(self._paused)

    def status(self, program: Hashable) -> Status | None:
        p = self._programs.get(program)
        return None if p is None else p.status

    def is_paused(self, program: Hashable) -> bool:
        p = self._programs.get(program)
        return p is not None and p.paused

    # --- internals ---------------------------------------------------------------------------

    def _need(self, p: _Program) -> int:
        return p.tokens + self.config.buffer_tokens

    def _count(self, pid: Hashable, p: _Program) -> None:
        on = self._on.get(p.worker) if p.worker is not None else None
        if on is not None and not p.paused:
            self.used[p.worker] += self._need(p)  # type: ignore[index]
            on[pid] = p

    def _uncount(self, pid: Hashable, p: _Program) -> None:
        on = self._on.get(p.worker) if p.worker is not None else None
        if on is not None and on.pop(pid, None) is not None:
            self.used[p.worker] -= self._need(p)  # type: ignore[index]

    def _roomiest(self, need: int) -> str | None:
        """The worker with the most free tokens when `need` fits in them (within its pool)."""
        best, room = None, -1
        for w, cap in self.capacity.items():
            free = cap - self.used[w]
            if free > room:
                best, room = w, free
        return best if best is not None and room >= need else None

    def _pause(self, program: Hashable, p: _Program, now: float) -> None:
        self._uncount(program, p)
        p.paused = True
        p.paused_at = now
        self._paused[program] = None
        self.paused_total += 1

    def _pause_until_safe(self, worker: str, now: float) -> None:
        cfg = self.config
        target = cfg.pause_target * self.capacity[worker]
        mine = [(pid, p) for pid, p in self._on[worker].items() if not p.marked]
        acting = sorted((x for x in mine if x[1].status is Status.ACTING), key=_by_tokens)
        reasoning = sorted((x for x in mine if x[1].status is Status.REASONING), key=_by_tokens)
        marked = 0
        for pid, p in acting:
            if self.used[worker] - marked <= target:
                return
            self._pause(pid, p, now)
        for _, p in reasoning:
            if self.used[worker] - marked <= target:
                return
            p.marked = True  # counted until its request ends, then paused
            marked += self._need(p)

    def _resume(self, now: float) -> None:
        cfg = self.config
        limit = cfg.resume_limit
        # best fit decreasing over the workers' room under the resume limit: a heap of
        # (−room, worker), the roomiest on top
        rooms = [(self.used[w] - limit * cap, w) for w, cap in self.capacity.items()]
        heapq.heapify(rooms)
        timeout = cfg.resume_timeout_s
        groups: tuple[list[tuple[Hashable, _Program]], ...] = ([], [], [])
        for pid in list(self._paused):
            p = self._programs[pid]
            if p.waiting and now - p.paused_at >= timeout and rooms:
                self._place(pid, p, rooms)  # forced: it waited too long
                continue
            groups[0 if p.waiting and p.steps else 1 if not p.steps else 2].append((pid, p))
        for group in groups:
            group.sort(key=_by_tokens)
            for pid, p in group:
                if rooms and -rooms[0][0] >= self._need(p):
                    self._place(pid, p, rooms)
                # else too big for the roomiest worker: smaller ones may still fit

    def _place(self, pid: Hashable, p: _Program, rooms: list[tuple[float, str]]) -> None:
        """Resume `pid` onto the roomiest worker (the top of `rooms`)."""
        neg, worker = rooms[0]
        p.paused = False
        p.worker = worker
        self._count(pid, p)
        heapq.heapreplace(rooms, (neg + self._need(p), worker))
        del self._paused[pid]
        if p.waiting:
            p.waiting = False
            self._released.append(pid)


def _by_tokens(item: tuple[Hashable, _Program]) -> int:
    return item[1].tokens


class ThunderAgentPolicy(DynamoKVPolicy):
    """The routing half: Dynamo's KV cost over the aggregated workers. The program half is a
    `ProgramScheduler` the serving loop runs beside it (`scheduler`)."""

    name = "thunderagent"

    def capacity_blocks(self, w: WorkerView, request: RequestView) -> float:
        """The worker's KV pool in blocks as the worker reports it (`kv_capacity_tokens`, as
        Dynamo's index learns it from the engine), else its profile's HBM: the scheduler's
        working-set shares and the routing's decode load then use the same pool."""
        if w.kv_capacity_tokens:
            return w.kv_capacity_tokens / request.block_size
        return super().capacity_blocks(w, request)

    def scheduler(
        self, capacity: Mapping[str, int], config: ThunderAgentConfig | None = None
    ) -> ProgramScheduler:
        """A program scheduler over workers of `capacity` tokens each (worker id → tokens)."""
        return ProgramScheduler(capacity, config)
