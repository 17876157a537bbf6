"""The planner's cost model (each formula in planner/README.md):

    C(a) = T_queue + T_compute + T_network + T_restore + λ·M_HBM + μ·I_decode + H_move

Every formula is implemented once, in `RequestCosts` (one request's terms on any worker or
route), with the formula in its docstring exactly as computed (the same formulas are in
`planner/README.md`); `evaluate` and the ownerserve policy's search both call it. Times come
from `ownerserve.profiles` timing profiles, scaled per worker by online calibration
(`WorkerView.prefill_scale/decode_scale/link_scale`). Profiles are read once when a `CostModel`
is built; evaluating a cost never does I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from ownerserve.errors import ConfigError
from ownerserve.kvfetch import FETCH_BRINGS_WINDOWS
from ownerserve.kvprobe import TransportPrice, resolve_prices, with_prices
from ownerserve.kvstate import KVStateSpec, load_spec
from ownerserve.kvstate.resume import Resume, ResumeRule, moved_windows, rebuild_s, resume_point
from ownerserve.profiles import (
    PrefillTiming,
    TimingProfile,
    TransportTiming,
    kv_transport_into,
    load_profile,
)
from ownerserve.records import fast_init
from ownerserve.types import KVTransport, Role, Tier
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

    `lam` (λ) is seconds per duplicated HBM byte, `mu` (μ) the weight of decode interference,
    `nu` (ν) the weight of the reload of displaced working-set KV (W_disp), `xi` (ξ) that of
    the KV a duplicate displaces (`RequestCosts.dup_price`, carried in W_disp);
    `migration_margin_s` and `migration_margin_rel` are the hysteresis a state migration pays
    (`h_move`).
    `profile` is the default timing profile; `profiles` are extra ones workers may name in
    `WorkerView.profile` (an unknown name falls back to the default).
    """

    lam: float = 1e-11
    mu: float = 1.0
    nu: float = 1.0
    xi: float = 1.0
    # the least reuse rate a copy's X_dup is divided by (`reuse_weight`): 1 weighs nothing
    copy_reuse_floor: float = 0.25
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
        if self.lam < 0 or self.mu < 0 or self.nu < 0 or self.xi < 0:
            raise ConfigError(
                "planner: lambda_hbm, mu_interference, nu_displacement and xi must be >= 0"
            )
        if not 0.0 < self.copy_reuse_floor <= 1.0:
            raise ConfigError("planner: copy_reuse_floor must be in (0, 1]")
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
            nu=settings.nu_displacement,
            xi=settings.xi_duplicate,
            copy_reuse_floor=settings.copy_reuse_floor,
            profile=settings.profile,
            kv_spec=kv_spec,
            migration_margin_s=settings.migration_margin_s,
            migration_margin_rel=settings.migration_margin_rel,
        )


@dataclass(frozen=True, slots=True)
class ProfileConstants:
    """A timing profile's numbers as the cost terms read them: flat, one attribute each (the
    search reads them per candidate; a slot is as cheap to read as a tuple item), built once
    per `CostModel` (`CostModel.constants`). `capacity_tokens` = hbm_kv_bytes /
    kv_bytes_per_token: the KV pool of a worker that reports none."""

    prefill_base_s: float
    prefill_per_token_s: float
    prefill_per_token_ctx_s: float
    decode_base_s: float
    decode_per_seq_s: float
    decode_per_ctx_token_s: float
    paths: Mapping[KVTransport, TransportTiming]
    """The price of each KV transport (`LinkTiming.path`)."""
    cpu_load_bps: float
    ssd_load_bps: float
    rerotate_per_token_s: float
    capacity_tokens: float
    prefill: PrefillTiming
    """The profile's prefill timing as the engine itself times it: what a hybrid model's
    resume point is decided with (`ownerserve.kvstate.resume`), unscaled by calibration."""
    hbm_kv_bytes: float = 0.0
    """The profile's HBM for KV: a request's spec sizes the pool as hbm_kv_bytes / K."""

    @classmethod
    def of(cls, p: TimingProfile) -> ProfileConstants:
        pf, dt, link = p.prefill, p.decode, p.link
        return cls(
            prefill_base_s=pf.base_s,
            prefill_per_token_s=pf.per_token_s,
            prefill_per_token_ctx_s=pf.per_token_ctx_s,
            decode_base_s=dt.base_s,
            decode_per_seq_s=dt.per_seq_s,
            decode_per_ctx_token_s=dt.per_ctx_token_s,
            paths={t: link.path(t) for t in KVTransport},
            cpu_load_bps=link.cpu_load_bps,
            ssd_load_bps=link.ssd_load_bps,
            rerotate_per_token_s=p.rerotate_per_token_s,
            capacity_tokens=p.hbm_kv_bytes / p.kv_bytes_per_token,
            prefill=pf,
            hbm_kv_bytes=float(p.hbm_kv_bytes),
        )


class CostModel:
    """The deployment's timing profiles (a worker's by `WorkerView.profile`) and KV spec, and
    cold restores into HBM (`cold_restore_s`). Built once: the terms of a request are computed
    by `RequestCosts`."""

    __slots__ = (
        "_cold",
        "_constants",
        "_default",
        "_default_constants",
        "_plans",
        "_profiles",
        "config",
        "kv_prices",
        "spec",
        "swa_policy",
    )

    _COLD_CACHE_MAX = 4096

    def __init__(
        self,
        config: CostConfig | None = None,
        profiles: Mapping[str, TimingProfile] | None = None,
        *,
        spec: KVStateSpec | None = None,
        swa_policy: SwaPolicy = DEFAULT_SWA_POLICY,
        measurements: Callable[[], Mapping[KVTransport, TransportTiming]] | None = None,
    ) -> None:
        """`measurements`: the KV transports' measured prices (`ownerserve.kvprobe.
        load_measurements` of a probe's file), read once; each replaces that transport's
        configured price in every profile, and a failed read leaves them all configured
        (`kv_prices` says which and why)."""
        self.config = config or CostConfig()
        if spec is None and self.config.kv_spec is not None:
            spec = load_spec(self.config.kv_spec)
        self.spec = spec
        self.swa_policy = swa_policy
        self._cold: dict[tuple[str, int, Tier], float] = {}
        self._plans: dict[tuple[object, ...], tuple[float, float, int]] = {}
        if profiles is None:
            names = (self.config.profile, *self.config.profiles)
            profiles = {n: load_profile(n) for n in names}
        if self.config.profile not in profiles:
            raise ConfigError(f"planner: profile {self.config.profile!r} not loaded")
        # each KV transport's price as planned (the default profile's) and its source
        self.kv_prices: tuple[TransportPrice, ...] = resolve_prices(
            profiles[self.config.profile], measurements
        )
        profiles = {n: with_prices(p, self.kv_prices) for n, p in profiles.items()}
        for p in profiles.values():
            link = p.link
            bws = (link.intra_node_bps, link.inter_node_bps, link.cpu_load_bps, link.ssd_load_bps)
            if min(bws) <= 0 or p.max_num_seqs <= 0 or p.kv_bytes_per_token <= 0:
                raise ConfigError(
                    f"profile {p.name}: bandwidths, max_num_seqs and kv_bytes_per_token must be > 0"
                )
            host = link.path(KVTransport.SAME_HOST)
            for t in (KVTransport.STORE_TCP, KVTransport.STORE_RDMA):
                store = link.path(t)
                # the remote-prefill search assumes a same-node link is never slower
                if host.bps < store.bps or host.latency_s > store.latency_s:
                    raise ConfigError(
                        f"profile {p.name}: the same_host KV transport is slower than {t.value}"
                        " (bps lower or latency_s higher)"
                    )
        self._profiles: dict[str, TimingProfile] = dict(profiles)
        self._default = self._profiles[self.config.profile]
        self._constants = {n: ProfileConstants.of(p) for n, p in self._profiles.items()}
        self._default_constants = self._constants[self.config.profile]

    @property
    def profiles(self) -> Mapping[str, TimingProfile]:
        return self._profiles

    def profile_of(self, worker: WorkerView) -> TimingProfile:
        """The worker's profile by `WorkerView.profile`; the default one if unknown."""
        return self._profiles.get(worker.profile, self._default)

    def constants(self, profile: str) -> ProfileConstants:
        """The `ProfileConstants` of a profile name; the default profile's if unknown."""
        return self._constants.get(profile, self._default_constants)

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

    def restore_plan(
        self,
        worker: WorkerView,
        spec: KVStateSpec,
        cached_tokens: int,
        tier: Tier,
        resident_tokens: int,
        path: KVTransport = KVTransport.SAME_HOST,
    ) -> tuple[float, float, int]:
        """(restore_s, load_s, loaded_bytes) of `planner.restore.plan_restore(spec,
        cached_tokens, tier, profile(worker), path=path, resident_tokens=
        resident_tokens, swa_policy=spec.swa_policy)`: a request's own spec restoring a prefix
        into `worker`'s HBM; from a GPU peer (a fetch or migration) without the front
        recompute (overlap off), so restore_s − load_s is what it recomputes. Memoised."""
        prof = self.profile_of(worker)
        key = (
            spec.name,
            spec.fingerprint,
            spec.swa_policy,
            prof.name,
            cached_tokens,
            tier,
            resident_tokens,
            path,
        )
        val = self._plans.get(key)
        if val is None:
            if len(self._plans) >= self._COLD_CACHE_MAX:
                self._plans.clear()
            plan = plan_restore(
                spec,
                cached_tokens,
                tier,
                prof,
                path=path,
                resident_tokens=resident_tokens,
                overlap=tier is not _GPU,
            )
            val = self._plans[key] = (plan.restore_s, plan.load_s, plan.loaded_bytes)
        return val


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


