"""How often the copies a route makes only for itself are hit again: the reuse rate X_dup
weighs them by.

A fetch's replica (kind `FETCH`: the owned prefix pulled into its prefill worker) and the
prompt a remote prefill's P keeps beside D's copy (kind `PROMPT`) stay in HBM until they are
evicted. When a later request reuses them they served; when nothing does, they only took
room. Per kind, the share of copied blocks a later plan reuses on that worker within
`horizon_s` is learnt by an EWMA over the blocks, one sample per copied block once decided:

    u_k ← (1 − α)·u_k + α·[a plan reused the block on its worker within horizon_s]

(1 before any sample: copies are priced as if reused until the traffic says otherwise). A
block is decided at its first reuse (1) or when the horizon passes (0); a copy made again
while its block is still followed is the same copy. The planner reads u_k through
`RequestView.fetch_reuse` / `prompt_reuse` (`planner.cost.reuse_weight`, planner/README.md).

`CopyReuse.observe` takes a plan and the view it was made on (`hits`: what it reuses from a
worker's HBM, `copies`: what it copies): the router (`router.stages.plan`) and the
simulator feed every plan through it, so both learn the same rate from the same outcomes.
In-memory state, no I/O, not thread-safe (one event loop).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from planner.types import Action, ClusterView, Plan, RequestView, Tier


class CopyKind(StrEnum):
    FETCH = "fetch"
    """The replica an artifact fetch puts on its prefill worker (the owned prefix it pulls)."""
    PROMPT = "prompt"
    """The prompt a remote prefill's P computed and keeps beside D's copy (prompt_copy(r))."""


@dataclass(frozen=True, slots=True)
class CopyReuseConfig:
    """α (`alpha`): the weight of one block's outcome; `horizon_s`: how long a copied block
    may wait for its first hit and still count as reused; `max_tracked`: the most copied
    blocks followed at once (past it the oldest are decided as not reused)."""

    alpha: float = 0.01
    horizon_s: float = 5.0
    max_tracked: int = 1 << 18

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError("copy reuse: alpha must be in (0, 1]")
        if self.horizon_s <= 0 or self.max_tracked < 1:
            raise ValueError("copy reuse: horizon_s must be > 0 and max_tracked >= 1")


class CopyReuse:
    """Per `CopyKind`, the share of copied blocks hit within `horizon_s` (`rate`)."""

    __slots__ = ("_rate", "_tracked", "config", "samples")

    def __init__(self, config: CopyReuseConfig | None = None) -> None:
        self.config = config or CopyReuseConfig()
        self._rate: dict[CopyKind, float] = {k: 1.0 for k in CopyKind}
        self._tracked: dict[tuple[str, Hashable], tuple[CopyKind, float]] = {}
        """(worker, block) → (kind, when copied) of the undecided copies, oldest first."""
        self.samples: dict[CopyKind, int] = {k: 0 for k in CopyKind}

    def rate(self, kind: CopyKind, now: float) -> float:
        """u_k at `now`: the share of `kind`'s copied blocks hit within the horizon (1 before
        any was decided)."""
        self._expire(now)
        return self._rate[kind]

    def tracked(self) -> int:
        """Copied blocks not yet decided."""
        return len(self._tracked)

    def _sample(self, kind: CopyKind, hit: float) -> None:
        self._rate[kind] += self.config.alpha * (hit - self._rate[kind])
        self.samples[kind] += 1

    def _expire(self, now: float) -> None:
        """Decide as not reused (0) the copies older than the horizon, and the oldest past
        `max_tracked`."""
        tracked = self._tracked
        if not tracked:
            return
        cutoff = now - self.config.horizon_s
        over = len(tracked) - self.config.max_tracked
        while tracked:
            key = next(iter(tracked))
            kind, at = tracked[key]
            if at > cutoff and over <= 0:
                break
            del tracked[key]
            over -= 1
            self._sample(kind, 0.0)

    def copied(self, worker: str, blocks: Iterable[Hashable], kind: CopyKind, now: float) -> None:
        """`worker` holds a copy of `blocks` of `kind` from `now` (undecided until hit or past
        the horizon; a block still tracked there is the same copy)."""
        tracked = self._tracked
        for b in blocks:
            key = (worker, b)
            if key not in tracked:
                tracked[key] = (kind, now)
        self._expire(now)

    def hit(self, worker: str, blocks: Iterable[Hashable], now: float) -> None:
        """A request reused `blocks` from `worker`'s HBM at `now`: each copy among them still
        undecided served (1)."""
        self._expire(now)
        tracked = self._tracked
        if not tracked:
            return
        for b in blocks:
            got = tracked.pop((worker, b), None)
            if got is not None:
                self._sample(got[0], 1.0)

    def observe(self, plan: Plan, request: RequestView, view: ClusterView, now: float) -> None:
        """A plan for `request` was made on `view` at `now`: the copies it reuses served
        (`hits`), and those it makes are followed (`copies`). The router calls it for every
        plan it runs, the simulator likewise."""
        for worker, blocks in hits(plan, request, view):
            self.hit(worker, blocks, now)
        for worker, blocks, kind in copies(plan, request, view):
            self.copied(worker, blocks, kind, now)


def _gpu(view: ClusterView, worker: str) -> int:
    w = view.by_id(worker)
    if w is None or not w.cached_blocks:
        return 0
    return w.cached_blocks.get(Tier.GPU, 0)


def copies(
    plan: Plan, request: RequestView, view: ClusterView
) -> list[tuple[str, Sequence[int], CopyKind]]:
    """The copies `plan` makes of `request`'s chain that X_dup weighs by their reuse, from the
    view it was planned on: a fetch's replica on its prefill worker P, the owned prefix's
    blocks past what P held in HBM (`FETCH`); a remote prefill's prompt kept on P, its
    blocks past the owned prefix and past what P held (`PROMPT`). (worker, blocks, kind)
    each, blocks as the chain's hashes; none without a chain."""
    chain = request.chain
    if not chain:
        return []
    c = plan.chosen
    p = c.prefill_worker
    ob = request.owner_blocks if request.owner is not None else 0
    out: list[tuple[str, Sequence[int], CopyKind]] = []
    if c.action is Action.ARTIFACT_FETCH:
        g = _gpu(view, p)
        if p != request.owner and ob > g:
            out.append((p, chain[g:ob], CopyKind.FETCH))
    elif c.action is Action.REMOTE_PREFILL and p != c.decode_worker:
        lo = max(ob, _gpu(view, p))
        if lo < len(chain):
            out.append((p, chain[lo:], CopyKind.PROMPT))
    return out


def hits(plan: Plan, request: RequestView, view: ClusterView) -> list[tuple[str, Sequence[int]]]:
    """The blocks of `request`'s chain `plan` reuses from a worker's HBM, from the view it was
    planned on: what its prefill worker holds there, what a fetch's or migration's source
    sends from there, and what a remote prefill's D holds there (worker, blocks) each."""
    chain = request.chain
    if not chain:
        return []
    c = plan.chosen
    out: list[tuple[str, Sequence[int]]] = []
    workers = [c.prefill_worker]
    if c.source_worker is not None:
        workers.append(c.source_worker)
    if c.decode_worker != c.prefill_worker:
        workers.append(c.decode_worker)
    for w in dict.fromkeys(workers):
        g = _gpu(view, w)
        if g:
            out.append((w, chain[:g]))
    return out
