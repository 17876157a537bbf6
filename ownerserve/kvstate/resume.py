"""Where a prefix hit resumes on a hybrid-attention model: the one rule that the emulated engine
follows and that the planner, the simulator and the hits bench predict with.

A cached prefix can be resumed only at a block boundary where every KV cache group can be
restored: the sealed groups (full attention, compressed KV, indexer) hold its blocks, and the
mutable groups (sliding windows, per-sequence state) hold their state at that boundary — only
the boundaries the engine's retention keeps (`ownerserve.kvstate.retention`), as far as its
window pool has not evicted them. At the deepest sealed boundary E held, the windows are
either cached, or rebuilt by recomputing the last n_win·L tokens over the cached sealed KV
(`KVStateSpec.swa_recompute_tokens`; the DeepSeek-V4 report's restore with zero SWA caching),
or the hit is cut back to the deepest boundary k whose windows are cached and [k, E) is
computed. With C(lo, hi) = prefill_s((hi − lo)·B, lo·B) − base_s (the marginal seconds of
computing blocks [lo, hi) in a step, as the emulated engine charges them) and
R(E) = min(rebuild_tokens, E·B):

    cached     k ≥ E                                             resume at E
    rebuilt    prefill_s(R, E·B − R) − base_s ≤ C(k, E)          resume at E, R tokens recomputed
    truncated  otherwise                                         resume at k (cold when k = 0)

An engine that never rebuilds windows (vLLM 0.32: its hybrid KV cache coordinator resumes only
where every window group holds the blocks before the boundary) has no `rebuilt` option: it
resumes at E when the windows are there, else at k (`resume_point(..., rebuild=False)`).

With a CPU tier continuing the prefix past the HBM hit H for h more blocks (`HostHit`,
E = H + h), the options are loading them (and rebuilding the windows at E unless the CPU tier
holds them), loading only up to the deepest boundary c whose windows HBM or the CPU tier
holds and computing [c, E), and the HBM-only options above each followed by computing the
rest up to E; the least modelled time wins, ties to the earlier: load, then the HBM hit
(cached or rebuilt), then the cut-back hit.

A fetch or migration is the same rule on its destination after the move: the sealed blocks
held plus those moved, and the windows where the destination holds them, or at the moved
boundary when the move brings them (`moved_windows`). Pure: no I/O, O(1) a call.
"""

from __future__ import annotations

from dataclasses import dataclass

from ownerserve.kvstate.spec import KVStateSpec
from ownerserve.kvstate.types import StateType
from ownerserve.profiles import PrefillTiming

RESUME_KINDS = ("cached", "rebuilt", "truncated", "cold")
"""How a prefix hit's mutable state is restored: its windows were cached at the boundary
(`cached`), rebuilt by recomputation (`rebuilt`), the hit was cut back to a boundary whose
windows were cached (`truncated`), or nothing could be resumed (`cold`)."""


@dataclass(frozen=True, slots=True)
class ResumeRule:
    """What the resume rule needs of a model's KV state on an engine of `block_tokens`-token
    blocks: the tokens recomputed to rebuild every window at a boundary (`rebuild_tokens`:
    n_win·L; one block for a model whose only mutable state is per-sequence, e.g. compression
    tails; 0 for a model without mutable state, which resumes wherever its sealed blocks
    reach)."""

    block_tokens: int
    rebuild_tokens: int = 0

    def __post_init__(self) -> None:
        if self.block_tokens <= 0 or self.rebuild_tokens < 0:
            raise ValueError(
                f"resume rule: block_tokens must be positive and rebuild_tokens >= 0, got "
                f"{self.block_tokens}, {self.rebuild_tokens}"
            )

    @classmethod
    def of(cls, spec: KVStateSpec | None, block_tokens: int | None = None) -> ResumeRule:
        """The rule of `spec` on blocks of `block_tokens` tokens (default: the spec's own);
        a dense model's (no mutable state) without a spec."""
        if spec is None:
            if block_tokens is None:
                raise ValueError("resume rule: block_tokens needed without a spec")
            return cls(block_tokens)
        bt = spec.block_tokens if block_tokens is None else block_tokens
        windows = spec.swa_recompute_tokens
        if windows:
            return cls(bt, windows)
        tails = any(StateType.TAIL_STATE in g.layer.state_types() for g in spec.groups)
        return cls(bt, bt if tails else 0)

    @property
    def hybrid(self) -> bool:
        """Whether the model has mutable state, so that a hit may resume short of its sealed
        blocks."""
        return self.rebuild_tokens > 0

    def rebuild(self, blocks: int) -> int:
        """R(E) = min(rebuild_tokens, E·B): tokens recomputed to rebuild the windows at
        boundary E = `blocks`."""
        n = blocks * self.block_tokens
        return self.rebuild_tokens if self.rebuild_tokens < n else n