def pd_pair(p: WorkerView, d: WorkerView) -> bool:
    """P and D can execute a remote prefill: both speak one P/D hand-over (`pd_group`)."""
    return p.pd_group is not None and p.pd_group == d.pd_group


def tier_blocks(worker: WorkerView) -> tuple[int, int, int]:
    """(gpu, cpu, ssd): longest prefix of the request's chain the worker holds in each tier."""
    cb = worker.cached_blocks
    if not cb:
        return 0, 0, 0
    return cb.get(_GPU, 0), cb.get(_CPU, 0), cb.get(_SSD, 0)


def gpu_blocks(worker: WorkerView) -> int:
    """gpu(w): longest prefix of the request's chain the worker holds in GPU."""
    cb = worker.cached_blocks
    return cb.get(_GPU, 0) if cb else 0


def held_blocks(worker: WorkerView) -> int:
    """Longest prefix the worker can reuse from any of its tiers: max(gpu, cpu, ssd)."""
    g, c, s = tier_blocks(worker)
    return g if g >= c and g >= s else (c if c >= s else s)


def decode_tokens(request: RequestView, config: CostConfig) -> int:
    """O = min(max_tokens, decode_horizon_tokens): decode steps counted in T_compute."""
    o = request.max_tokens
    h = config.decode_horizon_tokens
    if o > h:
        o = h
    return o if o > 0 else 0


# --------------------------------------------------------------------------------------------
# The cost terms: one implementation, per request.

KV_NEVER_S = 1e6
"""The KV wait of a worker whose whole pool cannot hold the request's KV: it would refuse the
request (a 400), so every route through it loses to any route that can run."""
PROGRAMS_CLOSED_S = 1e3
"""Added to the queue of a worker closed to programs (`WorkerView.programs_closed`) for a
request whose session's KV is not counted there: a new or resumed program goes to a worker
with room in its working set, as ThunderAgent resumes onto the roomiest, unless none has."""


class ChunkFetch(NamedTuple):
    """A prefill that fetches the request's chunks it lacks (`RequestCosts.chunk_fetch`)."""

    prefill_s: float
    """prefill_s with the fetch."""
    fetches: tuple[tuple[int, str], ...]
    """The chunks fetched (indices into `RequestView.chunk_spans`), each with its holder."""


class HeldTerms(NamedTuple):
    """What a worker w holding part of the request's prefix (or chunks of it) adds to its
    terms."""

    gpu: int
    """gpu(w): the prefix's blocks in its GPU."""
    held: int
    """held(w) = max(gpu, cpu, ssd)."""
    reused: int
    """r = reused(resumed(w))."""
    restore_s: float
    """restore(w, gpu, cpu, ssd), with a hybrid spec's window rebuild at a GPU hit."""
    dup_gpu: float
    """dup(w, gpu(w))."""
    resumed: int
    """resumed(w): the blocks its prefill starts from (held(w), or where a hybrid model's GPU
    hit resumes: `RequestCosts.resume_gpu`)."""


class WorkerTerms(NamedTuple):
    """What one worker w costs the request whatever the route (`RequestCosts.worker`; a row
    of `ScanTerms`). `held` is None when w holds nothing of the prefix nor of its chunks
    (gpu = held = r = 0, no restore, dup(w, gpu) = dup(w, held)). The search adds W_disp
    wherever it adds q (both are charged once per worker of a route), so `queue_s` carries
    both."""

    worker: WorkerView
    queue_s: float
    """q(w) + W_disp(w)."""
    decode_s: float
    """decode(w)."""
    prefill_s: float
    """prefill(w, r) on what w holds itself."""
    stalled: int
    """stalled(w)."""
    dup: float
    """dup(w, held(w))."""
    held: HeldTerms | None
    w_disp_s: float
    """W_disp(w)."""


class ScanTerms:
    """`RequestCosts.scan` of a sequence of workers: `WorkerTerms` as columns, item i of
    each column that of `workers[i]` (`row(i)`). `holds[i]`: `workers[i]` holds part of the
    prefix or chunks of the request, and item i of the `HeldTerms` columns (`gpu`, `held`,
    `reused`, `restore_s`, `dup_gpu`, `resumed`) is its; they are set only there (and are
    empty when no worker holds anything).

    Columns, not a record per worker: a record costs more to build than a worker's terms,
    and a list is appended to (or, for what few workers have, set in place) for less. A
    `__slots__` class that nothing writes after `__init__`: a slot is read as fast as a tuple
    item (a NamedTuple's field is a descriptor call, ~10x), and a frozen dataclass's
    `__init__` costs ~2x a plain one's."""

    __slots__ = (
        "decode_s",
        "dup",
        "dup_gpu",
        "gpu",
        "held",
        "holds",
        "prefill_s",
        "queue_s",
        "restore_s",
        "resumed",
        "reused",
        "stalled",
        "w_disp_s",
        "workers",
    )

    def __init__(
        self,
        workers: Sequence[WorkerView],
        queue_s: list[float],
        decode_s: list[float],
        prefill_s: list[float],
        stalled: list[int],
        dup: list[float],
        w_disp_s: list[float],
        holds: list[bool],
        gpu: list[int],
        held: list[int],
        reused: list[int],
        restore_s: list[float],
        dup_gpu: list[float],
        resumed: list[int],
    ) -> None:
        self.workers = workers
        self.queue_s = queue_s
        self.decode_s = decode_s
        self.prefill_s = prefill_s
        self.stalled = stalled
        self.dup = dup
        self.w_disp_s = w_disp_s
        self.holds = holds
        self.gpu = gpu
        self.held = held
        self.reused = reused
        self.restore_s = restore_s
        self.dup_gpu = dup_gpu
        self.resumed = resumed

    def held_terms(self, i: int) -> HeldTerms | None:
        """The `HeldTerms` of `workers[i]`; None when it holds nothing."""
        if not self.holds[i]:
            return None
        return HeldTerms(
            self.gpu[i],
            self.held[i],
            self.reused[i],
            self.restore_s[i],
            self.dup_gpu[i],
            self.resumed[i],
        )

    def row(self, i: int) -> WorkerTerms:
        """The terms of `workers[i]`."""
        return WorkerTerms(
            self.workers[i],
            self.queue_s[i],
            self.decode_s[i],
            self.prefill_s[i],
            self.stalled[i],
            self.dup[i],
            self.held_terms(i),
            self.w_disp_s[i],
        )


