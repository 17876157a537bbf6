"""How often the copies a route makes only for itself are hit again: the reuse rate X_dup
weighs them by.

A fetch's replica (kind `FETCH`: the owned prefix pulled into its prefill worker) and the
prompt a remote prefill's P keeps beside D's copy (kind `PROMPT`) stay in HBM until they are
evicted. When a later request reuses them they served; when nothing does, they only took
room. Per kind, the share of copied blocks a later plan reuses on that worker within
`horizon_s` is learnt by an EWMA over the blocks, one sample per copied block once decided:

    u_k ← (1 − α)·u_k + α·[a plan reused the copy on its worker within horizon_s]

(1 before any sample: copies are priced as if reused until the traffic says otherwise). A
copy is decided, for all its blocks, at the first plan that reuses it (1: any of its blocks,
so its first, caches being prefix-closed) or when the horizon passes (0); a copy starting
at a block still followed on that worker is the same copy. The planner reads u_k through
`RequestView.fetch_reuse` / `prompt_reuse` (`planner.cost.reuse_weight`, planner/README.md).

`CopyReuse.observe` takes a plan and the view it was made on (`hits`: what it reuses from a
worker's HBM, `copies`: what it copies): the router (`router.stages.plan`) and the
simulator feed every plan through it, so both learn the same rate from the same outcomes.
In-memory state, no I/O, not thread-safe (one event loop).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from planner.types import Action, ClusterView, Plan, RequestView, Tier


class CopyKind(StrEnum):
    FETCH = "fetch"
    """The replica an artifact fetch puts on its prefill worker (the owned prefix it pulls)."""
    PROMPT = "prompt"
    """The prompt a remote prefill's P computed and keeps beside D's copy (prompt_copy(r))."""


@dataclass(frozen=True, slots=True)
class CopyReuseConfig:
    """α (`alpha`): the weight of one block's outcome; `horizon_s`: how long a copied block
    may wait for its first hit and still count as reused; `max_tracked`: the most copies
    followed at once (past it the oldest are decided as not reused)."""

    alpha: float = 0.01
    horizon_s: float = 5.0
    max_tracked: int = 1 << 16

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError("copy reuse: alpha must be in (0, 1]")
        if self.horizon_s <= 0 or self.max_tracked < 1:
            raise ValueError("copy reuse: horizon_s must be > 0 and max_tracked >= 1")


class _Copy(NamedTuple):
    kind: CopyKind
    at: float
    """When it was made."""
    start: int
    """Its first block's index in the chain."""
    blocks: int


