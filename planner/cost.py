"""The mission's cost model:

    C(a) = T_queue + T_compute + T_network + T_restore + λ·M_HBM + μ·I_decode + H_move

Each term is its own function below, with its formula in its docstring, exactly as computed (the
same formulas are in `planner/README.md`). Times come from `ownerserve.profiles` timing profiles,
scaled per worker by online calibration (`WorkerView.prefill_scale/decode_scale/link_scale`).
Profiles are read once when a `CostModel` is built; evaluating a cost never does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ownerserve.errors import ConfigError
from ownerserve.kvstate import KVStateSpec, load_spec
from ownerserve.profiles import TimingProfile, load_profile
from ownerserve.records import fast_init
from ownerserve.types import Role, Tier
from planner.restore import DEFAULT_SWA_POLICY, SwaPolicy, plan_restore
from planner.types import (
    Action,
    Candidate,
    ClusterView,
    CostBreakdown,
    RequestView,
    WorkerView,
)

if TYPE_CHECKING:  # pydantic stays out of the planner's import path
    from ownerserve.config import PlannerSettings


# Enum members bound once: `Tier.GPU` is a ~0.1 µs class-attribute lookup, a global is not.
_GPU, _CPU, _SSD = Tier.GPU, Tier.CPU, Tier.SSD
_PREFILL, _DECODE = Role.PREFILL, Role.DECODE
_COL, _CONT, _TAIL = Action.COLOCATED_PREFILL, Action.DECODE_CONTINUATION, Action.TAIL_RECOMPUTE
_FETCH, _MIG, _REMOTE = Action.ARTIFACT_FETCH, Action.STATE_MIGRATION, Action.REMOTE_PREFILL


@dataclass(frozen=True, slots=True)
class CostConfig:
    """Weights, thresholds and profile names of the planner (`planner:` section of the config).

    `lam` (λ) is seconds per duplicated HBM byte, `mu` (μ) the weight of decode interference;
    `migration_margin_s` and `migration_margin_rel` are the hysteresis a state migration pays
    (`h_move`).
    `profile` is the default timing profile; `profiles` are extra ones workers may name in
    `WorkerView.profile` (an unknown name falls back to the default).
    """

    lam: float = 1e-11
    mu: float = 1.0
    profile: str = "h100-llama3-8b"
    profiles: tuple[str, ...] = ()
    # HeteroCache KV state spec (configs/models/NAME.yaml): when set, a cold worker's restore
    # (prefix only in CPU/SSD) is planned by planner.restore instead of a plain tier load
    kv_spec: str | None = None
    # request classes (planner.classify)
    long_prefix_tokens: int = 4096
    small_turn_tokens: int = 2048
    continuation_tokens: int = 64
    cold_resume_idle_s: float = 300.0
    # decode steps of the request counted in T_compute: min(max_tokens, decode_horizon_tokens)
    decode_horizon_tokens: int = 64
    # fixed cost of the two-phase P->D protocol (extra request round trip + KV handshake)
    pd_handshake_s: float = 0.005
    # state migration hysteresis: a move must beat staying by this margin plus this share of
    # its own cost (`h_move`)
    migration_margin_s: float = 0.05
    migration_margin_rel: float = 0.1
    # prefix-multi-owner baseline: "imbalanced" when max-min load > abs and max > rel·min
    imbalance_abs: int = 32
    imbalance_rel: float = 1.5

    def __post_init__(self) -> None:
        if self.lam < 0 or self.mu < 0:
            raise ConfigError("planner: lambda_hbm and mu_interference must be >= 0")
        if self.decode_horizon_tokens < 0 or self.pd_handshake_s < 0:
            raise ConfigError("planner: decode_horizon_tokens and pd_handshake_s must be >= 0")
        if self.migration_margin_s < 0 or self.migration_margin_rel < 0:
            raise ConfigError("planner: migration_margin_s and migration_margin_rel must be >= 0")

    @classmethod
    def from_settings(cls, settings: PlannerSettings, kv_spec: str | None = None) -> CostConfig:
        """From the `planner:` section; `kv_spec` is the served model's spec (`models[].kv_spec`)
        when cold restores should be planned per state type by `planner.restore`."""
        return cls(
            lam=settings.lambda_hbm,
            mu=settings.mu_interference,
            profile=settings.profile,
            kv_spec=kv_spec,
            migration_margin_s=settings.migration_margin_s,
            migration_margin_rel=settings.migration_margin_rel,
        )


class CostModel:
    """Timing profiles per worker, corrected by the worker's calibration scales.

    `prefill_s`, `decode_step_s`, `transfer_s` and `restore_s` are the primitives every cost
    term is made of.
    """

    __slots__ = ("_cold", "_default", "_profiles", "config", "spec", "swa_policy")

    _COLD_CACHE_MAX = 4096

    def __init__(
        self,
        config: CostConfig | None = None,
        profiles: Mapping[str, TimingProfile] | None = None,
        *,
        spec: KVStateSpec | None = None,
        swa_policy: SwaPolicy = DEFAULT_SWA_POLICY,
    ) -> None:
        self.config = config or CostConfig()
        if spec is None and self.config.kv_spec is not None:
            spec = load_spec(self.config.kv_spec)
        self.spec = spec
        self.swa_policy = swa_policy
        self._cold: dict[tuple[str, int, Tier], float] = {}
        if profiles is None:
            names = (self.config.profile, *self.config.profiles)
            profiles = {n: load_profile(n) for n in names}
        if self.config.profile not in profiles:
            raise ConfigError(f"planner: profile {self.config.profile!r} not loaded")
        for p in profiles.values():
            link = p.link
            bws = (link.intra_node_bps, link.inter_node_bps, link.cpu_load_bps, link.ssd_load_bps)
            if min(bws) <= 0 or p.max_num_seqs <= 0 or p.kv_bytes_per_token <= 0:
                raise ConfigError(
                    f"profile {p.name}: bandwidths, max_num_seqs and kv_bytes_per_token must be > 0"
                )
            if link.intra_node_bps < link.inter_node_bps:
                # the remote-prefill search assumes a same-node link is never slower
                raise ConfigError(f"profile {p.name}: intra_node_bps < inter_node_bps")
        self._profiles: dict[str, TimingProfile] = dict(profiles)
        self._default = self._profiles[self.config.profile]

    @property
    def profiles(self) -> Mapping[str, TimingProfile]:
        return self._profiles

    def profile_of(self, worker: WorkerView) -> TimingProfile:
        """The worker's profile by `WorkerView.profile`; the default one if unknown."""
        return self._profiles.get(worker.profile, self._default)

    def prefill_s(self, worker: WorkerView, new_tokens: int, cached_tokens: int) -> float:
        """prefill_scale · profile.prefill_s(new, cached)."""
        prof = self._profiles.get(worker.profile, self._default)
        return worker.prefill_scale * prof.prefill.seconds(new_tokens, cached_tokens)

    def decode_step_s(self, worker: WorkerView, batch: int, ctx: float) -> float:
        """decode_scale · (base_s + per_seq_s · batch + per_ctx_token_s · ctx), the profile's
        decode step (`DecodeTiming.step_seconds`) for a fractional context; 0 for an empty batch."""
        if batch <= 0:
            return 0.0
        dt = self._profiles.get(worker.profile, self._default).decode
        return worker.decode_scale * (dt.base_s + dt.per_seq_s * batch + dt.per_ctx_token_s * ctx)

    def link_s(self, src: WorkerView, dst: WorkerView, nbytes: float) -> float:
        """dst.link_scale · (latency_s + bytes / bw), bw = intra- or inter-node bandwidth of the
        destination's profile; 0 when nothing moves."""
        if nbytes <= 0:
            return 0.0
        link = self._profiles.get(dst.profile, self._default).link
        return dst.link_scale * link.transfer_s(nbytes, src.node == dst.node)

    def transfer_s(self, src: WorkerView, dst: WorkerView, nbytes: float) -> float:
        """link_s(src, dst, bytes) + [src.node ≠ dst.node] · src.nic_backlog_s: a transfer
        between nodes first waits for what is queued on the source node's NIC; 0 when nothing
        moves."""
        t = self.link_s(src, dst, nbytes)
        if nbytes > 0 and src.node != dst.node:
            return t + src.nic_backlog_s
        return t

    def restore_s(self, worker: WorkerView, cpu_bytes: float, ssd_bytes: float) -> float:
        """Tier load into HBM: cpu_bytes / cpu_load_bps + ssd_bytes / ssd_load_bps."""
        link = self.profile_of(worker).link
        return cpu_bytes / link.cpu_load_bps + ssd_bytes / link.ssd_load_bps

    def cold_restore_s(self, worker: WorkerView, cached_tokens: int, tier: Tier) -> float:
        """`planner.restore.plan_restore(spec, cached_tokens, tier, profile(worker)).restore_s`:
        bring a prefix held only in `tier` (CPU/SSD) of `worker` back into its HBM, loading or
        recomputing each state type (tail and SWA included). Memoised: it is a pure function."""
        assert self.spec is not None
        prof = self.profile_of(worker)
        key = (prof.name, cached_tokens, tier)
        val = self._cold.get(key)
        if val is None:
            if len(self._cold) >= self._COLD_CACHE_MAX:
                self._cold.clear()
            plan = plan_restore(self.spec, cached_tokens, tier, prof, swa_policy=self.swa_policy)
            val = self._cold[key] = plan.restore_s
        return val

    def tier_restore_s(
        self, worker: WorkerView, gpu: int, cpu: int, ssd: int, request: RequestView
    ) -> float:
        """T_restore of a worker holding the request's prefix up to `gpu`/`cpu`/`ssd` blocks:
        0 when the GPU copy is the longest; with a KV spec and nothing in GPU,
        cold_restore_s(worker, min(max(cpu, ssd)·block_size, N − 1), SSD if ssd > cpu else CPU);
        otherwise restore_s(worker, max(0, cpu − gpu)·block_size·K,
        max(0, ssd − max(gpu, cpu))·block_size·K)."""
        if cpu <= gpu and ssd <= gpu:
            return 0.0
        if self.spec is not None and gpu == 0:
            held = cpu if cpu >= ssd else ssd
            cached = min(held * request.block_size, max(request.prompt_tokens, 1) - 1)
            return self.cold_restore_s(worker, cached, _SSD if ssd > cpu else _CPU)
        bk = request.block_size * request.kv_bytes_per_token
        gc = cpu if cpu > gpu else gpu
        return self.restore_s(worker, (gc - gpu) * bk, (ssd - gc if ssd > gc else 0) * bk)

    def context_tokens(self, worker: WorkerView) -> float:
        """Tokens held by the worker's running sequences:
        kv_usage · hbm_kv_bytes / kv_bytes_per_token (of its profile)."""
        prof = self._profiles.get(worker.profile, self._default)
        return worker.kv_usage * prof.hbm_kv_bytes / prof.kv_bytes_per_token

    def queue_s(self, worker: WorkerView) -> float:
        """q(w) = prefill_scale · (per_token_s · inflight_prefill_tokens + base_s · waiting)."""
        pf = self._profiles.get(worker.profile, self._default).prefill
        return worker.prefill_scale * (
            pf.per_token_s * worker.inflight_prefill_tokens + pf.base_s * worker.waiting
        )