class RequestCosts:
    """The cost terms of one request on any worker or route: the one implementation of every
    formula of C(a). `evaluate` (a route's full breakdown) and the ownerserve policy's search
    both call it. What depends only on the request and a timing profile is computed once per
    run of workers sharing the profile (`scan`), so a term on one worker is a few
    multiplications.

    Notation (planner/README.md): N = prompt tokens (at least 1), bs = block size, K =
    kv_bytes_per_token, or with the request's KV spec σ (`RequestView.kv_spec`) its sealed
    rate σ.bytes_per_token(); M(N) = σ.mutable_bytes(N) (windows and tail at N; 0 without
    a spec); O = `decode_tokens`; s_p, s_d, s_l = the worker's prefill_scale, decode_scale,
    link_scale."""

    __slots__ = (
        "_constants",
        "_default_constants",
        "bk",
        "chunk_src",
        "config",
        "k",
        "lam",
        "limit",
        "model",
        "mu",
        "mutable",
        "n",
        "nu",
        "o",
        "ob",
        "owner",
        "request",
        "rule",
        "spec",
        "xi",
        "xi_fetch",
        "xi_prompt",
    )

    def __init__(
        self, model: CostModel, request: RequestView, cluster: ClusterView | None = None
    ) -> None:
        cfg = model.config
        self.model = model
        self.request = request
        self.config = cfg
        self.n = request.prompt_tokens if request.prompt_tokens > 1 else 1
        self.o = decode_tokens(request, cfg)
        spec = self.spec = request.kv_spec
        self.k: float = request.kv_bytes_per_token if spec is None else spec.bytes_per_token()
        self.mutable = 0 if spec is None else spec.mutable_bytes(self.n)
        rule = None if spec is None else ResumeRule.of(spec, request.block_size)
        self.rule: ResumeRule | None = rule if rule is not None and rule.hybrid else None
        """The spec's resume rule when it has mutable state (windows, tails); None: every
        hit resumes at its sealed blocks."""
        self.limit = (self.n - 1) // request.block_size
        """(N − 1) // bs: the most prompt blocks an engine reuses (it computes the last
        token)."""
        self.bk = request.block_size * self.k
        self.owner = request.owner
        self.ob = request.owner_blocks if request.owner is not None else 0
        self.lam = cfg.lam
        self.mu = cfg.mu
        self.nu = cfg.nu
        self.xi = cfg.xi
        floor = cfg.copy_reuse_floor
        self.xi_fetch = cfg.xi * reuse_weight(request.fetch_reuse, floor)
        """ξ · ω(u_fetch): X_dup's weight for a fetch's replica (`fetch_price`)."""
        self.xi_prompt = cfg.xi * reuse_weight(request.prompt_reuse, floor)
        """ξ · ω(u_prompt): X_dup's weight for a remote prefill's prompt kept on P."""
        # `CostModel.constants`, inline (a lookup per worker run and per candidate's link)
        self._constants = model._constants
        self._default_constants = model._default_constants
        self.chunk_src: tuple[tuple[WorkerView, ...], ...] = (
            chunk_sources(request, cluster) if request.chunk_spans and cluster is not None else ()
        )
        """Per chunk of the request, the workers a prefill worker may fetch its KV from
        (`chunk_sources`); () when no chunk has one (no cluster given: none)."""

    def constants(self, profile: str) -> ProfileConstants:
        """`CostModel.constants` of a profile name (unknown → the default profile)."""
        return self._constants.get(profile, self._default_constants)

    def worker(self, w: WorkerView) -> WorkerTerms:
        """What w costs this request whatever the route (`scan` of w alone)."""
        return self.scan((w,)).row(0)

    def scan(self, workers: Sequence[WorkerView]) -> ScanTerms:
        """What each worker costs this request whatever the route (`ScanTerms`, in order), with
        each profile's constants looked up once per run of workers sharing it. The search takes
        every worker's terms from one call (a call per worker would cost more than the terms
        themselves; lists, as a generator's resumptions cost more than their appends):

            q(w)       = s_p · (per_token_s · inflight_prefill_tokens + base_s · waiting)
                         + kv_wait(w, gpu(w), decode(w))
                         + PROGRAMS_CLOSED_S if programs_closed(w) and w ≠ home_worker
            decode(w)  = O · decode_step_s(w, running + 1, ctx(w) + N)
                       = s_d · O · (base_s + per_seq_s · (running + 1) + per_ctx_token_s ·
                         (ctx(w) + N)),  ctx(w) = kv_usage · cap(w), cap(w) =
                         kv_capacity_tokens, else hbm_kv_bytes / kv_bytes_per_token;
                         the column holds decode(w) + μ·B(w) (`batch_s`: what joining
                         w's batch costs the decodes running there), which `_breakdown`
                         reports in I_decode
            prefill    = prefill(w, r): the prompt on top of what w holds itself,
                         r = reused(resumed(w)), and of the request's chunks it holds;
                         resumed(w) = held(w), or for a hybrid spec's GPU hit (held = gpu)
                         the blocks of `resume_gpu`
            stalled(w) = running(w), or 0 on a PREFILL worker (its running requests are
                         prefills): the decodes a prefill on w stalls (I_decode)
            restore    = restore(w, gpu, cpu, ssd): its held prefix into HBM; at a
                         hybrid spec's GPU hit, `resume_gpu`'s window rebuild
            dup        = dup(w, held(w)) and dup(w, gpu(w))
            W_disp(w)  = displacement(w, gpu(w)): the reload of the working-set KV its new
                         KV pushes out (0 on most workers: the room test is inline),
                         + dup_price(w, dup(w, held(w))): what its duplicate displaces
        """
        n, bs, ob, bk, owner = self.n, self.request.block_size, self.ob, self.bk, self.owner
        o = self.o
        home, home_tokens = self.request.home_worker, self.request.home_tokens
        grown = n + o + self.request.growth_tokens  # W_disp's room test
        disp_on = self.nu > 0
        dup_on = self.xi > 0
        dup_none = _dup(True, 0, ob, bk)  # dup(w, 0) of a non-owner (0 without an owner)
        seq = n + o  # the KV the request needs on a worker holding none of it
        fetchable = bool(self.chunk_src)  # a prefill may fetch chunks it lacks
        profile: str | None = None
        c = self._default_constants
        pbase = ptok = da = db = dc = dx = pf_all = cap_p = 0.0
        mu = self.mu
        qs: list[float] = []
        decs: list[float] = []
        pfs: list[float] = []
        stalls: list[int] = []
        dups: list[float] = []
        # what few workers have is set by index (that of the worker's item in `qs`, appended
        # last): their displacement, and what holders hold (`ScanTerms.holds`; its columns
        # are made with the first holder)
        n_w = len(workers)
        disps = [0.0] * n_w
        holds = [False] * n_w
        gpus: list[int] = []
        helds: list[int] = []
        reuses: list[int] = []
        restores: list[float] = []
        dup_gpus: list[float] = []
        resumes: list[int] = []
        rule = self.rule
        for w in workers:
            if w.profile is not profile:
                profile = w.profile
                c = self.constants(profile)
                pbase = c.prefill_base_s
                ptok = c.prefill_per_token_s
                cap_p = c.capacity_tokens if self.spec is None else c.hbm_kv_bytes / self.k
                # decode(w) = s_d · (da + db · running + dc · ctx(w)); pf_all: the whole
                # prompt on nothing, at scale 1
                da = o * (c.decode_base_s + c.decode_per_seq_s + c.decode_per_ctx_token_s * n)
                db = o * c.decode_per_seq_s
                dc = o * c.decode_per_ctx_token_s
                pf_all = _prefill_base(c, n, 0)
                # μ·B(w) = μ · s_d · stalled(w) · dx: what joining w's decode batch adds to
                # the decodes running there (`batch_s`)
                dx = mu * (db + dc * n)
            sp = w.prefill_scale
            running = w.running
            inflight = w.inflight_prefill_tokens
            usage = w.kv_usage
            q = sp * (ptok * inflight + pbase * w.waiting)
            cap = w.kv_capacity_tokens or cap_p
            dec = w.decode_scale * (da + db * running + dc * usage * cap)
            stalled = running if running > 0 and w.role is not _PREFILL else 0
            cb = w.cached_blocks
            ch = w.chunks_held
            # the room tests of kv_wait and W_disp, inline: most workers have room and pay
            # nothing more
            if cap * (1.0 - usage) - inflight < seq:
                q += self.kv_wait(w, cb.get(_GPU, 0) if cb else 0, dec, cap_p)
            if stalled and dx:  # after kv_wait, which prices the request's own decode
                dec += w.decode_scale * stalled * dx
            ws = w.ws_tokens
            if ws and w.worker_id == home:
                ws -= home_tokens
            if w.programs_closed and w.worker_id != home:
                q += PROGRAMS_CLOSED_S
            if disp_on and ws > 0 and cap - ws < grown:
                disp = self.displacement(w, cb.get(_GPU, 0) if cb else 0, ws, cap, c)
                q += disp
                disps[len(qs)] = disp
            qs.append(q)
            decs.append(dec)
            stalls.append(stalled)
            if cb or ch:
                if cb:
                    g, cpu, ssd = cb.get(_GPU, 0), cb.get(_CPU, 0), cb.get(_SSD, 0)
                    held = g if g >= cpu and g >= ssd else (cpu if cpu >= ssd else ssd)
                else:
                    g = cpu = ssd = held = 0
                if held or ch:
                    resumed = held
                    rebuild = 0.0
                    if rule is not None and g == held and held:
                        resumed, rebuild = self.resume_gpu(w, g, c)
                    r = _reused(resumed, bs, n) if resumed else 0
                    other = w.worker_id != owner
                    dh = _dup(other, held, ob, bk)
                    pfs.append(
                        self.prefill(w, r, c) if ch or fetchable else sp * _prefill_base(c, n, r)
                    )
                    dups.append(dh)
                    if dh and dup_on:
                        xd = self.dup_price(w, dh, ws, cap, c)
                        if xd:
                            qs[-1] += xd
                            disps[len(qs) - 1] += xd
                    if not gpus:
                        gpus, helds, reuses = [0] * n_w, [0] * n_w, [0] * n_w
                        restores, dup_gpus, resumes = [0.0] * n_w, [0.0] * n_w, [0] * n_w
                    j = len(qs) - 1
                    holds[j] = True
                    gpus[j] = g
                    helds[j] = held
                    reuses[j] = r
                    restores[j] = self.restore(w, g, cpu, ssd, c) if held > g else rebuild
                    dup_gpus[j] = dh if g == held else _dup(other, g, ob, bk)
                    resumes[j] = resumed
                    continue
            pfs.append(self.prefill(w, 0, c) if fetchable else sp * pf_all)
            if dup_none and w.worker_id != owner:
                dups.append(dup_none)
                if dup_on:
                    xd = self.dup_price(w, dup_none, ws, cap, c)
                    if xd:
                        qs[-1] += xd
                        disps[len(qs) - 1] += xd
            else:
                dups.append(0)
        return ScanTerms(
            workers,
            qs,
            decs,
            pfs,
            stalls,
            dups,
            disps,
            holds,
            gpus,
            helds,
            reuses,
            restores,
            dup_gpus,
            resumes,
        )

    def batch_s(self, w: WorkerView) -> float:
        """B(w): the seconds joining w's decode batch adds to the decodes running there,
        stalled(w) · s_d · O · (per_seq_s + per_ctx_token_s · N) (each of them steps with one
        more sequence of N tokens' context, for as long as this request's O tokens at most);
        0 on a PREFILL worker. `scan`'s decode column carries μ·B(w)."""
        running = w.running
        if running <= 0 or w.role is _PREFILL:
            return 0.0
        c = self.constants(w.profile)
        return (
            w.decode_scale
            * running
            * self.o
            * (c.decode_per_seq_s + c.decode_per_ctx_token_s * self.n)
        )

    def kv_wait(self, w: WorkerView, gpu: int, decode: float, cap_p: float) -> float:
        """kv_wait(w): how long the request waits on w for room for its KV (vLLM admits a
        request only when its whole sequence fits, after evicting idle cached blocks):

            need = N + O − gpu(w)·bs              the KV it allocates on w
            cap  = kv_capacity_tokens(w), else hbm_kv_bytes / K (`cap_p`)
            used = kv_usage(w)·cap + inflight_prefill_tokens(w)
            kv_wait = 0                              need ≤ cap − used
                    = KV_NEVER_S                     need > cap (w refuses it)
                    = (need − (cap − used)) / used · decode(w)   otherwise

        The shortage must be freed by running requests finishing; a running request takes
        about as long as this one's decode, and frees its share of `used`."""
        cap = w.kv_capacity_tokens or cap_p
        need = self.n + self.o - gpu * self.request.block_size
        used = w.kv_usage * cap + w.inflight_prefill_tokens
        short = need - (cap - used)
        if short <= 0:
            return 0.0
        if need > cap or used <= 0:
            return KV_NEVER_S
        return short / used * decode

    def displacement(
        self, w: WorkerView, gpu: int, others: int, cap: float, c: ProfileConstants
    ) -> float:
        """W_disp(w): the reload of the other sessions' working-set KV that this request's KV
        pushes out of w (under KV pressure a placement where the request does not fit evicts KV that
        sessions active on w will want back within their tool gap):

            need   = N + O + growth − gpu(w)·bs        the KV it allocates on w (kv_wait's need)
                                                       and what the session is expected to
                                                       add later (`growth_tokens`)
            others = ws_tokens(w) − [w = home_worker]·home_tokens
            disp   = min(others, need − (cap − others))   tokens displaced, when positive
            W_disp = ν · reload(w, disp)
            reload = s_p · (per_token_s + per_token_ctx_s · disp / 2) · disp     recomputed
                   = min(that, disp · K / cpu_load_bps)                          w offloads

        `cap` as kv_wait's; `c`: the constants of w's profile."""
        need = self.n + self.o + self.request.growth_tokens - gpu * self.request.block_size
        disp = need - (cap - others)
        if disp <= 0:
            return 0.0
        if disp > others:
            disp = others
        reload = (
            w.prefill_scale * (c.prefill_per_token_s + c.prefill_per_token_ctx_s * disp / 2) * disp
        )
        if w.offloads:
            load = disp * self.k / c.cpu_load_bps
            if load < reload:
                reload = load
        return self.nu * reload

    def dup_price(
        self,
        w: WorkerView,
        dup_bytes: float,
        others: int,
        cap: float,
        c: ProfileConstants,
        weight: float | None = None,
    ) -> float:
        """X_dup(w): what a duplicate of `dup_bytes` on w costs in the KV it displaces there.
        A copy of a prefix another worker holds adds nothing a sticky route would not have:
        the difference between the two routes' KV on their workers is the copy, so the copy's
        share of evictions is its true price (λ·M_HBM stays the small cost of holding it):

            d      = dup_bytes / K                          tokens of the copy
            busy   = max(kv_usage · cap + inflight_prefill_tokens, others, cached_tokens)
            ρ(w)   = min(1, busy / cap)                     share of w's pool that is reusable
                                                            (running KV, a working set, or
                                                            the idle prefix cache)
            X_dup  = ξ · reload(w, ρ(w) · d)                reload as W_disp's: the copy's
                                                            ρ(w)·d tokens that land on it
                                                            (`weight` in place of ξ: a kind
                                                            of copy weighed by its reuse)

        ~0 on an empty pool, the copy's recompute on a full one; a pool full of idle cached
        prefixes is full (the copy evicts them). `others` = ws_tokens(w) −
        [w = home_worker]·home_tokens, `cap` and `c` as `displacement`'s. The search charges it
        with W_disp, once per worker of a route; on a remote prefill's P also for its transient
        prompt copy (`copy_price`)."""
        if cap <= 0:
            return 0.0
        busy = w.kv_usage * cap + w.inflight_prefill_tokens
        if others > busy:
            busy = others
        if w.cached_tokens > busy:
            busy = w.cached_tokens
        rho = busy / cap
        if rho <= 0.0:
            return 0.0
        if rho > 1.0:
            rho = 1.0
        d = rho * dup_bytes / self.k
        reload = w.prefill_scale * (c.prefill_per_token_s + c.prefill_per_token_ctx_s * d / 2) * d
        if w.offloads:
            load = d * self.k / c.cpu_load_bps
            if load < reload:
                reload = load
        return (self.xi if weight is None else weight) * reload

    def copy_price(self, w: WorkerView, r: int, dup_bytes: float) -> float:
        """copy(P): what the transient copy of the prompt a remote prefill from P keeps
        (`prompt_copy(r)`, r reused tokens) displaces there, beyond the X_dup of its part of
        the owned prefix (`dup_bytes` = dup(P, held(P))) that q(P) already carries:

            copy(P) = max(0, X_dup_prompt(P, prompt_copy(r)) − X_dup(P, dup(P, held(P))))

        X_dup_prompt = ω(u_prompt) · X_dup: the copy weighed by how often the prompts remote
        prefills keep on P are hit again (`prompt_reuse`, `reuse_weight`).

        A colocated route leaves the prompt's KV once; P→D leaves it on P and D. `others`,
        `cap` as `dup_price`'s; 0 when ξ = 0."""
        if self.xi <= 0:
            return 0.0
        c = self.constants(w.profile)
        cap = w.kv_capacity_tokens or (
            c.capacity_tokens if self.spec is None else c.hbm_kv_bytes / self.k
        )
        others = w.ws_tokens
        if others and w.worker_id == self.request.home_worker:
            others -= self.request.home_tokens
        x = self.dup_price(w, self.prompt_copy(r), others, cap, c, self.xi_prompt)
        if dup_bytes and x > 0.0:
            x -= self.dup_price(w, dup_bytes, others, cap, c)
        return x if x > 0.0 else 0.0

    def fetch_price(self, w: WorkerView, dup_bytes: float, c: ProfileConstants) -> float:
        """fetch(P): what an artifact fetch's replica on P (`dup_bytes` = dup(P, held(P)))
        displaces beyond the X_dup q(P) already carries for that copy:

            fetch(P) = (ω(u_fetch) − 1) · X_dup(P, dup(P, held(P)))

        so that the replica pays ω(u_fetch) · X_dup in all: weighed by how often fetched
        replicas are hit again (`fetch_reuse`, `reuse_weight`). `c`: the constants of w's
        profile; 0 when ξ = 0 or u_fetch = 1."""
        extra = self.xi_fetch - self.xi
        if extra <= 0.0 or dup_bytes <= 0:
            return 0.0
        cap = w.kv_capacity_tokens or (
            c.capacity_tokens if self.spec is None else c.hbm_kv_bytes / self.k
        )
        others = w.ws_tokens
        if others and w.worker_id == self.request.home_worker:
            others -= self.request.home_tokens
        return self.dup_price(w, dup_bytes, others, cap, c, extra)

    def restore(
        self, w: WorkerView, gpu: int, cpu: int, ssd: int, c: ProfileConstants | None = None
    ) -> float:
        """T_restore of w holding the request's prefix up to `gpu`/`cpu`/`ssd` blocks (`c`: the
        constants of w's profile, when at hand): 0 when the GPU copy is the longest; with the
        request's KV spec σ, every restore is planned by planner.restore:
        CostModel.restore_plan(w, σ, min(max(cpu, ssd)·bs, N − 1), SSD if ssd > cpu else CPU,
        resident = gpu·bs).restore_s; else with the deployment's KV spec and nothing in GPU,
        CostModel.cold_restore_s(w, min(max(cpu, ssd)·bs, N − 1), SSD if ssd > cpu else CPU);
        otherwise restore_s(w, max(0, cpu − gpu)·bs·K, max(0, ssd − max(gpu, cpu))·bs·K),
        restore_s(w, cpu_bytes, ssd_bytes) = cpu_bytes / cpu_load_bps + ssd_bytes /
        ssd_load_bps (of w's profile)."""
        if cpu <= gpu and ssd <= gpu:
            return 0.0
        spec = self.spec
        if spec is not None:
            held = cpu if cpu >= ssd else ssd
            cached = _reused(held, self.request.block_size, self.n)
            resident = gpu * self.request.block_size
            tier = _SSD if ssd > cpu else _CPU
            return self.model.restore_plan(w, spec, cached, tier, resident)[0]
        if self.model.spec is not None and gpu == 0:
            held = cpu if cpu >= ssd else ssd
            cached = _reused(held, self.request.block_size, self.n)
            return self.model.cold_restore_s(w, cached, _SSD if ssd > cpu else _CPU)
        if c is None:
            c = self.constants(w.profile)
        bk = self.bk
        gc = cpu if cpu > gpu else gpu
        return (gc - gpu) * bk / c.cpu_load_bps + (
            ssd - gc if ssd > gc else 0
        ) * bk / c.ssd_load_bps

    def resume_gpu(self, w: WorkerView, gpu: int, c: ProfileConstants) -> tuple[int, float]:
        """(blocks, seconds) of a hybrid spec's GPU hit of `gpu` blocks on w: where the
        engine resumes it (`ownerserve.kvstate.resume.resume_point` with σ's rule, the
        engine's own prefill timing of w's profile `c`, windows at w's restorable boundary
        `restorable_blocks`, both capped at (N − 1) // bs) and the window rebuild it pays,
        s_p · (prefill_s(R, S − R) − base_s) for R rebuilt tokens at S = blocks·bs (0 when
        cached or cut back; a worker that never rebuilds windows, `rebuilds_windows` off,
        only cuts back). A worker whose restorable boundary is not known resumes at `gpu`
        with nothing rebuilt (its HBM taken to keep every boundary's windows)."""
        k = w.restorable_blocks
        rule = self.rule
        if k is None or rule is None:
            return gpu, 0.0
        res = resume_point(rule, c.prefill, gpu, k, limit=self.limit, rebuild=w.rebuilds_windows)
        return self._priced(w, c, res)

    def resume_moved(
        self, w: WorkerView, held: int, moved: int, c: ProfileConstants | None = None
    ) -> tuple[int, float]:
        """(blocks, seconds) of a hybrid spec's hit on w after a fetch or migration brings
        `moved` sealed blocks on top of the `held` it holds: `resume_point` over held + moved
        sealed blocks, windows where w holds them (`restorable_blocks`, at most gpu(w); its
        GPU hit when not known) or at the moved boundary if a fetch brought them
        (`ownerserve.kvfetch.FETCH_BRINGS_WINDOWS`: it does not), capped at (N − 1) // bs;
        the seconds are the window rebuild, as `resume_gpu`'s. Without a hybrid rule:
        (held + moved, 0)."""
        rule = self.rule
        if rule is None or moved <= 0:
            return held + moved, 0.0
        if c is None:
            c = self.constants(w.profile)
        k = w.restorable_blocks
        g = gpu_blocks(w)
        own = g if k is None or k > g else k
        sealed = held + moved
        windows = moved_windows(own, sealed, FETCH_BRINGS_WINDOWS)
        res = resume_point(
            rule, c.prefill, sealed, windows, limit=self.limit, rebuild=w.rebuilds_windows
        )
        return self._priced(w, c, res)

    def _priced(self, w: WorkerView, c: ProfileConstants, res: Resume) -> tuple[int, float]:
        """(blocks, seconds) of a resume point on w: its blocks and the window rebuild it
        pays, s_p · rebuild_s(R, blocks · bs) (0 when nothing is rebuilt)."""
        if not res.rebuild_tokens:
            return res.blocks, 0.0
        return res.blocks, w.prefill_scale * rebuild_s(
            c.prefill, res.rebuild_tokens, res.blocks * self.request.block_size
        )

    def peer_restore(
        self,
        w: WorkerView,
        src: WorkerView,
        held: int,
        moved: int,
        c: ProfileConstants | None = None,
    ) -> tuple[float, float, float]:
        """(T_network, T_restore, bytes) of `moved` prefix blocks coming from the GPU of `src`
        into w, which holds `held` blocks of the prefix (an artifact fetch or a state
        migration; `c`: the constants of w's profile, when at hand):

            without a spec:  bytes = moved·bs·K, T_network = transfer_s(src, w, bytes)
                             + [moved > 0]·handover_s(w), T_restore = 0
            with a hybrid σ: bytes = σ.sealed_bytes(held·bs, (held + moved)·bs) (a fetch
                             brings the sealed blocks only, `FETCH_BRINGS_WINDOWS`),
                             T_network = transfer_s(src, w, bytes) + handover_s(w),
                             T_restore = the window rebuild of `resume_moved` (0 when w
                             resumes at its own windows)
            with σ without mutable state (a dense or MLA spec):
                             plan = CostModel.restore_plan(w, σ, r, GPU, resident = held·bs,
                             path(src, w)), r = min((held + moved)·bs, N − 1): the sealed blocks
                             and the windows at the boundary load (a GPU holder keeps its
                             windows), the incomplete block is recomputed (or all of it, when
                             that is cheaper); bytes = plan's loaded bytes, T_network =
                             transfer_s(src, w, bytes) + [moved > 0]·handover_s(w), T_restore =
                             plan.restore_s − plan.load_s (what it recomputes)"""
        if moved <= 0:
            return 0.0, 0.0, 0.0
        spec = self.spec
        if spec is None:
            nbytes: float = moved * self.bk
            return self.transfer_s(src, w, nbytes, c) + w.handover_s, 0.0, nbytes
        bs = self.request.block_size
        if self.rule is not None:
            end = (held + moved) * bs
            sealed = spec.sealed_bytes(held * bs, end)
            if FETCH_BRINGS_WINDOWS:
                sealed += spec.mutable_bytes(end)
            _, rebuilt = self.resume_moved(w, held, moved, c)
            return self.transfer_s(src, w, sealed, c) + w.handover_s, rebuilt, float(sealed)
        r = _reused(held + moved, bs, self.n)
        restore_s, load_s, loaded = self.model.restore_plan(
            w,
            spec,
            r,
            _GPU,
            held * bs,
            kv_transport_into(src.node == w.node, w.kv_same_host, w.kv_transport),
        )
        tn = self.transfer_s(src, w, loaded, c) + w.handover_s if loaded else w.handover_s
        return tn, restore_s - load_s, float(loaded)

    def reused(self, blocks: int) -> int:
        """r = min(blocks · bs, N − 1): tokens reused from `blocks` held prefix blocks; the last
        prompt token is always computed."""
        return _reused(blocks, self.request.block_size, self.n)

    def prefill(self, w: WorkerView, r: int, c: ProfileConstants | None = None) -> float:
        """prefill_s(w, N − r, r) = s_p · `prefill_base`: computing the prompt on top of r
        reused tokens (`c`: the constants of w's profile, when at hand). On a worker holding
        u = `chunk_reuse(w, r)` > 0 tokens of the request's chunks past them:
        s_p · (prefill_base(r + u) + rerotate_per_token_s · u) — the chunks are copied and
        re-rotated, not computed, and are context for the rest. When w may fetch chunks it
        lacks from their holders (`chunk_fetch`), the lesser of that and the fetch's."""
        if c is None:
            c = self.constants(w.profile)
        sp = w.prefill_scale
        if w.chunks_held:
            u = self.chunk_reuse(w, r)
            pf = sp * (
                self.prefill_base(c, r + u) + c.rerotate_per_token_s * u
                if u
                else self.prefill_base(c, r)
            )
        else:
            pf = sp * self.prefill_base(c, r)
        if self.chunk_src:
            fetched = self.chunk_fetch(w, r, c)
            if fetched is not None and fetched.prefill_s < pf:
                return fetched.prefill_s
        return pf

    def chunk_fetch(
        self, w: WorkerView, r: int, c: ProfileConstants | None = None
    ) -> ChunkFetch | None:
        """The `ChunkFetch` (prefill_s with the fetch, the chunks fetched with their holders)
        of w fetching
        every chunk of the request past its first r tokens that it lacks and a holder serves
        (`chunk_src`; w needs a KV API); None when there is none:

            F(w, r)   = the chunks i ∉ chunks_held(w) with hi_i > r and a holder; each comes
                        from its first holder on w's node, else its first holder
            u'        = chunk tokens past r of chunks_held(w) ∪ F (`chunk_reuse`'s sum, capped)
            fetch_s   = max over holders h of transfer_s(h → w, Σ_{i ∈ F from h}
                        (hi_i − lo_i) · K) + handover_s(w)   (one pull per holder, concurrent)
            prefill_s = fetch_s + s_p · (prefill_base(r + u') + rerotate_per_token_s · u')

        `prefill` takes the lesser of this and recomputing them (per request, not per
        chunk)."""
        src = self.chunk_src
        if not src or not w.chunk_api:
            return None
        spans = self.request.chunk_spans
        held = w.chunks_held
        wid, node = w.worker_id, w.node
        # per holder (by id): the worker, and the tokens of the chunks fetched from it
        holder: dict[str, WorkerView] = {}
        tokens: dict[str, int] = {}
        picks: list[tuple[int, str]] = []
        for i, holders in enumerate(src):
            if not holders or i in held:
                continue
            lo, hi = spans[i]
            if hi <= r:
                continue
            h = None
            for x in holders:
                if x.worker_id != wid:
                    if x.node == node:
                        h = x
                        break
                    if h is None:
                        h = x
            if h is None:
                continue
            picks.append((i, h.worker_id))
            holder[h.worker_id] = h
            tokens[h.worker_id] = tokens.get(h.worker_id, 0) + (hi - lo)
        if not picks:
            return None
        if c is None:
            c = self.constants(w.profile)
        k = self.k
        fetch_s = 0.0
        for hid, h in holder.items():
            t = self.transfer_s(h, w, tokens[hid] * k, c)
            if t > fetch_s:
                fetch_s = t
        fetch_s += w.handover_s
        u = self._chunk_tokens((*held, *(i for i, _ in picks)), r)
        pf = w.prefill_scale * (self.prefill_base(c, r + u) + c.rerotate_per_token_s * u)
        return ChunkFetch(fetch_s + pf, tuple(picks))

    def chunk_reuse(self, w: WorkerView, r: int) -> int:
        """u(w, r) = min(N − 1 − r, Σ over the request's chunks [lo, hi) w holds of
        max(0, hi − max(lo, r))): the chunk tokens past the first r that w copies instead of
        computing (the last prompt token is always computed)."""
        return self._chunk_tokens(w.chunks_held, r)

    def _chunk_tokens(self, chunks: Iterable[int], r: int) -> int:
        spans = self.request.chunk_spans
        total = 0
        for i in chunks:
            if 0 <= i < len(spans):
                lo, hi = spans[i]
                if hi > r:
                    total += hi - (lo if lo > r else r)
        cap = self.n - 1 - r
        return total if total < cap else (cap if cap > 0 else 0)

    def prefill_base(self, c: ProfileConstants, r: int) -> float:
        """prefill_s(N − r, r) of a profile (`c`) at scale 1: base_s + per_token_s·new +
        per_token_ctx_s·new·(r + new/2), new = N − r."""
        return _prefill_base(c, self.n, r)

    def prompt_copy(self, r: int) -> float:
        """(N − r)·K + M(N): the bytes of the prompt a remote prefill worker reusing r tokens
        computes and holds until they move to D (its transient copy, M_HBM)."""
        return (self.n - r) * self.k + self.mutable

    def kv_to_decode(self, gpu_d: int) -> float:
        """max(0, N − gpu(D)·bs)·K + M(N): the bytes of the prompt's KV a remote prefill sends
        to a decode worker holding gpu(D) blocks of it in GPU (with a spec, the windows and
        tail at N go too)."""
        nbytes = (self.n - gpu_d * self.request.block_size) * self.k
        return (nbytes if nbytes > 0 else 0) + self.mutable

    def link(
        self, dst: WorkerView, nbytes: float, same_node: bool, c: ProfileConstants | None = None
    ) -> float:
        """link_s = s_l(dst) · (latency_s(path) + bytes / bps(path)), path = kv_transport_into(
        same_node, dst.kv_same_host, dst.kv_transport), priced by dst's profile (`c` when at
        hand); 0 when nothing moves."""
        if nbytes <= 0:
            return 0.0
        if c is None:
            c = self.constants(dst.profile)
        t = c.paths[kv_transport_into(same_node, dst.kv_same_host, dst.kv_transport)]
        return dst.link_scale * (t.latency_s + nbytes / t.bps)

    def transfer_s(
        self, src: WorkerView, dst: WorkerView, nbytes: float, c: ProfileConstants | None = None
    ) -> float:
        """transfer_s of `nbytes` from src to dst = link_s + [src.node ≠ dst.node] ·
        nic_backlog_s(src): a transfer between nodes first waits for what is queued on the
        source node's NIC (`c`: the constants of dst's profile, when at hand)."""
        same = src.node == dst.node
        t = self.link(dst, nbytes, same, c)
        return t if same or nbytes <= 0 else t + src.nic_backlog_s

    def nic_s(self, src: WorkerView, dst: WorkerView, nbytes: float) -> float:
        """The NIC time of `nbytes` from src to dst (`CostBreakdown.t_nic`): link_s when it
        crosses nodes, else 0 (what it adds to the source node's NIC backlog)."""
        if src.node == dst.node or nbytes <= 0:
            return 0.0
        return self.link(dst, nbytes, False)

    def dup(self, non_owner: bool, held: int) -> float:
        """dup(w, h) = [w ≠ owner] · max(0, owner_blocks − h) · bs · K: KV of the owned prefix
        a non-owner (`non_owner` = [w ≠ owner]) holding h blocks of it newly materialises
        (bytes; 0 when the request has no owner, as owner_blocks counts as 0 then)."""
        return _dup(non_owner, held, self.ob, self.bk)

    def moves(self, decode_worker: str) -> bool:
        """True when decoding on `decode_worker` moves the session off the worker its KV is
        counted on (`home_worker`, a working set): the route then pays H_move like a
        migration."""
        home = self.request.home_worker
        return home is not None and decode_worker != home

    def hysteresis(self, others: float) -> float:
        """H_move of a state migration whose other terms sum to C₀ = `others`:
        migration_margin_s + migration_margin_rel · C₀."""
        return self.config.migration_margin_s + self.config.migration_margin_rel * others

    def breakdown(self, route: Route) -> CostBreakdown:
        """Every term of C(route) (planner/README.md, *The cost*); `.total` is C(a)."""
        return self._breakdown(route.action, route.prefill, route.decode, route.source, None, 0, 0)[
            0
        ]

    def candidate(self, route: Route) -> Candidate:
        """The route as a `Candidate` with its full breakdown."""
        return self.candidate_of(route.action, route.prefill, route.decode, route.source)

    def candidate_of(
        self,
        action: Action,
        pw: WorkerView,
        dw: WorkerView,
        src: WorkerView | None,
        terms: ScanTerms | None = None,
        ip: int = 0,
        id_: int = 0,
    ) -> Candidate:
        """The `Candidate` of `action` prefilling on `pw` and decoding on `dw` (from `src`),
        with its full breakdown; from the terms of `terms` (a `scan` holding `pw` at `ip` and
        `dw` at `id_`: the search's, not computed again) when given."""
        b, reused_blocks = self._breakdown(action, pw, dw, src, terms, ip, id_)
        fetches: tuple[tuple[int, str], ...] = ()
        if self.chunk_src:
            # the prefill `_breakdown` priced: the fetch's when it was the lesser
            r = self.reused(reused_blocks) if reused_blocks else 0
            fetched = self.chunk_fetch(pw, r)
            if fetched is not None and fetched.prefill_s < self._recompute(pw, r):
                fetches = fetched.fetches
        return Candidate(
            action,
            pw.worker_id,
            dw.worker_id,
            b,
            None if src is None else src.worker_id,
            reused_blocks,
            fetches,
        )

    def _recompute(self, w: WorkerView, r: int) -> float:
        """`prefill` without fetching chunks."""
        c = self.constants(w.profile)
        u = self.chunk_reuse(w, r) if w.chunks_held else 0
        return w.prefill_scale * (self.prefill_base(c, r + u) + c.rerotate_per_token_s * u)

    def _breakdown(
        self,
        action: Action,
        p: WorkerView,
        d: WorkerView,
        source: WorkerView | None,
        terms: ScanTerms | None,
        ip: int,
        id_: int,
    ) -> tuple[CostBreakdown, int]:
        """(breakdown, blocks P's prefill resumes from: resumed(P), or after a move its
        `resume_moved`) of the route of `action` prefilling on P = `p` and
        decoding on D = `d` (from `source`; `terms`: a scan holding P at `ip` and D at `id_`,
        scanned here when None)."""
        cfg = self.config
        colocated = d is p or d.worker_id == p.worker_id
        if terms is None:
            terms = self.scan((p,) if colocated else (p, d))
            ip, id_ = 0, len(terms.workers) - 1
        qs = terms.queue_s
        decs = terms.decode_s
        dups = terms.dup
        holds = terms.holds
        disps = terms.w_disp_s
        q_p = qs[ip]
        dec = decs[ip]
        pre = terms.prefill_s[ip]
        stalled = terms.stalled[ip]
        dup_p = dups[ip]
        wd = disps[ip]
        gpu_d = held = r = 0
        tr = 0.0
        dup_d = dup_p
        if holds[ip]:
            gpu_d = terms.gpu[ip]
            held = terms.held[ip]
            r = terms.reused[ip]
            tr = terms.restore_s[ip]
            dup_d = terms.dup_gpu[ip]
        # blocks pulled over the network into P before it computes: a fetch max(0,
        # owner_blocks − held(P)), a migration max(0, gpu(S) − held(P)); otherwise 0
        moved = 0
        if action is _FETCH:
            moved = self.request.owner_blocks - held
        elif action is _MIG and source is not None:
            moved = gpu_blocks(source) - held
        if moved < 0:
            moved = 0
        resumed = terms.resumed[ip] if holds[ip] else 0
        if moved:  # P reuses what it holds and what moves in (where a hybrid hit resumes)
            resumed = self.resume_moved(p, held, moved)[0]
            pre = self.prefill(p, self.reused(resumed))
        if colocated:
            tq = q_p  # T_queue = q(P) + [D ≠ P] · q(D); D's terms are P's
        else:
            dec = decs[id_]
            dup_d = dups[id_]
            gpu_d = 0
            if holds[id_]:
                gpu_d = terms.gpu[id_]
                dup_d = terms.dup_gpu[id_]
            tq = q_p + qs[id_]
            wd += disps[id_]
        tq -= wd  # the terms' q carries W_disp (WorkerTerms)
        # T_network and M_HBM by action; the NIC time is informational
        nic = 0.0
        if action is _REMOTE:
            wd += self.copy_price(p, r, dup_p)  # P's transient copy, the duplicate it is
            nbytes = self.kv_to_decode(gpu_d)
            tn = tt = self.transfer_s(p, d, nbytes)
            nic = self.nic_s(p, d, nbytes)
            tn += cfg.pd_handshake_s + d.handover_s
            m = float(self.prompt_copy(r) + dup_d)
        elif source is not None:
            if action is _FETCH:
                wd += self.fetch_price(p, dup_p, self.constants(p.profile))  # its replica
            tn, tr_peer, nbytes_in = self.peer_restore(p, source, held, moved)
            tt = tn - p.handover_s if tn > p.handover_s else 0.0  # peer_restore adds it
            tr += tr_peer
            nic = self.nic_s(source, p, nbytes_in)
            m = float(nbytes_in if action is _MIG else dup_p)
        else:
            tn = tt = 0.0
            m = float(dup_p)
        # I_decode = stalled(P) · prefill + B(D); the decode column carries μ·B(D)
        batch = self.batch_s(d)
        i = stalled * pre + batch
        dec -= cfg.mu * batch
        h = 0.0
        if action is _MIG or self.moves(d.worker_id):
            # the other terms summed as CostBreakdown.total sums them
            h = self.hysteresis(tq + (pre + dec) + tn + tr + cfg.lam * m + cfg.mu * i + wd)
        o = self.o
        b = CostBreakdown(
            tq, pre + dec, tn, tr, m, i, cfg.lam, cfg.mu, pre, dec / o if o else 0.0, h, nic, wd, tt
        )
        return b, resumed