@dataclass(frozen=True, slots=True)
class HostHit:
    """The prefix's continuation in the CPU tier past the HBM hit: `blocks` more sealed blocks
    that load in `load_s`; whether the windows at their end are held in HBM or the CPU tier
    (`windows_at_end`), and the deepest boundary (blocks, at most the end) whose windows are
    (`checkpoint`)."""

    blocks: int
    load_s: float
    windows_at_end: bool = False
    checkpoint: int = 0


@dataclass(frozen=True, slots=True)
class Resume:
    """Where a sequence resumes: `blocks` prefix blocks from HBM, then `host_blocks` loaded
    from the CPU tier; the windows at the resume point rebuilt over `rebuild_tokens`
    recomputed tokens (0: cached, or none needed); `how` (`RESUME_KINDS`)."""

    blocks: int
    host_blocks: int
    rebuild_tokens: int
    how: str

    @property
    def end(self) -> int:
        """The boundary the prompt is computed from (blocks)."""
        return self.blocks + self.host_blocks


def rebuild_s(prefill: PrefillTiming, rebuild_tokens: int, boundary_tokens: int) -> float:
    """prefill_s(R, S − R) − base_s: the marginal seconds of rebuilding the windows at a
    boundary of S = `boundary_tokens` tokens over R = `rebuild_tokens` recomputed tokens (the
    emulated engine charges it in the step that resumes)."""
    if rebuild_tokens <= 0:
        return 0.0
    return prefill.seconds(rebuild_tokens, boundary_tokens - rebuild_tokens) - prefill.base_s


def resume_point(
    rule: ResumeRule,
    prefill: PrefillTiming,
    sealed: int,
    windows: int,
    *,
    limit: int | None = None,
    host: HostHit | None = None,
    rebuild: bool = True,
) -> Resume:
    """Where a prefix hit resumes (module docstring): the sealed groups hold `sealed` leading
    blocks of the prompt in HBM (for a move, with those it brings), and `windows` is the
    deepest boundary (blocks) whose windows and state are held there; `limit` caps both at
    the prompt's blocks an engine may reuse ((N − 1) // B: the last prompt token is always
    computed); `host`: the prefix continues in the CPU tier; `rebuild`: the engine may
    rebuild windows (False: vLLM, whose hybrid KV cache coordinator only cuts a hit back to
    the deepest boundary whose windows it holds, and loads a host continuation only where
    its windows are held). `prefill` times the options (the engine's own profile: the rule
    is the engine's decision, whatever the caller's calibration)."""
    if limit is not None and sealed > limit:
        sealed = limit
    sealed = max(sealed, 0)
    windows = min(max(windows, 0), sealed)
    extra = host.blocks if host is not None and host.blocks > 0 else 0
    if not rule.hybrid:
        return Resume(sealed, extra, 0, "cached" if sealed + extra else "cold")
    end = sealed + extra
    if end == 0:
        return Resume(0, 0, 0, "cold")
    bs = rule.block_tokens
    base = prefill.base_s

    def compute_s(lo: int) -> float:
        """C(lo, E): computing blocks [lo, E)."""
        return prefill.seconds((end - lo) * bs, lo * bs) - base if end > lo else 0.0

    def rebuilt(blocks: int) -> tuple[int, float]:
        r = rule.rebuild(blocks)
        return r, rebuild_s(prefill, r, blocks * bs)

    options: list[tuple[float, Resume]] = []
    if extra and host is not None and (rebuild or host.windows_at_end):
        r, t = (0, 0.0) if host.windows_at_end else rebuilt(end)
        how = "rebuilt" if r else "cached"
        options.append((host.load_s + t, Resume(sealed, extra, r, how)))
        # or load only up to the deepest boundary whose windows are held, computing the rest
        c = host.checkpoint
        if sealed < c < end:
            load_s = host.load_s / extra * (c - sealed)
            options.append((load_s + compute_s(c), Resume(sealed, c - sealed, 0, "truncated")))
    if windows == sealed and sealed:
        options.append((compute_s(sealed), Resume(sealed, 0, 0, "cached")))
    else:
        if sealed and rebuild:
            r, t = rebuilt(sealed)
            options.append((t + compute_s(sealed), Resume(sealed, 0, r, "rebuilt")))
        how = "truncated" if windows else "cold"
        options.append((compute_s(windows), Resume(windows, 0, 0, how)))
    # ties go to the earlier option: loading, then the cached or rebuilt deeper hit
    return min(options, key=lambda o: o[0])[1]


def moved_windows(own: int, sealed_after: int, brings: bool) -> int:
    """The deepest boundary whose windows a destination holds after a fetch or migration that
    leaves it `sealed_after` sealed blocks: its own (`own`), or the moved boundary when the
    move brings the windows and state there (`brings`)."""
    return sealed_after if brings else min(own, sealed_after)