# --------------------------------------------------------------------------------------------
# Routes: one (action, workers) option, and the quantities every term derives from it.


@fast_init
@dataclass(frozen=True, slots=True)
class Route:
    """An action with its workers: prefill on `prefill`, decode on `decode`; `source` is the
    worker an artifact is fetched from (ARTIFACT_FETCH) or the session moves from
    (STATE_MIGRATION)."""

    action: Action
    prefill: WorkerView
    decode: WorkerView
    source: WorkerView | None = None


def can_prefill(worker: WorkerView) -> bool:
    return worker.role is not _DECODE


def can_decode(worker: WorkerView) -> bool:
    return worker.role is not _PREFILL


def tier_blocks(worker: WorkerView) -> tuple[int, int, int]:
    """(gpu, cpu, ssd): longest prefix of the request's chain the worker holds in each tier."""
    cb = worker.cached_blocks
    if not cb:
        return 0, 0, 0
    return cb.get(_GPU, 0), cb.get(_CPU, 0), cb.get(_SSD, 0)


def held_blocks(worker: WorkerView) -> int:
    """Longest prefix the worker can reuse from any of its tiers: max(gpu, cpu, ssd)."""
    g, c, s = tier_blocks(worker)
    return max(g, c, s)


def moved_blocks(request: RequestView, route: Route, held: int | None = None) -> int:
    """Blocks pulled over the network into the prefill worker before it computes:
    ARTIFACT_FETCH: max(0, owner_blocks − held(P)); STATE_MIGRATION: max(0, gpu(S) − held(P)).
    `held` is held(P) when already known."""
    action = route.action
    if action is _FETCH:
        h = held_blocks(route.prefill) if held is None else held
        return max(0, request.owner_blocks - h)
    if action is _MIG and route.source is not None:
        h = held_blocks(route.prefill) if held is None else held
        return max(0, tier_blocks(route.source)[0] - h)
    return 0