# The formulas `RequestCosts` shares with its pass over the workers, `scan` (module functions:
# the cheapest call).


def reuse_weight(u: float, floor: float) -> float:
    """ω(u) = 1 / max(u, floor): X_dup's weight for a kind of copy whose blocks are hit again
    before eviction at the rate u (`planner.copyreuse`). 1 where copies are reused (u = 1, and
    before any was observed); a copy nothing reuses pays its displacement per reuse it gets,
    at most 1 / floor times over."""
    return 1.0 / (u if u > floor else floor)


def _reused(blocks: int, bs: int, n: int) -> int:
    r = blocks * bs
    return r if r < n else n - 1


def _prefill_base(c: ProfileConstants, n: int, r: int) -> float:
    new = n - r
    return (
        c.prefill_base_s
        + c.prefill_per_token_s * new
        + c.prefill_per_token_ctx_s * new * (r + new / 2.0)
    )


def _dup(non_owner: bool, held: int, ob: int, bk: float) -> float:
    return (ob - held) * bk if non_owner and held < ob else 0


def evaluate(
    model: CostModel, request: RequestView, route: Route, cluster: ClusterView | None = None
) -> CostBreakdown:
    """The full breakdown of C(route) (`RequestCosts.breakdown`); `CostBreakdown.total` is
    C(a). With `cluster`, a chunked request's prefill may fetch the chunks it lacks from
    their holders there (`RequestCosts.chunk_fetch`)."""
    return RequestCosts(model, request, cluster).breakdown(route)


