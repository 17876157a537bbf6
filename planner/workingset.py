"""Sessions' KV working sets per worker (KV pressure): the KV the router expects to be reused soon
— a session with a request in flight, or inside a tool gap predicted short — counted on the
worker that holds it, and the predicted tool gaps that decide how long an idle session is kept.

Pure logic: the router and the simulator feed it their events with their own clock; the planner
reads `tokens(worker)` (`WorkerView.ws_tokens`) and a session's own share (`home`) to price
the reusable KV a placement displaces (`planner/README.md`, *W_disp*)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RetentionConfig:
    """How long an idle session's KV is kept in its worker's working set (Continuum/CacheTTL's
    rule, simplified: keep through a gap that is short against its reload, drop it otherwise).

    A session whose answer ended is kept for `factor` × its predicted gap (at least
    `prior_gap_s`), when that prediction is at most `max_gap_s`; a gap predicted longer
    releases the KV at once."""

    prior_gap_s: float = 2.0
    """The predicted gap of a session and tool never seen (Claude Code's turns: p50 ~2 s),
    and the shortest gap a session is kept for."""
    max_gap_s: float = 60.0
    """Gaps predicted longer than this are long: the session's KV is not kept through them."""
    factor: float = 2.0
    """Kept for this many predicted gaps (a gap a little longer than the last keeps the KV)."""
    alpha: float = 0.3
    """Weight of a new gap in the per-session and per-tool moving averages."""
    idle_forget_s: float = 3600.0
    """A session idle this long is forgotten (its gap history too): bounds the table."""
    max_sessions: int = 65_536
    """At most this many sessions are remembered (the least recently active idle one goes
    first; ~0.3 KB each): an hour of idle sessions at a high rate of new ones is millions."""
    max_tools: int = 1_024
    """At most this many tool names' gap averages (the names come from the clients' tool
    calls: any number of distinct ones); the oldest name goes first."""
    return_alpha: float = 0.05
    """Weight of one first answer's outcome (its session came back within `factor` ×
    `prior_gap_s`, or not) in the moving return rate that scales a first answer's keep."""

    def __post_init__(self) -> None:
        if self.prior_gap_s < 0 or self.max_gap_s < 0 or self.factor < 0:
            raise ValueError("retention times and factor must be >= 0")
        if not 0 < self.alpha <= 1 or not 0 < self.return_alpha <= 1:
            raise ValueError("alpha and return_alpha must be in (0, 1]")
        if self.idle_forget_s <= 0:
            raise ValueError("idle_forget_s must be > 0")
        if self.max_sessions < 1 or self.max_tools < 1:
            raise ValueError("max_sessions and max_tools must be >= 1")


@dataclass(slots=True, eq=False)
class _Session:
    worker: str
    seen: float
    tokens: int = 0
    shared: int = 0
    """Of `tokens`: the prefix its spawner counts on the same worker (`WorkingSets.shares`)."""
    inflight: int = 0
    ended_at: float | None = None
    keep_until: float = -1.0
    """Counted while idle until then (when inflight == 0)."""
    gap_s: float | None = None
    """Moving average of the gaps it showed."""
    tool: str | None = None
    """The tool its last answer called."""
    first_end: float | None = None
    """When its first answer ended, until it is known whether it came back within the
    return window (`WorkingSets.return_rate`)."""


class WorkingSets:
    """Per worker, the tokens of KV of the sessions counted in its working set (`tokens`);
    per session, where its KV lives and how much (`home`), and its predicted next gap
    (`predicted_gap_s`)."""

    def __init__(self, config: RetentionConfig | None = None) -> None:
        self.config = config or RetentionConfig()
        self._sessions: dict[str, _Session] = {}
        """Insertion order = least recently active first (a touched session moves to the end)."""
        self._tokens: dict[str, int] = {}
        """Per worker: the tokens of the sessions counted now."""
        self._counts: dict[str, int] = {}
        """Per worker: how many sessions are counted now (those with tokens)."""
        self._tools: dict[str, float] = {}
        """Per tool name: the moving average of the gaps after a call to it."""
        self._expiries: list[tuple[float, str]] = []
        """(keep_until, session) of idle sessions, a heap; stale entries are skipped."""
        self.peak_tokens = 0.0
        """Moving average of the KV a session held when it was released (its last size: agent
        sessions only grow), 0 before any was: what a new session is expected to grow to."""
        self.return_rate = 1.0
        """Moving average (weight `return_alpha`) over first answers of whether their session
        sent its next request within the return window, `factor` × `prior_gap_s` (the keep
        of a session with no gap of its own); 1 before any outcome (sessions come back)."""
        self._first_checks: list[tuple[float, str]] = []
        """(end of the return window, session) of first answers not yet back, a heap."""

    # --- events ------------------------------------------------------------------------------

    def started(
        self, session: str, worker: str, tokens: int, now: float, after_tool: str | None = None
    ) -> None:
        """A request of `session` went to `worker` (its KV will live there) with a prompt of
        `tokens`: the session counts there from now, and the gap it ends is learnt (as a gap
        after `after_tool` when the request carries that tool's result)."""
        self._expire(now)
        s = self._touch(session, now)
        if s.first_end is not None:  # back within the return window (`_expire` saw none past)
            s.first_end = None
            self._returned(1.0)
        if s.inflight == 0 and s.ended_at is not None:
            self._learn(s, now - s.ended_at, after_tool or s.tool)
        self._uncount(s)
        s.worker = worker
        s.tokens = max(tokens, 0)
        s.shared = 0
        s.inflight += 1
        s.ended_at = None
        self._count(s)

    def moved(self, session: str, worker: str, tokens: int) -> None:
        """A request of `session` in flight continues on `worker` (the worker streaming its
        answer failed mid-stream), its KV `tokens` there now: the session counts there from
        now. No gap ended, so nothing is learnt; nothing if it has nothing in flight."""
        s = self._sessions.get(session)
        if s is None or s.inflight == 0:
            return
        self._uncount(s)
        s.worker = worker
        s.tokens = max(tokens, 0)
        s.shared = 0
        self._count(s)

    def shares(self, session: str, spawner: str, tokens: int) -> None:
        """The request `started` just now has a prompt whose first `tokens` are a prefix that
        session `spawner` holds: while that one is counted on the same worker the engine keeps
        those blocks once, so they count once, with the spawner (else they count here)."""
        s = self._sessions.get(session)
        other = self._sessions.get(spawner)
        if s is None or other is None or other.worker != s.worker or not self._counted(other):
            return
        self._uncount(s)
        s.shared = max(min(tokens, s.tokens, other.tokens), 0)
        self._count(s)

    def ended(self, session: str, tokens: int, now: float, tool: str | None = None) -> None:
        """A request of `session` ended with `tokens` of KV (prompt and output) on its worker;
        `tool`: the tool its answer called (a tool gap follows), if any. With nothing else in
        flight the session stays counted while its predicted gap is short (`keep_s`)."""
        s = self._sessions.get(session)
        if s is None or s.inflight == 0:
            return
        self._uncount(s)
        s.tokens = max(tokens, s.tokens)
        s.inflight -= 1
        s.seen = now
        if s.inflight:
            self._count(s)
            return
        s.ended_at = now
        s.tool = tool
        if s.gap_s is None and s.first_end is None:  # its first answer: will it come back?
            s.first_end = now
            heapq.heappush(self._first_checks, (now + self._return_window(), session))
        keep = self.keep_s(session)
        s.keep_until = now + keep
        if s.keep_until > now:  # a keep too short to move the clock keeps nothing
            self._count(s)
            heapq.heappush(self._expiries, (s.keep_until, session))
        else:
            self._released(s)

    def failed(self, session: str, now: float) -> None:
        """A request of `session` failed (refused, or cut before its answer): its in-flight
        count goes; with nothing else in flight the session is released, not kept, since
        what its worker holds of it is unknown (a refused prompt's KV was never there)."""
        s = self._sessions.get(session)
        if s is None or s.inflight == 0:
            return
        self._uncount(s)
        s.inflight -= 1
        s.seen = now
        if s.inflight:
            self._count(s)
            return
        s.ended_at = s.keep_until = now

    def release(self, session: str, now: float) -> None:
        """Stop counting idle `session` (nothing in flight) before its keep time is over: the
        router paused it at its tool boundary, so its KV may go. Nothing if it is in flight
        or not counted."""
        self._expire(now)
        s = self._sessions.get(session)
        if s is None or s.inflight or not self._counted(s):
            return
        self._uncount(s)
        s.keep_until = s.ended_at if s.ended_at is not None else -1.0

    def forget_worker(self, worker: str) -> None:
        """`worker` left: the sessions whose KV lived there hold none now."""
        for s in self._sessions.values():
            if s.worker == worker:
                s.tokens = s.shared = 0
        self._tokens.pop(worker, None)
        self._counts.pop(worker, None)

    # --- what the planner reads --------------------------------------------------------------

    def tokens(self, worker: str, now: float) -> int:
        """The tokens of KV counted in `worker`'s working set at `now`."""
        self._expire(now)
        return self._tokens.get(worker, 0)

    def sessions(self, worker: str, now: float) -> int:
        """How many sessions' KV `tokens` counts on `worker` at `now`."""
        self._expire(now)
        return self._counts.get(worker, 0)

    def home(self, session: str | None, now: float) -> tuple[str | None, int]:
        """(worker, tokens) of `session`'s own KV counted in a working set now, (None, 0) when
        it is counted nowhere."""
        if session is None:
            return None, 0
        self._expire(now)
        s = self._sessions.get(session)
        if s is None or not self._counted(s):
            return None, 0
        return s.worker, s.tokens

    def largest(self, n: int, now: float) -> list[tuple[str, str, int]]:
        """The `n` sessions holding the most KV counted in a working set at `now`, largest
        first: (session, worker, tokens counted there, less a spawner's shared prefix). One
        pass over the sessions remembered (`max_sessions` at most): for the admin API."""
        self._expire(now)
        counted = (
            (s.tokens - s.shared, sid, s.worker)
            for sid, s in self._sessions.items()
            if s.tokens and s.worker and self._counted(s)
        )
        return [(sid, w, t) for t, sid, w in heapq.nlargest(n, counted)]

    def growth(self, tokens: int) -> int:
        """Tokens a session now needing `tokens` is expected to grow by: up to the average
        size sessions had when released (`peak_tokens`), 0 past it or before any was."""
        g = int(self.peak_tokens) - tokens
        return g if g > 0 else 0

    def predicted_gap_s(self, session: str) -> float:
        """The gap predicted after `session`'s last answer: after a tool call, the tool's
        average when it has one; else the session's own average; else `prior_gap_s`."""
        s = self._sessions.get(session)
        if s is None:
            return self.config.prior_gap_s
        if s.tool is not None:
            t = self._tools.get(s.tool)
            if t is not None:
                return t
        return s.gap_s if s.gap_s is not None else self.config.prior_gap_s

    def keep_s(self, session: str) -> float:
        """How long `session`'s KV stays counted after its answer: `factor` × the predicted
        gap, taken no shorter than `prior_gap_s` (gaps are heavy-tailed: a session whose last
        few gaps were 10 ms still often pauses for a second or two), or 0 when that gap is
        longer than `max_gap_s`. A session that has shown no gap of its own (after its first
        answer) is kept that long × `return_rate`: where sessions are single requests (a
        chat or completion trace) nothing comes back and their KV is not held for them."""
        gap = self.predicted_gap_s(session)
        cfg = self.config
        if gap > cfg.max_gap_s:
            return 0.0
        keep = cfg.factor * (gap if gap > cfg.prior_gap_s else cfg.prior_gap_s)
        s = self._sessions.get(session)
        if s is None or s.gap_s is None:
            keep *= self.return_rate
        return keep

    def __len__(self) -> int:
        return len(self._sessions)

    # --- internals ---------------------------------------------------------------------------

    def _touch(self, session: str, now: float) -> _Session:
        s = self._sessions.pop(session, None)
        if s is None:
            s = _Session("", now)
        s.seen = now
        self._sessions[session] = s
        # forget the least recently active sessions idle past the horizon (amortised O(1))
        horizon = now - self.config.idle_forget_s
        for sid, old in self._sessions.items():
            if old.seen > horizon or old.inflight:
                break
            self._uncount(old)
            del self._sessions[sid]
            break
        # and past the count bound, the least recently active (a new session adds one, this
        # takes one: the table stays at the bound; sessions in flight are never forgotten)
        if len(self._sessions) > self.config.max_sessions:
            for sid, old in self._sessions.items():
                if not old.inflight and old is not s:
                    self._uncount(old)
                    del self._sessions[sid]
                    break
        return s

    def _return_window(self) -> float:
        """factor × prior_gap_s: a first answer's session that comes back within it counts as
        returned (`return_rate`)."""
        return self.config.factor * self.config.prior_gap_s

    def _returned(self, outcome: float) -> None:
        a = self.config.return_alpha
        self.return_rate = (1 - a) * self.return_rate + a * outcome

    def _learn(self, s: _Session, gap: float, tool: str | None) -> None:
        a = self.config.alpha
        s.gap_s = gap if s.gap_s is None else (1 - a) * s.gap_s + a * gap
        if tool is not None:
            tools = self._tools
            t = tools.pop(tool, None)
            tools[tool] = gap if t is None else (1 - a) * t + a * gap
            if len(tools) > self.config.max_tools:
                del tools[next(iter(tools))]

    @staticmethod
    def _counted(s: _Session) -> bool:
        return s.inflight > 0 or (s.ended_at is not None and s.keep_until > s.ended_at)

    def _count(self, s: _Session) -> None:
        if s.tokens and s.worker:
            self._tokens[s.worker] = self._tokens.get(s.worker, 0) + s.tokens - s.shared
            self._counts[s.worker] = self._counts.get(s.worker, 0) + 1

    def _uncount(self, s: _Session) -> None:
        if s.tokens and s.worker and self._counted(s):
            left = self._tokens.get(s.worker, 0) - (s.tokens - s.shared)
            if left > 0:
                self._tokens[s.worker] = left
            else:
                self._tokens.pop(s.worker, None)
            n = self._counts.get(s.worker, 0) - 1
            if n > 0:
                self._counts[s.worker] = n
            else:
                self._counts.pop(s.worker, None)

    def _expire(self, now: float) -> None:
        """Release the idle sessions whose keep time is over; count the first answers whose
        session did not come back within the return window."""
        checks = self._first_checks
        while checks and checks[0][0] <= now:
            until, sid = heapq.heappop(checks)
            s = self._sessions.get(sid)
            if (
                s is not None
                and s.first_end is not None
                and s.first_end + self._return_window() == until
            ):
                s.first_end = None
                self._returned(0.0)
        heap = self._expiries
        while heap and heap[0][0] <= now:
            until, sid = heapq.heappop(heap)
            s = self._sessions.get(sid)
            if s is None or s.inflight or s.keep_until != until or not self._counted(s):
                continue  # stale: the session ran again, or was forgotten
            self._uncount(s)
            s.keep_until = s.ended_at if s.ended_at is not None else -1.0
            self._released(s)

    def _released(self, s: _Session) -> None:
        """`s` left the working sets: learn its size as a session's expected peak."""
        if s.tokens:
            a = self.config.alpha
            p = self.peak_tokens
            self.peak_tokens = s.tokens if not p else (1 - a) * p + a * s.tokens