def reused_blocks(request: RequestView, route: Route) -> int:
    """Prefix blocks the prefill worker does not recompute: held(P) + moved blocks."""
    held = held_blocks(route.prefill)
    return held + moved_blocks(request, route, held)


def reused_tokens(request: RequestView, route: Route, blocks: int | None = None) -> int:
    """min(reused_blocks · block_size, N − 1): the last prompt token is always computed.
    `blocks` is reused_blocks when already known."""
    n = request.prompt_tokens if request.prompt_tokens > 1 else 1
    rb = reused_blocks(request, route) if blocks is None else blocks
    return min(rb * request.block_size, n - 1)


def decode_tokens(request: RequestView, config: CostConfig) -> int:
    """O = min(max_tokens, decode_horizon_tokens): decode steps counted in T_compute."""
    o = request.max_tokens
    h = config.decode_horizon_tokens
    if o > h:
        o = h
    return o if o > 0 else 0


def owner_duplicate_bytes(request: RequestView, worker: WorkerView, held: int) -> int:
    """KV of the owned prefix a non-owner worker newly materialises:
    [w ≠ owner] · max(0, owner_blocks − held) · block_size · kv_bytes_per_token."""
    if request.owner is None or worker.worker_id == request.owner:
        return 0
    return max(0, request.owner_blocks - held) * request.block_size * request.kv_bytes_per_token