def chunk_sources(request: RequestView, cluster: ClusterView) -> tuple[tuple[WorkerView, ...], ...]:
    """Per chunk of the request (`chunk_spans`), the healthy workers with a chunk KV API
    (`chunk_api`) whose chunk store holds it (`chunks_held`; the serving workers, then the
    sources), in the cluster's order; () when no chunk has any."""
    n = len(request.chunk_spans)
    out: list[list[WorkerView]] = [[] for _ in range(n)]
    found = False
    for ws in (cluster.workers, cluster.sources):
        for w in ws:
            if w.chunks_held and w.healthy and w.chunk_api:
                for i in w.chunks_held:
                    if 0 <= i < n and w not in out[i]:
                        out[i].append(w)
                        found = True
    return tuple(tuple(x) for x in out) if found else ()


# --------------------------------------------------------------------------------------------
# The candidate set.


def colocated_action(request: RequestView, worker: WorkerView, continuation: bool) -> Action:
    """How a colocated candidate on `worker` is named (`colocated_kind` of its held blocks)."""
    g, c, s = tier_blocks(worker)
    held = g if g >= c and g >= s else max(c, s)
    return colocated_kind(request, worker.worker_id, g, held, continuation)


def colocated_kind(
    request: RequestView, worker_id: str, gpu: int, held: int, continuation: bool
) -> Action:
    """How a colocated candidate on a worker holding `held` blocks of the prefix, of which `gpu`
    in GPU, is named: TAIL_RECOMPUTE when part of its held prefix must be loaded from CPU/SSD
    (held > gpu: restore the artifact, recompute the tail); DECODE_CONTINUATION on the session
    owner holding the prefix in GPU when the request is a decode continuation
    (`continuation`); else COLOCATED_PREFILL. The name never changes the cost: all three
    prefill and decode on `worker` with what it holds."""
    if held > gpu:
        return _TAIL
    if continuation and gpu > 0 and worker_id == request.session_owner:
        return _CONT
    return _COL