class CopyReuse:
    """Per `CopyKind`, the share of copied blocks hit within `horizon_s` (`rate`). A copy is
    followed as one entry, its first block: caches are prefix-closed, so a later plan that
    reuses any of its blocks on its worker reuses the first; its outcome counts once per
    block (n samples of the same outcome: u ← u + (1 − (1 − α)ⁿ)·(x − u)). A plan costs a
    look at the copies followed on the workers it names, not a pass over its chain."""

    __slots__ = ("_by_worker", "_rate", "_tracked", "config", "samples")

    def __init__(self, config: CopyReuseConfig | None = None) -> None:
        self.config = config or CopyReuseConfig()
        self._rate: dict[CopyKind, float] = {k: 1.0 for k in CopyKind}
        self._tracked: dict[tuple[str, Hashable], _Copy] = {}
        """(worker, first block) → the undecided copy, oldest first."""
        self._by_worker: dict[str, set[Hashable]] = {}
        """worker → the first blocks of its undecided copies."""
        self.samples: dict[CopyKind, int] = {k: 0 for k in CopyKind}
        """Copied blocks decided, per kind."""

    def rate(self, kind: CopyKind, now: float) -> float:
        """u_k at `now`: the share of `kind`'s copied blocks hit within the horizon (1 before
        any was decided)."""
        self._expire(now)
        return self._rate[kind]

    def tracked(self) -> int:
        """Copied blocks not yet decided."""
        return sum(c.blocks for c in self._tracked.values())

    def _decide(self, key: tuple[str, Hashable], copy: _Copy, hit: float) -> None:
        worker, first = key
        held = self._by_worker[worker]
        held.discard(first)
        if not held:
            del self._by_worker[worker]
        keep = (1.0 - self.config.alpha) ** copy.blocks
        rate = self._rate[copy.kind]
        self._rate[copy.kind] = hit + keep * (rate - hit)
        self.samples[copy.kind] += copy.blocks

    def _expire(self, now: float) -> None:
        """Decide as not reused (0) the copies older than the horizon, and the oldest past
        `max_tracked` copies."""
        tracked = self._tracked
        if not tracked:
            return
        cutoff = now - self.config.horizon_s
        over = len(tracked) - self.config.max_tracked
        while tracked:
            key = next(iter(tracked))
            copy = tracked[key]
            if copy.at > cutoff and over <= 0:
                break
            del tracked[key]
            over -= 1
            self._decide(key, copy, 0.0)

    def copied(
        self,
        worker: str,
        chain: Sequence[Hashable],
        start: int,
        end: int,
        kind: CopyKind,
        now: float,
    ) -> None:
        """`worker` holds a copy of `chain[start:end]` of `kind` from `now` (undecided until a
        plan reuses it or the horizon passes; a copy starting at a block still followed there
        is that copy)."""
        if end <= start:
            return
        key = (worker, chain[start])
        if key not in self._tracked:
            self._tracked[key] = _Copy(kind, now, start, end - start)
            self._by_worker.setdefault(worker, set()).add(chain[start])
        self._expire(now)

    def hit(self, worker: str, chain: Sequence[Hashable], blocks: int, now: float) -> None:
        """A plan reused the first `blocks` blocks of `chain` from `worker`'s HBM at `now`:
        each copy there among them still undecided served (1)."""
        self._expire(now)
        firsts = self._by_worker.get(worker)
        if not firsts:
            return
        tracked = self._tracked
        for first in list(firsts):
            key = (worker, first)
            copy = tracked[key]
            if copy.start < blocks and chain[copy.start] == first:
                del tracked[key]
                self._decide(key, copy, 1.0)

    def observe(self, plan: Plan, request: RequestView, view: ClusterView, now: float) -> None:
        """A plan for `request` was made on `view` at `now`: the copies it reuses served
        (`hits`), and those it makes are followed (`copies`). The router calls it for every
        plan it runs, the simulator likewise."""
        chain = request.chain
        for worker, blocks in hits(plan, request, view):
            self.hit(worker, chain, blocks, now)
        for worker, start, end, kind in copies(plan, request, view):
            self.copied(worker, chain, start, end, kind, now)


def _gpu(view: ClusterView, worker: str) -> int:
    w = view.by_id(worker)
    if w is None or not w.cached_blocks:
        return 0
    return w.cached_blocks.get(Tier.GPU, 0)


def copies(
    plan: Plan, request: RequestView, view: ClusterView
) -> list[tuple[str, int, int, CopyKind]]:
    """The copies `plan` makes of `request`'s chain that X_dup weighs by their reuse, from the
    view it was planned on: a fetch's replica on its prefill worker P, the owned prefix's
    blocks past what P held in HBM (`FETCH`); a remote prefill's prompt kept on P, its
    blocks past the owned prefix and past what P held (`PROMPT`). (worker, start, end, kind)
    each, the copy being `chain[start:end]`; none without a chain."""
    chain = request.chain
    if not chain:
        return []
    c = plan.chosen
    p = c.prefill_worker
    ob = request.owner_blocks if request.owner is not None else 0
    out: list[tuple[str, int, int, CopyKind]] = []
    if c.action is Action.ARTIFACT_FETCH:
        g = _gpu(view, p)
        if p != request.owner and ob > g:
            out.append((p, g, ob, CopyKind.FETCH))
    elif c.action is Action.REMOTE_PREFILL and p != c.decode_worker:
        lo = max(ob, _gpu(view, p))
        if lo < len(chain):
            out.append((p, lo, len(chain), CopyKind.PROMPT))
    return out


def hits(plan: Plan, request: RequestView, view: ClusterView) -> list[tuple[str, int]]:
    """What `plan` reuses of `request`'s chain from a worker's HBM, from the view it was
    planned on: what its prefill worker holds there, what a fetch's or migration's source
    sends from there, and what a remote prefill's D holds there: (worker, blocks of the
    chain's front) each; none without a chain."""
    chain = request.chain
    if not chain:
        return []
    c = plan.chosen
    out: list[tuple[str, int]] = []
    workers = [c.prefill_worker]
    if c.source_worker is not None:
        workers.append(c.source_worker)
    if c.decode_worker != c.prefill_worker:
        workers.append(c.decode_worker)
    for w in dict.fromkeys(workers):
        g = _gpu(view, w)
        if g:
            out.append((w, g))
    return out