# --------------------------------------------------------------------------------------------
# The cost terms.


def t_queue(model: CostModel, request: RequestView, route: Route) -> float:
    """T_queue = q(P) + [D ≠ P] · q(D), with
    q(w) = prefill_scale(w) · (per_token_s · inflight_prefill_tokens(w) + base_s · waiting(w)).

    Conservative for remote prefill: the decode worker's backlog is assumed not to drain while
    P computes."""
    p, d = route.prefill, route.decode
    q = model.queue_s(p)
    if d is not p and d.worker_id != p.worker_id:
        q += model.queue_s(d)
    return q


def t_prefill(
    model: CostModel, request: RequestView, route: Route, reused: int | None = None
) -> float:
    """Prefill part of T_compute: prefill_s(P, N − r, r), r = reused_tokens (`reused` if given)."""
    n = max(request.prompt_tokens, 1)
    r = reused_tokens(request, route) if reused is None else reused
    return model.prefill_s(route.prefill, n - r, r)


def t_decode(model: CostModel, request: RequestView, route: Route) -> float:
    """Decode part of T_compute: O · decode_step_s(D, running(D) + 1, ctx(D) + N),
    ctx(D) = kv_usage(D) · hbm_kv_bytes / kv_bytes_per_token (profile of D)."""
    d = route.decode
    o = decode_tokens(request, model.config)
    ctx = model.context_tokens(d) + max(request.prompt_tokens, 1)
    return o * model.decode_step_s(d, d.running + 1, ctx)