def fetch_source(request: RequestView, cluster: ClusterView) -> WorkerView | None:
    """The owner to fetch from: healthy, serving its KV (`kv_api`), and not the session's own
    decode owner (a session moves by STATE_MIGRATION instead of being replicated)."""
    if request.owner is None or request.owner_blocks <= 0:
        return None
    if request.owner == request.session_owner:
        return None
    w = cluster.by_id(request.owner)
    return w if w is not None and w.healthy and w.kv_api else None


def migration_source(request: RequestView, cluster: ClusterView) -> WorkerView | None:
    """The session owner to move from: healthy, serving its KV (`kv_api`) and holding part of
    the prefix in GPU."""
    if request.session_owner is None:
        return None
    w = cluster.by_id(request.session_owner)
    if w is None or not w.healthy or not w.kv_api or gpu_blocks(w) <= 0:
        return None
    return w


def enumerate_routes(
    request: RequestView, cluster: ClusterView, *, continuation: bool = False
) -> list[Route]:
    """Every candidate the ownerserve policy weighs (reference enumeration, O(P·D)):
    colocated on each decode-capable worker; ARTIFACT_FETCH from the owner to each decode-capable
    worker with a KV API (`kv_api`) holding less than owner_blocks; STATE_MIGRATION from the
    session owner to each such worker holding less than gpu(session owner); REMOTE_PREFILL for
    every prefill-capable P and decode-capable D ≠ P that speak one P/D hand-over (`pd_pair`).
    Unhealthy workers are skipped."""
    live = [w for w in cluster.workers if w.healthy]
    src_f = fetch_source(request, cluster)
    src_m = migration_source(request, cluster)
    routes: list[Route] = []
    decoders = [w for w in live if can_decode(w)]
    for w in decoders:
        routes.append(Route(colocated_action(request, w, continuation), w, w))
        if not w.kv_api:
            continue
        held = held_blocks(w)
        if src_f is not None and w.worker_id != src_f.worker_id and request.owner_blocks > held:
            routes.append(Route(_FETCH, w, w, src_f))
        if src_m is not None and w.worker_id != src_m.worker_id and gpu_blocks(src_m) > held:
            routes.append(Route(_MIG, w, w, src_m))
    for p in live:
        if not can_prefill(p):
            continue
        for d in decoders:
            if d.worker_id != p.worker_id and pd_pair(p, d):
                routes.append(Route(_REMOTE, p, d))
    return routes
