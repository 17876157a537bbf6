"""Simulator workloads: agent sessions as chains of KV block ids, from a generator or a trace.

A session is a list of turns; each turn's prompt is a chain of block ids (equal ids = shareable
prefix blocks, as in the Mooncake trace), its prompt and output lengths in tokens, and the tool
gap before it. The generator is vectorless and fast so 100,000 sessions build in seconds.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import count
from pathlib import Path

from ownerserve.profiles import TimingProfile


@dataclass(frozen=True, slots=True)
class SimTurn:
    chain: tuple[int, ...]
    input_tokens: int
    output_tokens: int
    gap_s: float


@dataclass(frozen=True, slots=True)
class SimSession:
    session_id: int
    start_s: float
    turns: tuple[SimTurn, ...]
    fork_of: int | None = None
    spawned_at: tuple[int, int] | None = None
    """A subagent's (parent session index, parent turn): it arrives when its parent's turn
    does (`loadgen.workloads.Session.spawned_at`), not at `start_s`."""


@dataclass(frozen=True, slots=True)
class AgenticShape:
    """Parameters of generated coding-agent sessions (token counts)."""

    block_tokens: int = 512
    repo_groups: int = 50
    repo_tokens: tuple[int, int] = (8_000, 32_000)
    system_tokens: int = 2_000
    turns: tuple[int, int] = (3, 10)
    tool_tokens: tuple[int, int] = (200, 6_000)
    long_tool_prob: float = 0.15
    long_tool_tokens: tuple[int, int] = (8_000, 24_000)
    output_tokens: tuple[int, int] = (50, 600)
    tool_gap_s: tuple[float, float] = (0.5, 8.0)
    fork_prob: float = 0.05
    fork_branches: int = 4


def agentic_sessions(
    n_sessions: int, rate_per_s: float, seed: int = 0, shape: AgenticShape | None = None
) -> list[SimSession]:
    """Coding-agent sessions arriving as a Poisson process of `rate_per_s` sessions/s."""
    shape = shape or AgenticShape()
    rng = random.Random(seed)
    bt = shape.block_tokens
    ids = count(1)
    system = tuple(next(ids) for _ in range(shape.system_tokens // bt))
    repos = [
        tuple(next(ids) for _ in range(rng.randint(*shape.repo_tokens) // bt))
        for _ in range(shape.repo_groups)
    ]
    sessions: list[SimSession] = []
    t = 0.0
    sid = 0
    while len(sessions) < n_sessions:
        t += rng.expovariate(rate_per_s)
        chain = system + repos[rng.randrange(len(repos))]
        tail = 0  # tokens past the last full block
        turns: list[SimTurn] = []
        n_turns = rng.randint(*shape.turns)
        for k in range(n_turns):
            if k:
                if rng.random() < shape.long_tool_prob:
                    tool = rng.randint(*shape.long_tool_tokens)
                else:
                    tool = rng.randint(*shape.tool_tokens)
                prev_out = turns[-1].output_tokens
                tail += prev_out + tool
                chain = chain + tuple(next(ids) for _ in range(tail // bt))
                tail %= bt
            out = rng.randint(*shape.output_tokens)
            gap = rng.uniform(*shape.tool_gap_s) if k else 0.0
            turns.append(SimTurn(chain, len(chain) * bt + tail, out, gap))
        sessions.append(SimSession(sid, t, tuple(turns)))
        sid += 1
        if rng.random() < shape.fork_prob and len(sessions) < n_sessions:
            # forked rollout: branches share the first turn's prefix, then diverge
            base = turns[0]
            for _ in range(min(shape.fork_branches, n_sessions - len(sessions))):
                delta = tuple(next(ids) for _ in range(rng.randint(1, 8)))
                branch = SimTurn(
                    base.chain + delta,
                    base.input_tokens + len(delta) * bt,
                    rng.randint(*shape.output_tokens),
                    0.0,
                )
                sessions.append(SimSession(sid, t, (branch,), fork_of=sessions[-1].session_id))
                sid += 1
    return sessions


def trace_sessions(
    path: str | Path,
    *,
    time_scale: float = 1.0,
    limit: int | None = None,
    repeat: int = 1,
    overlay: bool = False,
) -> list[SimSession]:
    """Mooncake-format trace rows as sessions.

    Rows with a `session_id` field group into sessions; otherwise each row is a one-turn session
    (its prefix sharing with other rows is still visible through equal hash ids). `repeat`
    tiles the trace with disjoint id spaces to reach large scales: the copies one after another
    (the trace's rate, `repeat` × its span), or with `overlay` all starting together
    (`repeat` × its rate, its span: the load per worker of one copy on `repeat` times fewer
    workers).
    """
    rows = []
    with Path(path).open() as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        return []
    span = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000.0 + 1.0
    sessions: list[SimSession] = []
    for rep in range(repeat):
        offset = rep * (1 << 40)
        grouped: dict[object, list[dict[str, object]]] = defaultdict(list)
        for i, row in enumerate(rows):
            grouped[row.get("session_id", f"row{i}")].append(row)
        for rows_of in grouped.values():
            first_ts = float(rows_of[0]["timestamp"]) / 1000.0  # type: ignore[arg-type]
            turns = []
            prev_end = first_ts
            for row in rows_of:
                ts = float(row["timestamp"]) / 1000.0  # type: ignore[arg-type]
                chain = tuple(int(h) + offset for h in row["hash_ids"])  # type: ignore[attr-defined]
                turns.append(
                    SimTurn(
                        chain,
                        int(row["input_length"]),  # type: ignore[call-overload]
                        int(row["output_length"]),  # type: ignore[call-overload]
                        max(0.0, ts - prev_end) * time_scale,
                    )
                )
                prev_end = ts
            start = (first_ts + (0 if overlay else rep * span)) * time_scale
            sessions.append(SimSession(len(sessions), start, tuple(turns)))
    sessions.sort(key=lambda s: s.start_s)
    return sessions


def iter_turns(sessions: list[SimSession]) -> Iterator[SimTurn]:
    for s in sessions:
        yield from s.turns


def kv_working_set(
    sessions: list[SimSession], profile: TimingProfile, block_tokens: int
) -> tuple[int, int]:
    """(peak working set, largest session), in KV blocks, as `loadgen.capacity.kv_demand`
    counts them: a session is active from its start for its tool gaps plus its turns'
    uncontended service (prefill of each turn's new tokens, then its decode at batch 1) and
    holds its last prompt's blocks plus its last output; the peak, over session starts, of the
    distinct blocks of the active sessions. A lower bound: queueing keeps sessions longer."""
    bt = block_tokens
    events: list[tuple[float, int, int]] = []
    own: list[int] = []  # per session, the blocks past its chain: tail and last output
    largest = 0
    for i, s in enumerate(sessions):
        busy = 0.0
        prev = 0
        for t in s.turns:
            new = max(0, t.input_tokens - prev)
            busy += t.gap_s + profile.prefill_s(new, t.input_tokens - new)
            busy += t.output_tokens * profile.decode_step_s(1, t.input_tokens)
            prev = t.input_tokens
        last = s.turns[-1]
        extra = -(-(last.input_tokens - len(last.chain) * bt + last.output_tokens) // bt)
        own.append(max(0, extra))
        largest = max(largest, len(last.chain) + own[-1])
        events.append((s.start_s, 1, i))
        events.append((s.start_s + busy, 0, i))
    events.sort()  # at equal times a session ends before another starts
    refs: dict[int, int] = {}
    distinct = extra_total = peak = 0
    for _, starting, i in events:
        last = sessions[i].turns[-1]
        if starting:
            for b in last.chain:
                r = refs.get(b, 0)
                if not r:
                    distinct += 1
                refs[b] = r + 1
            extra_total += own[i]
            peak = max(peak, distinct + extra_total)
        else:
            for b in last.chain:
                r = refs[b] - 1
                if r:
                    refs[b] = r
                else:
                    del refs[b]
                    distinct -= 1
            extra_total -= own[i]
    return peak, largest