def t_compute(model: CostModel, request: RequestView, route: Route) -> float:
    """T_compute = prefill_s(P, N − r, r) + O · decode_step_s(D, running(D) + 1, ctx(D) + N)."""
    return t_prefill(model, request, route) + t_decode(model, request, route)


def kv_transfer(
    request: RequestView, route: Route, moved: int | None = None
) -> tuple[WorkerView, WorkerView, int] | None:
    """The route's KV transfer over a link, (from, to, bytes):
    REMOTE_PREFILL: (P, D, max(0, N − gpu(D)·block_size) · K);
    ARTIFACT_FETCH / STATE_MIGRATION: (S, P, moved_blocks · block_size · K);
    colocated actions: None.  (K = kv_bytes_per_token; `moved` = moved_blocks when known)"""
    k = request.kv_bytes_per_token
    if route.action is _REMOTE:
        n = max(request.prompt_tokens, 1)
        gpu_d = tier_blocks(route.decode)[0] * request.block_size
        return route.prefill, route.decode, max(0, n - gpu_d) * k
    if route.source is not None:
        mb = moved_blocks(request, route) if moved is None else moved
        return route.source, route.prefill, mb * request.block_size * k
    return None


def t_network(
    model: CostModel, request: RequestView, route: Route, moved: int | None = None
) -> float:
    """KV moved over links, (S, D, bytes) = `kv_transfer`:
    REMOTE_PREFILL: pd_handshake_s + transfer_s(P, D, bytes);
    ARTIFACT_FETCH / STATE_MIGRATION: transfer_s(S, P, bytes);
    colocated actions: 0."""
    return _network(model, request, route, moved)[0]


def t_nic(model: CostModel, request: RequestView, route: Route, moved: int | None = None) -> float:
    """T_NIC, the time the route's transfer adds to its source node's NIC backlog
    (informational, not part of C(a); the router queues it, `WorkerView.nic_backlog_s`):
    link_s(S, D, bytes) for (S, D, bytes) = `kv_transfer` with S and D on different nodes;
    else 0."""
    return _network(model, request, route, moved)[1]


def _network(
    model: CostModel, request: RequestView, route: Route, moved: int | None
) -> tuple[float, float]:
    """(t_network, t_nic), from one `kv_transfer`."""
    moves = kv_transfer(request, route, moved)
    if moves is None:
        return 0.0, 0.0
    src, dst, nbytes = moves
    link = model.link_s(src, dst, nbytes)
    cross = nbytes > 0 and src.node != dst.node
    t = link + src.nic_backlog_s if cross else link  # model.transfer_s, link_s computed once
    return (model.config.pd_handshake_s + t if route.action is _REMOTE else t), (
        link if cross else 0.0
    )


def t_restore(
    model: CostModel,
    request: RequestView,
    route: Route,
    tiers: tuple[int, int, int] | None = None,
) -> float:
    """Bringing the prefill worker's own held prefix into HBM, `CostModel.tier_restore_s`:
    tier loads restore_s(P, max(0, cpu − gpu)·bs·K, max(0, ssd − max(gpu, cpu))·bs·K),
    or — with a KV spec and nothing in GPU (a cold resume) — planner.restore's plan for loading
    or recomputing each state type. gpu/cpu/ssd: P's longest held prefix per tier (blocks)."""
    g, c, s = tier_blocks(route.prefill) if tiers is None else tiers
    return model.tier_restore_s(route.prefill, g, c, s, request)


