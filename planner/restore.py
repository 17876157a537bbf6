"""The restore planner (HeteroCache 2.6.6): how a prefix hit's KV state gets back into HBM.

For a prefix of `cached_tokens` found on some tier, choose per state type between loading it,
recomputing it, or a mix, minimising T_load + T_recompute + T_queue + λ·M_HBM. The cost model
calls one function for its T_restore and M_HBM terms::

    plan = plan_restore(spec, cached_tokens, tier, profile, path=KVTransport.SAME_HOST,
                        lam=0.0, swa_policy=SwaPolicy.periodic(4096))
    plan.restore_s   # seconds on the request's critical path         -> T_restore
    plan.hbm_bytes   # bytes the restore newly places in HBM           -> M_HBM
    plan.objective   # restore_s + lam * hbm_bytes (what was minimised)

After the plan every one of `cached_tokens` is in HBM (the incomplete block included), so the
caller charges prefill of the rest of the prompt with `cached_tokens` as context, as usual.

The model, for c cached tokens, S = spec.sealed_tokens(c) and B = spec.block_tokens:

- Sealed artifacts (dense/MLA KV, CSA main and indexer, HCA) of [0, S) are loaded, recomputed,
  or split at a block boundary j: recompute [0, j) from scratch while [j, r) loads (both need
  nothing from each other, so they overlap; "compute or load? why not both").
- The incomplete block [S, c) is always recomputed (RECOMPUTE_TAIL): its compression groups
  are not sealed, and its tail state is mutable.
- The sliding windows at S are loaded from a checkpoint at q <= S (LOAD_SWA_CHECKPOINT), then
  [q, S) is recomputed; or rebuilt by recomputing the last min(n_win·L, S - j) tokens from the
  cached compressed KV (RECOMPUTE_SWA). Which checkpoints exist depends on the SWA caching
  policy: full (q = S), periodic every p tokens (q = p·floor(S/p)), zero (none). HBM (GPU
  tier) prefix caches keep the windows of their cached blocks, so a GPU tier acts as full.
- Everything after r (the first token not loaded) is recomputed in one pass: [r, c).

Timeline (loads start at once; compute waits `queue_s` for a GPU slot):

    T_load     = latency(path) + bytes / bw(tier, path), minus a prefetch window, if any
    F          = prefill_s(j, 0)                         front recompute
    Bk         = prefill_s(c - r, r)                     SWA + tail recompute
    restore_s  = max(queue_s + F, T_load) + Bk           (= T_load if nothing is recomputed)
    objective  = restore_s + lam · hbm_bytes

A mix (0 < j < S) is taken only when it beats the better pure plan by `mix_min_gain`.
Path: the KV transport the bytes take (`ownerserve.types.KVTransport`; same_host for a
worker's own tiers), priced by the profile (`LinkTiming.path`: bps, latency_s). Bandwidth: GPU
peer bps(path) (local HBM is free); CPU `cpu_load_bps` (path not same_host: min with
bps(path)); SSD min(`ssd_load_bps`, `cpu_load_bps`) (not same_host: min(`ssd_load_bps`,
bps(path))).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache

from ownerserve.kvstate import (
    DEFAULT_SWA_POLICY,
    SEALED_TYPES,
    KVStateSpec,
    StateType,
    SwaCaching,
    SwaCostInputs,
    SwaPolicy,
    resolve_swa_policy,
)
from ownerserve.profiles import LinkTiming, TimingProfile
from ownerserve.types import KVTransport, Tier

__all__ = [
    "DEFAULT_SWA_POLICY",
    "Decision",
    "RestoreAction",
    "RestorePlan",
    "RestoreStep",
    "StateChoice",
    "SwaCaching",
    "SwaPolicy",
    "load_bandwidth",
    "load_seconds",
    "plan_restore",
    "swa_cost_inputs",
]


class RestoreAction(StrEnum):
    """Steps of a restore plan (HeteroCache, plus RECOMPUTE_PREFIX for the recompute side)."""

    LOAD_COMPRESSED_KV = "load_compressed_kv"
    RECOMPUTE_PREFIX = "recompute_prefix"
    RECOMPUTE_TAIL = "recompute_tail"
    LOAD_SWA_CHECKPOINT = "load_swa_checkpoint"
    RECOMPUTE_SWA = "recompute_swa"
    PREFETCH_ARTIFACT = "prefetch_artifact"
    DROP_LOW_UTILITY_ARTIFACT = "drop_low_utility_artifact"


class Decision(StrEnum):
    """What happens to one state type."""

    LOAD = "load"
    RECOMPUTE = "recompute"
    MIX = "mix"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class StateChoice:
    """The decision for one state type, with what it moves and what it recomputes."""

    state_type: StateType
    decision: Decision
    load_bytes: int = 0
    recompute_tokens: int = 0


@dataclass(frozen=True, slots=True)
class RestoreStep:
    """One action over the token range [start, end)."""

    action: RestoreAction
    start: int
    end: int
    nbytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """The chosen restore with its cost breakdown (seconds, bytes)."""

    spec: str
    tier: Tier
    cached_tokens: int
    sealed_tokens: int
    tail_tokens: int
    choices: tuple[StateChoice, ...]
    steps: tuple[RestoreStep, ...]
    load_s: float
    recompute_s: float
    queue_s: float
    restore_s: float
    hbm_bytes: int
    lam: float
    loaded_bytes: int
    recomputed_tokens: int
    load_all_s: float
    recompute_all_s: float

    @property
    def objective(self) -> float:
        return self.restore_s + self.lam * self.hbm_bytes

    def choice(self, state_type: StateType) -> StateChoice:
        for c in self.choices:
            if c.state_type is state_type:
                return c
        raise KeyError(f"spec {self.spec!r} has no {state_type.value} state")

    def actions(self) -> tuple[RestoreAction, ...]:
        return tuple(s.action for s in self.steps)


# --- bandwidth ---------------------------------------------------------------------------------


def load_bandwidth(link: LinkTiming, tier: Tier, *, path: KVTransport) -> float:
    """Bytes per second from `tier` into the executing worker's HBM over `path` (the path's
    slowest link)."""
    if tier is Tier.GPU:
        return link.path(path).bps
    local = path is KVTransport.SAME_HOST
    if tier is Tier.CPU:
        return link.cpu_load_bps if local else min(link.cpu_load_bps, link.path(path).bps)
    if local:
        return min(link.ssd_load_bps, link.cpu_load_bps)
    return min(link.ssd_load_bps, link.path(path).bps)


def load_seconds(
    link: LinkTiming, tier: Tier, nbytes: float, *, path: KVTransport, local: bool = False
) -> float:
    """latency(path) + bytes / bandwidth; 0 for nothing, or for KV already in this worker's
    HBM."""
    if nbytes <= 0 or (local and tier is Tier.GPU):
        return 0.0
    return link.path(path).latency_s + nbytes / load_bandwidth(link, tier, path=path)


# --- the planner -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Option:
    j: int  # front recompute [0, j)
    r: int  # first token recomputed after the loads; loads cover [j, r)
    ckpt: int  # window checkpoint position loaded (0: none)
    swa_bytes: int
    load_bytes: int
    load_s: float
    front_s: float
    back_s: float
    restore_s: float


class _Planner:
    __slots__ = (
        "c",
        "local",
        "overlap",
        "path",
        "policy",
        "prefetch_s",
        "profile",
        "queue_s",
        "resident",
        "sealed",
        "spec",
        "tier",
        "window",
    )

    def __init__(
        self,
        spec: KVStateSpec,
        c: int,
        tier: Tier,
        profile: TimingProfile,
        *,
        path: KVTransport,
        local: bool,
        queue_s: float,
        policy: SwaPolicy,
        overlap: bool,
        prefetch_s: float,
        resident: int = 0,
    ) -> None:
        self.spec, self.c, self.tier, self.profile = spec, c, tier, profile
        # sealed tokens [0, resident) already in this worker's HBM, windows included
        self.resident = resident
        self.path, self.local, self.queue_s = path, local, queue_s
        self.overlap, self.prefetch_s = overlap, prefetch_s
        # HBM prefix caches keep the windows of cached blocks: a GPU copy acts as full caching.
        self.policy = SwaPolicy.full() if tier is Tier.GPU else policy
        self.sealed = spec.sealed_tokens(c)
        self.window = spec.swa_recompute_tokens

    def timeline(self, load_s: float, front_s: float, back_s: float) -> float:
        if front_s <= 0 and back_s <= 0:
            return load_s
        start = self.queue_s if self.overlap else max(self.queue_s, load_s)
        return max(start + front_s, load_s) + back_s

    def option(self, j: int, r: int, ckpt: int) -> _Option:
        spec, c = self.spec, self.c
        swa = spec.swa_bytes(ckpt) if ckpt > 0 else 0
        nbytes = spec.sealed_bytes(j, r) + swa
        load = load_seconds(self.profile.link, self.tier, nbytes, path=self.path, local=self.local)
        load = max(0.0, load - self.prefetch_s)
        a = self.resident
        front = self.profile.prefill_s(j - a, a) if j > a else 0.0
        back = self.profile.prefill_s(c - r, r)
        return _Option(j, r, ckpt, swa, nbytes, load, front, back, self.timeline(load, front, back))

    def options_at(self, j: int, ckpt_mode: bool | None = None) -> list[_Option]:
        """Every way to restore the windows when sealed blocks from j on are loaded: recompute
        the last n_win·L tokens, or load a checkpoint and recompute from it (`ckpt_mode`
        restricts to one of the two)."""
        s = self.sealed
        if self.window == 0:
            return [self.option(j, s, 0)]
        out = []
        if ckpt_mode is not True:
            out.append(self.option(j, max(j, s - self.window), 0))  # RECOMPUTE_SWA
        q = self.policy.checkpoint_at(s)
        if q > j and ckpt_mode is not False:
            out.append(self.option(j, q, q))  # LOAD_SWA_CHECKPOINT, then recompute [q, S)
        return out

    def best_at(self, j: int, ckpt_mode: bool | None = None) -> _Option | None:
        opts = self.options_at(j, ckpt_mode)
        return min(opts, key=lambda o: o.restore_s) if opts else None

    def recompute_all(self) -> _Option:
        a = self.resident
        front = self.profile.prefill_s(self.c - a, a)
        return _Option(self.c, self.c, 0, 0, 0, 0.0, front, 0.0, self.timeline(0.0, front, 0.0))

    def best_mix(self) -> _Option | None:
        """The split j where recomputing [0, j) and loading [j, r) finish together.

        With F(j) = base + a·j + (c/2)·j² and T_load(j) = latency + (bytes(0, r) − rate·j)/bw
        (exact at block boundaries: every ratio divides the block), the crossing
        queue + F(j) = T_load(j) is a quadratic's root; the blocks either side are evaluated
        exactly, for each way of restoring the windows."""
        b, s = self.spec.block_tokens, self.sealed
        blocks = s // b
        if blocks < 2 or (self.local and self.tier is Tier.GPU) or self.resident > 0:
            return None
        pf, link = self.profile.prefill, self.profile.link
        bw = load_bandwidth(link, self.tier, path=self.path)
        latency = link.path(self.path).latency_s
        rate = self.spec.bytes_per_token()
        modes: tuple[bool | None, ...] = (None,) if self.window == 0 else (False, True)
        cands: list[_Option] = []
        for mode in modes:
            at0 = self.best_at(0, mode)
            if at0 is None or at0.load_s <= 0:
                continue
            qa = pf.per_token_ctx_s / 2.0
            qb = pf.per_token_s + rate / bw
            qc = self.queue_s + pf.base_s - (latency + at0.load_bytes / bw - self.prefetch_s)
            if qc >= 0:
                j = 0.0
            elif qa > 0:
                j = (-qb + math.sqrt(qb * qb - 4.0 * qa * qc)) / (2.0 * qa)
            elif qb > 0:
                j = -qc / qb
            else:  # recompute costs nothing per token: recompute everything
                j = float(s)
            k = int(j // b)
            for kk in range(max(1, k - 1), min(blocks - 1, k + 2) + 1):
                o = self.best_at(kk * b, mode)
                if o is not None:
                    cands.append(o)
        return min(cands, key=lambda o: o.restore_s) if cands else None


def swa_cost_inputs(
    spec: KVStateSpec,
    profile: TimingProfile,
    *,
    session_tokens: int,
    restores: float = 1.0,
    tier: Tier = Tier.SSD,
    path: KVTransport = KVTransport.SAME_HOST,
    alpha: float | None = None,
    beta: float = 1.0,
    gamma: float = 0.0,
) -> SwaCostInputs:
    """The cost-based SWA period's inputs from a timing profile (`SwaCostInputs`):
    load_bps = `load_bandwidth(tier, path)`, load_latency_s = latency(path), ρ = per_token_s +
    per_token_ctx_s · n/2 (a recomputed token at the mean boundary's context), α = 1 /
    load_bps unless given (a byte written occupies the tier as long as reading it back)."""
    bw = load_bandwidth(profile.link, tier, path=path)
    pf = profile.prefill
    return SwaCostInputs(
        session_tokens=session_tokens,
        restores=restores,
        load_bps=bw,
        load_latency_s=profile.link.path(path).latency_s,
        recompute_s_per_token=pf.per_token_s + pf.per_token_ctx_s * session_tokens / 2.0,
        alpha=1.0 / bw if alpha is None else alpha,
        beta=beta,
        gamma=gamma,
    )


@lru_cache(maxsize=256)
def _resolved(
    spec: KVStateSpec,
    policy: SwaPolicy,
    profile: TimingProfile,
    tier: Tier,
    path: KVTransport,
    session_tokens: int,
) -> SwaPolicy:
    inputs = swa_cost_inputs(spec, profile, session_tokens=session_tokens, tier=tier, path=path)
    return resolve_swa_policy(spec, policy, inputs)


def plan_restore(
    spec: KVStateSpec,
    cached_tokens: int,
    tier: Tier,
    profile: TimingProfile,
    *,
    path: KVTransport = KVTransport.SAME_HOST,
    local: bool = False,
    queue_s: float = 0.0,
    lam: float = 0.0,
    swa_policy: SwaPolicy | None = None,
    overlap: bool = True,
    mix_min_gain: float = 0.05,
    prefetch_window_s: float = 0.0,
    hbm_free_bytes: int | None = None,
    resident_tokens: int = 0,
) -> RestorePlan:
    """Plan how `cached_tokens` of prefix found on `tier` get into this worker's HBM.

    `path`: the KV transport the copy takes into this worker (`ownerserve.profiles.
    kv_transport_into`; same_host: its own tiers, or a peer on its node through host memory).
    `local`: a GPU-tier copy already sits in this worker's HBM (nothing to move).
    `queue_s`: wait for a GPU compute slot before any recompute can start (loads don't wait).
    `lam`: seconds per HBM byte (the λ of λ·M_HBM). `swa_policy`: how windows were kept on
    CPU/SSD. `overlap`: recompute a front part while loading the rest (a mix). A mix must beat
    the better pure plan by `mix_min_gain` (a fraction). `prefetch_window_s`: seconds before the
    request needs the KV during which loads may run ahead (PREFETCH_ARTIFACT), e.g. a tool call.
    `hbm_free_bytes`: HBM free on the worker; a deficit adds DROP_LOW_UTILITY_ARTIFACT.
    `swa_policy`: None = the spec's own (`KVStateSpec.swa_policy`); a cost-based policy not
    yet resolved gets its p* for this profile and tier, a session of `cached_tokens` and one
    restore (`swa_cost_inputs`). `resident_tokens`: the prefix this worker already holds in
    HBM (its GPU blocks, windows included), rounded down to a sealed boundary: only
    [resident, cached) is loaded or recomputed, without a front recompute (no mix).
    """
    if cached_tokens < 0:
        raise ValueError("cached_tokens must not be negative")
    if resident_tokens < 0:
        raise ValueError("resident_tokens must not be negative")
    tier = Tier(tier)
    if queue_s < 0 or lam < 0 or prefetch_window_s < 0:
        raise ValueError("queue_s, lam and prefetch_window_s must not be negative")
    policy = spec.swa_policy if swa_policy is None else swa_policy
    if not policy.resolved:
        policy = _resolved(spec, policy, profile, tier, path, cached_tokens)
    resident = spec.sealed_tokens(min(resident_tokens, cached_tokens))
    p = _Planner(
        spec,
        cached_tokens,
        tier,
        profile,
        path=path,
        local=local,
        queue_s=queue_s,
        policy=policy,
        overlap=overlap,
        prefetch_s=prefetch_window_s,
        resident=resident,
    )
    c, s = cached_tokens, p.sealed
    everything = p.recompute_all()
    loading = p.best_at(resident) if s > resident else None
    loading = loading or everything
    best = min((loading, everything), key=lambda o: o.restore_s)
    if overlap and s > 0:
        mix = p.best_mix()
        if mix is not None and mix.restore_s < (1.0 - mix_min_gain) * best.restore_s:
            best = mix
    if local and tier is Tier.GPU:
        hbm = max(0, spec.total_bytes(c) - spec.total_bytes(s))
    elif resident:
        hbm = max(0, spec.total_bytes(c) - spec.total_bytes(resident))
    else:
        hbm = spec.total_bytes(c)
    return _build_plan(p, best, lam, hbm, hbm_free_bytes, loading.restore_s, everything.restore_s)


def _build_plan(
    p: _Planner,
    o: _Option,
    lam: float,
    hbm: int,
    hbm_free: int | None,
    load_all_s: float,
    recompute_all_s: float,
) -> RestorePlan:
    spec, c, s, a = p.spec, p.c, p.sealed, p.resident
    all_recompute = o.j >= c
    choices: list[StateChoice] = []
    loaded = spec.state_bytes(o.j, o.r) if not all_recompute and o.r > o.j else {}
    for st in spec.state_types:
        if st in SEALED_TYPES:
            if s == 0:
                choices.append(StateChoice(st, Decision.NONE))
                continue
            recomputed = s - a if all_recompute else o.j - a + (s - o.r)
            nbytes = loaded.get(st, 0)
            if nbytes == 0:
                decision = Decision.RECOMPUTE
            elif recomputed == 0:
                decision = Decision.LOAD
            else:
                decision = Decision.MIX
            choices.append(StateChoice(st, decision, nbytes, recomputed))
        elif st is StateType.WINDOW_SWA:
            if o.ckpt > 0:
                choices.append(StateChoice(st, Decision.LOAD, o.swa_bytes, s - o.ckpt))
            elif s == 0 and c == 0:
                choices.append(StateChoice(st, Decision.NONE))
            else:
                done = c - a if all_recompute else s - o.r
                choices.append(StateChoice(st, Decision.RECOMPUTE, 0, done))
        else:  # TAIL_STATE: never loaded
            tail = c - s
            choices.append(StateChoice(st, Decision.RECOMPUTE if tail else Decision.NONE, 0, tail))

    steps: list[RestoreStep] = []
    if all_recompute:
        # one pass over [a, c); the incomplete block is reported as its marginal cost
        prefix_s = p.profile.prefill_s(s - a, a)
        if s > a:
            steps.append(RestoreStep(RestoreAction.RECOMPUTE_PREFIX, a, s, 0, prefix_s))
        if c > s:
            steps.append(RestoreStep(RestoreAction.RECOMPUTE_TAIL, s, c, 0, o.front_s - prefix_s))
    else:
        if o.j > a:
            steps.append(RestoreStep(RestoreAction.RECOMPUTE_PREFIX, a, o.j, 0, o.front_s))
        sealed_bytes = o.load_bytes - o.swa_bytes
        full_load_s = o.load_s + p.prefetch_s if o.load_bytes else 0.0
        share = sealed_bytes / o.load_bytes if o.load_bytes else 0.0
        if o.r > o.j:
            steps.append(
                RestoreStep(
                    RestoreAction.LOAD_COMPRESSED_KV, o.j, o.r, sealed_bytes, o.load_s * share
                )
            )
        if o.ckpt > 0:
            steps.append(
                RestoreStep(
                    RestoreAction.LOAD_SWA_CHECKPOINT,
                    o.ckpt - min(o.ckpt, spec.max_window),
                    o.ckpt,
                    o.swa_bytes,
                    o.load_s * (1.0 - share),
                )
            )
        if p.prefetch_s > 0 and o.load_bytes > 0:
            hidden = min(full_load_s, p.prefetch_s)
            steps.append(
                RestoreStep(RestoreAction.PREFETCH_ARTIFACT, o.j, o.r, o.load_bytes, hidden)
            )
        if o.r < s:
            swa_s = p.profile.prefill_s(c - o.r, o.r) - p.profile.prefill_s(c - s, s)
            steps.append(RestoreStep(RestoreAction.RECOMPUTE_SWA, o.r, s, 0, swa_s))
        if c > s:
            tail_s = o.back_s if o.r >= s else p.profile.prefill_s(c - s, s)
            steps.append(RestoreStep(RestoreAction.RECOMPUTE_TAIL, s, c, 0, tail_s))
    if hbm_free is not None and hbm > hbm_free:
        steps.append(RestoreStep(RestoreAction.DROP_LOW_UTILITY_ARTIFACT, 0, 0, hbm - hbm_free))

    recompute_s = o.front_s + o.back_s
    recomputed_tokens = c - a if all_recompute else o.j - a + (c - o.r)
    return RestorePlan(
        spec=spec.name,
        tier=p.tier,
        cached_tokens=c,
        sealed_tokens=s,
        tail_tokens=c - s,
        choices=tuple(choices),
        steps=tuple(steps),
        load_s=o.load_s,
        recompute_s=recompute_s,
        queue_s=p.queue_s if recompute_s > 0 else 0.0,
        restore_s=o.restore_s,
        hbm_bytes=hbm,
        lam=lam,
        loaded_bytes=0 if all_recompute else o.load_bytes,
        recomputed_tokens=recomputed_tokens,
        load_all_s=load_all_s,
        recompute_all_s=recompute_all_s,
    )