def m_hbm(
    model: CostModel,
    request: RequestView,
    route: Route,
    reused: int | None = None,
    held: int | None = None,
) -> float:
    """M_HBM, duplicate KV bytes the action creates:
    REMOTE_PREFILL: (N − r) · K  (P's copy of what it computed)  + dup(D, gpu(D));
    STATE_MIGRATION: moved_blocks · block_size · K  (the copy made on P; the source keeps its
    own: the router does not free it, so after the move both hold the prefix);
    otherwise (colocated, fetch): dup(P, held(P)), the fetched replica or recomputed owned prefix;
    dup(w, h) = [w ≠ owner] · max(0, owner_blocks − h) · block_size · K.
    `reused` (tokens) and `held` (held(P)) when already known."""
    if route.action is _MIG:
        return float(moved_blocks(request, route, held) * request.block_size) * (
            request.kv_bytes_per_token
        )
    if route.action is _REMOTE:
        n = max(request.prompt_tokens, 1)
        r = reused_tokens(request, route) if reused is None else reused
        gpu_d = tier_blocks(route.decode)[0]
        return float((n - r) * request.kv_bytes_per_token) + owner_duplicate_bytes(
            request, route.decode, gpu_d
        )
    h = held_blocks(route.prefill) if held is None else held
    return float(owner_duplicate_bytes(request, route.prefill, h))


def i_decode(
    model: CostModel, request: RequestView, route: Route, prefill: float | None = None
) -> float:
    """I_decode = running(P) · prefill_s(P, N − r, r): every decode running on the prefill
    worker waits for the whole prefill (0 on an idle or PREFILL worker: what runs there are
    prefills, which the queue term covers). An engine step
    computes a prefill chunk and one token of each running decode together (the emulated
    engine's step lasts decode_step_s + prefill_s of its chunk, as vLLM's does), so each of the
    running(P) decodes gets its next tokens prefill_s later. `prefill` is t_prefill when already
    computed."""
    p = route.prefill
    if p.running <= 0 or p.role is _PREFILL:
        return 0.0
    return (t_prefill(model, request, route) if prefill is None else prefill) * p.running


def h_move(model: CostModel, route: Route, others: float) -> float:
    """H_move, the hysteresis of a move: STATE_MIGRATION: migration_margin_s +
    migration_margin_rel · C₀, C₀ = the sum of the route's other terms; 0 for every other
    action. A session moves only when staying costs more than moving by this much: loads
    seen by the planner are a scrape old and swap within a tool gap, so a move that wins by
    less is as likely to be undone by the next turn (which copies the prefix back), while
    each move leaves a copy behind (M_HBM)."""
    if route.action is not _MIG:
        return 0.0
    cfg = model.config
    return cfg.migration_margin_s + cfg.migration_margin_rel * others


def evaluate(model: CostModel, request: RequestView, route: Route) -> CostBreakdown:
    """The full breakdown of C(route); `CostBreakdown.total` is C(a)."""
    return _evaluate(model, request, route, tier_blocks(route.prefill))


def _held(tiers: tuple[int, int, int]) -> int:
    g, c, s = tiers
    return g if g >= c and g >= s else (c if c >= s else s)


def _evaluate(
    model: CostModel, request: RequestView, route: Route, tiers: tuple[int, int, int]
) -> CostBreakdown:
    # every term, with the values they share (P's tiers, held, moved, reused) computed once
    cfg = model.config
    held = _held(tiers)
    moved = moved_blocks(request, route, held)
    r = reused_tokens(request, route, held + moved)
    pre = t_prefill(model, request, route, r)
    dec = t_decode(model, request, route)
    o = decode_tokens(request, cfg)
    tq = t_queue(model, request, route)
    tn, nic = _network(model, request, route, moved)
    tr = t_restore(model, request, route, tiers)
    m = m_hbm(model, request, route, r, held)
    i = i_decode(model, request, route, pre)
    h = 0.0
    if route.action is _MIG:
        # the other terms summed as CostBreakdown.total sums them
        h = h_move(model, route, tq + (pre + dec) + tn + tr + cfg.lam * m + cfg.mu * i)
    return CostBreakdown(
        tq, pre + dec, tn, tr, m, i, cfg.lam, cfg.mu, pre, dec / o if o else 0.0, h, nic
    )


def to_candidate(model: CostModel, request: RequestView, route: Route) -> Candidate:
    """The route as a `Candidate` with its full breakdown."""
    tiers = tier_blocks(route.prefill)
    held = _held(tiers)
    src = route.source
    return Candidate(
        route.action,
        route.prefill.worker_id,
        route.decode.worker_id,
        _evaluate(model, request, route, tiers),
        None if src is None else src.worker_id,
        held + moved_blocks(request, route, held),
    )


# --------------------------------------------------------------------------------------------
# The candidate set.


def colocated_action(request: RequestView, worker: WorkerView, continuation: bool) -> Action:
    """How a colocated candidate on `worker` is named: TAIL_RECOMPUTE when part of its held
    prefix must be loaded from CPU/SSD (restore the artifact, recompute the tail);
    DECODE_CONTINUATION on the session owner holding the prefix in GPU when the request is a
    decode continuation (`continuation`); else COLOCATED_PREFILL. The name never changes the
    cost: all three prefill and decode on `worker` with what it holds."""
    g, c, s = tier_blocks(worker)
    if c > g or s > g:
        return _TAIL
    if continuation and g > 0 and worker.worker_id == request.session_owner:
        return _CONT
    return _COL


def fetch_source(request: RequestView, cluster: ClusterView) -> WorkerView | None:
    """The owner to fetch from: healthy, and not the session's own decode owner (a session
    moves by STATE_MIGRATION instead of being replicated)."""
    if request.owner is None or request.owner_blocks <= 0:
        return None
    if request.owner == request.session_owner:
        return None
    w = cluster.by_id(request.owner)
    return w if w is not None and w.healthy else None


def migration_source(request: RequestView, cluster: ClusterView) -> WorkerView | None:
    """The session owner to move from: healthy and holding part of the prefix in GPU."""
    if request.session_owner is None:
        return None
    w = cluster.by_id(request.session_owner)
    if w is None or not w.healthy or tier_blocks(w)[0] <= 0:
        return None
    return w


def enumerate_routes(
    request: RequestView, cluster: ClusterView, *, continuation: bool = False
) -> list[Route]:
    """Every candidate the ownerserve policy weighs (reference enumeration, O(P·D)):
    colocated on each decode-capable worker; ARTIFACT_FETCH from the owner to each decode-capable
    worker holding less than owner_blocks; STATE_MIGRATION from the session owner to each
    decode-capable worker holding less than gpu(session owner); REMOTE_PREFILL for every
    prefill-capable P and decode-capable D ≠ P. Unhealthy workers are skipped."""
    live = [w for w in cluster.workers if w.healthy]
    src_f = fetch_source(request, cluster)
    src_m = migration_source(request, cluster)
    routes: list[Route] = []
    decoders = [w for w in live if can_decode(w)]
    for w in decoders:
        routes.append(Route(colocated_action(request, w, continuation), w, w))
        held = held_blocks(w)
        if src_f is not None and w.worker_id != src_f.worker_id and request.owner_blocks > held:
            routes.append(Route(_FETCH, w, w, src_f))
        if src_m is not None and w.worker_id != src_m.worker_id and tier_blocks(src_m)[0] > held:
            routes.append(Route(_MIG, w, w, src_m))
    for p in live:
        if not can_prefill(p):
            continue
        for d in decoders:
            if d.worker_id != p.worker_id:
                routes.append(Route(_REMOTE, p, d))
    return routes
