"""Discrete-event simulator of an xPyD cluster that runs the router's own planner policies.

Per worker: a FIFO prefill pipeline (time from the timing profile), a decode batch whose step
time grows with batch size and context (processor-sharing approximation: a request's decode
takes `output_tokens × decode_step_s(batch, ctx)` at the batch it joins), an LRU prefix cache of
KV blocks with the worker's HBM capacity, and decode interference as the emulated engine (and
vLLM's chunked prefill) has it: a prefill shares its worker's steps with running decodes, so the
decodes make no progress while it computes (their end moves later by the overlap) and each
prefill chunk also pays one decode step. KV transfers queue FIFO on the
sending node's NIC (bandwidth sharing as serialisation); the policies see each node's queue
(`WorkerView.nic_backlog_s`), as the router knows the transfers it started. The directory is
exact: the sim knows every worker's cache, as the router learns it from KV events.

Assumptions, stated once: decode steps are not re-timed when the batch changes mid-request;
transient prefill copies stay in P's cache (evictable) exactly as vLLM's prefix cache keeps
them. Every policy sees every worker's view (kept from request to request above
`full_view_max` workers or with `full_view`, else built afresh); above `full_view_max`
workers the ownerserve policy plans over its exact candidate subset (`planner.candidates`:
the same choice as over every worker, found without weighing each), unless it is run with
`full_view` (a check: it then weighs every worker).
A policy may refuse a request (`RequestRejectedError`, Mooncake's early rejection): it is
counted apart and its session ends there.

Under KV pressure: the sessions' KV working sets (`planner.workingset.WorkingSets`, fed as the
router feeds it: a request counts on its decode worker from its start, its prompt and output
after it ends, kept through a short predicted gap) fill `WorkerView.ws_tokens` and the
request's `home_worker`; a CPU tier per worker (`ClusterSpec.cpu_blocks`) takes the blocks HBM
evicts, LRU, and a prefix found there is loaded at the profile's `cpu_load_bps` instead of
recomputed; a program-level gate (`loadgen.sim.admission`: the router's admission queue, or
ThunderAgent's program scheduler) may hold requests before they are planned.

With a hybrid-attention KV spec (`kv_spec`), a hit resumes by the emulated engine's rule
(`ownerserve.kvstate.resume`): where the worker's HBM kept the windows (every cached boundary
by default; `retention` may keep fewer, as vLLM's retention interval does), or rebuilding them
by recomputing n_win·L tokens; a fetch or migration moves the sealed blocks only and the
destination resumes by the same rule. The planner sees each worker's restorable boundary.
Goodput counts the completed sessions whose steps' p90 TTFT met the SLO
(`loadgen.capacity`'s definition).
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from loadgen.report import percentile
from loadgen.sim.admission import ProgramGate
from loadgen.sim.workload import SimSession
from ownerserve.kvfetch import FETCH_BRINGS_WINDOWS
from ownerserve.kvstate import (
    KVStateSpec,
    ResumeRule,
    SwaPolicy,
    moved_windows,
    rebuild_s,
    resume_point,
)
from ownerserve.kvstate.retention import Retention
from ownerserve.profiles import TimingProfile, kv_transport_into
from ownerserve.types import KVTransport, Role, Tier
from planner.calibration import Calibrator
from planner.candidates import ExactSubsetPolicy
from planner.copyreuse import CopyKind, CopyReuse
from planner.policies.ownerserve import OwnerServePolicy
from planner.policies.peers import RequestRejectedError
from planner.restore import plan_restore
from planner.types import Action, ClusterView, Plan, Policy, RequestView, WorkerView
from planner.workingset import WorkingSets

_ARRIVE = 0
_DECODE_END = 1
_TICK = 2


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    prefill: int = 2
    decode: int = 2
    hybrid: int = 2
    workers_per_node: int = 8
    block_tokens: int = 512
    hbm_kv_bytes: int | None = None  # per worker; None = the profile's
    full_view_max: int = 64
    """Above this many workers the ownerserve policy plans over its exact candidate subset."""
    load_scrape_s: float = 0.0
    """How old the policies' `kv_usage` may be: the router scrapes it from each worker's
    metrics every `server.health_interval_s` (2 s by default); 0 = always current."""
    cpu_blocks: int = 0
    """Per worker, blocks of the CPU tier behind HBM (the emulator's `--cpu-num-blocks`);
    0 = none."""
    kv_same_host: bool = True
    """Workers of one node take each other's KV through host memory (the same_host KV
    transport); False: through the store even within a node (`kv_transport`)."""
    kv_transport: KVTransport = KVTransport.STORE_RDMA
    """The store transport KV takes otherwise (`ownerserve.profiles.kv_transport_into`)."""

    @property
    def total(self) -> int:
        return self.prefill + self.decode + self.hybrid

    @staticmethod
    def of_size(
        n: int, *, block_tokens: int = 512, hbm_kv_bytes: int | None = None, cpu_blocks: int = 0
    ) -> ClusterSpec:
        """`n` workers split 1:1:1 across prefill, decode and hybrid (remainder to hybrid)."""
        third = n // 3
        return ClusterSpec(
            prefill=third,
            decode=third,
            hybrid=n - 2 * third,
            block_tokens=block_tokens,
            hbm_kv_bytes=hbm_kv_bytes,
            cpu_blocks=cpu_blocks,
        )


class _Held:
    """How much of one chain each worker holds. Caches are prefix-closed, so a worker's depth
    is found by binary search and holder sets shrink along the chain."""

    __slots__ = ("best", "chain", "sim")

    def __init__(self, chain: tuple[int, ...], best: int, sim: Simulator) -> None:
        self.chain = chain
        self.best = best
        self.sim = sim

    def depth(self, wi: int) -> int:
        cache = self.sim.workers[wi].cache
        chain = self.chain
        lo, hi = 0, self.best
        while lo < hi:
            mid = (lo + hi) // 2
            if chain[mid] in cache:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def top(self, k: int) -> list[int]:
        """Up to `k` worker indices holding the longest prefixes."""
        out: list[int] = []
        seen: set[int] = set()
        holders = self.sim.holders
        for i in range(self.best - 1, -1, -1):
            for wi in holders[self.chain[i]]:
                if wi not in seen:
                    seen.add(wi)
                    out.append(wi)
                    if len(out) >= k:
                        return out
        return out


class _Worker:
    __slots__ = (
        "cache",
        "capacity",
        "cpu",
        "decode_active",
        "decode_ctx",
        "idx",
        "log",
        "node",
        "pending",
        "prefill_free_at",
        "role",
        "scraped",
        "stall_busy",
        "stall_ends",
        "stall_starts",
        "wid",
        "windows",
    )

    def __init__(self, idx: int, wid: str, role: Role, node: str, capacity: int) -> None:
        self.idx = idx
        self.wid = wid
        self.role = role
        self.node = node
        self.capacity = capacity
        self.cache: dict[int, int] = {}  # block -> recency (higher = more recent)
        self.cpu: OrderedDict[int, None] = OrderedDict()  # CPU tier, least recent first
        self.log: deque[tuple[int, int]] = deque()
        self.prefill_free_at = 0.0
        self.pending: list[tuple[float, int]] = []  # (prefill end, tokens) in FIFO order
        self.decode_active = 0
        self.decode_ctx = 0
        # prefill compute intervals (sorted, disjoint: the pipeline is FIFO) and the compute
        # time before each, to find how long decodes stalled in any window
        self.stall_starts: list[float] = []
        self.stall_ends: list[float] = []
        self.stall_busy: list[float] = []
        self.scraped = (-1.0, 0.0)  # (scrape period index, kv_usage then)
        # a hybrid spec under a retention that keeps only some boundaries' windows: the HBM
        # blocks whose boundary (the end of the block) keeps them
        self.windows: set[int] = set()

    def add_stall(self, start: float, seconds: float) -> None:
        before = (
            self.stall_busy[-1] + self.stall_ends[-1] - self.stall_starts[-1]
            if (self.stall_starts)
            else 0.0
        )
        self.stall_starts.append(start)
        self.stall_ends.append(start + seconds)
        self.stall_busy.append(before)

    def stalled_before(self, t: float) -> float:
        """Prefill compute time on this worker before `t`."""
        k = bisect.bisect_right(self.stall_starts, t) - 1
        if k < 0:
            return 0.0
        return self.stall_busy[k] + min(t, self.stall_ends[k]) - self.stall_starts[k]

    def pending_tokens(self, now: float) -> tuple[int, int]:
        """(jobs, tokens) of prefill not finished at `now`."""
        while self.pending and self.pending[0][0] <= now:
            self.pending.pop(0)
        return len(self.pending), sum(t for _, t in self.pending)


class _FullView:
    """Every worker's view, the cluster view every policy gets, kept from request to request
    and rebuilt only where something it shows changed: the worker's load (a plan put work on
    it, a decode ended there, a prefill of its queue finished), its node's NIC backlog (while
    one is queued), the scraped kv_usage (a new scrape period), how much of this request's
    chain it holds (in HBM, and with the CPU tier) or its working set. The views are exactly
    `Simulator._view`'s; a 1,000-worker cluster costs a few hundred µs a request, not ms
    (without `working_set_views`: asking the working sets for every worker costs about as
    much again)."""

    __slots__ = ("cache", "nic_busy", "node_workers", "period", "sim", "version", "wakeups")

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        n = len(sim.workers)
        self.version = [0] * n
        self.cache: list[tuple[int, int, int, int, bool, int | None, WorkerView] | None] = [
            None
        ] * n
        self.wakeups: list[tuple[float, int]] = []  # (prefill end, worker): its queue shrinks
        self.nic_busy: set[str] = set()
        self.node_workers: dict[str, list[int]] = {}
        for w in sim.workers:
            self.node_workers.setdefault(w.node, []).append(w.idx)
        self.period = -1.0

    def changed(self, *idx: int, until: float | None = None) -> None:
        """Workers `idx` changed; with `until`, the first of them changes again then."""
        for i in idx:
            self.version[i] += 1
        if until is not None:
            heapq.heappush(self.wakeups, (until, idx[0]))

    def depths(self, held: _Held) -> dict[int, int]:
        """Blocks of the chain each holder holds (`_Held.depth` of every holder at once):
        holder sets shrink along the chain, so walking it from its deepest held block assigns
        each holder its depth the first time it is met."""
        chain, best = held.chain, held.best
        if best == 0:
            return {}
        holders = self.sim.holders
        total = len(holders[chain[0]])
        depth: dict[int, int] = {}
        for k in range(best - 1, -1, -1):
            for wi in holders[chain[k]]:
                if wi not in depth:
                    depth[wi] = k + 1
            if len(depth) == total:
                break
        return depth

    def view(self, now: float, held: _Held) -> ClusterView:
        sim = self.sim
        version = self.version
        wakeups = self.wakeups
        while wakeups and wakeups[0][0] <= now:
            version[heapq.heappop(wakeups)[1]] += 1
        for node in list(self.nic_busy):
            for i in self.node_workers[node]:
                version[i] += 1  # the backlog shown falls with time
            if sim.nic_free_at.get(node, 0.0) <= now:
                self.nic_busy.discard(node)
        period = sim.spec.load_scrape_s
        if period > 0 and now // period != self.period:
            self.period = now // period
            for i in range(len(version)):
                version[i] += 1
        depth = self.depths(held)
        cpu = sim._cpu_depths(held, depth) if sim.offloads else {}
        ws = sim.ws.tokens if sim.ws_views else None
        closed = sim.closed_to_programs
        cache = self.cache
        views = []
        windows = sim.windows_kept
        for w in sim.workers:
            i = w.idx
            n = depth.get(i, 0)
            m = cpu.get(i, n)
            t = ws(w.wid, now) if ws is not None else 0
            x = closed is not None and closed(w.wid, now)
            k = sim._windows_at(w, held.chain, n) if windows and n else None
            c = cache[i]
            if (
                c is None
                or c[0] != version[i]
                or c[1] != n
                or c[2] != m
                or c[3] != t
                or c[4] != x
                or c[5] != k
            ):
                c = cache[i] = (version[i], n, m, t, x, k, sim._view_at(w, now, n, m, t, x, k))
            views.append(c[6])
        return ClusterView(workers=tuple(views))


@dataclass
class SimResult:
    """Per-policy outcome of one simulation run."""

    policy: str
    workers: int
    sessions: int
    requests: int
    events: int
    wall_s: float
    sim_s: float
    session_e2e_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    network_kv_bytes: int = 0
    pd_kv_bytes: int = 0
    fetch_kv_bytes: int = 0
    prefill_tokens: int = 0
    reused_tokens: int = 0
    decode_interference_s: float = 0.0
    owner_hits: int = 0
    owner_opportunities: int = 0
    dup_factor: float = 1.0
    max_concurrent_sessions: float = 0.0
    rejected: int = 0
    actions: dict[str, int] = field(default_factory=dict)
    cpu_hit_tokens: int = 0
    sessions_completed: int = 0
    sessions_good: int = 0
    slo_ttft_p90_s: float = 2.0
    rate_per_min: float = 0.0
    """Offered arrival rate of the main sessions (goodput's scale, as `loadgen.capacity`)."""
    queued: int = 0
    """Requests a program-level gate held before planning them."""
    queue_waits_s: list[float] = field(default_factory=list)
    rejected_429: int = 0
    """Requests the gate refused (queue full, waited too long): their sessions end there."""
    paused: int = 0
    """Programs ThunderAgent's scheduler paused."""
    restore_load_s: list[float] = field(default_factory=list)
    """Per CPU-tier restore: its load (planner.restore's plan), its recompute (windows and
    incomplete block) and its wait for the prefill pipeline."""
    restore_recompute_s: list[float] = field(default_factory=list)
    restore_queue_s: list[float] = field(default_factory=list)
    offload_bytes: int = 0
    """Bytes HBM evictions wrote to the CPU tier (sealed blocks; without typed state, the
    window entries kept with them)."""
    swa_written_bytes: int = 0
    """Window checkpoint bytes the SWA policy wrote off-GPU as the sessions' prompts grew."""
    resumes: dict[str, int] = field(default_factory=dict)
    """A hybrid spec's GPU hits and moves by how they resumed (`RESUME_KINDS`)."""
    window_rebuild_tokens: int = 0
    """Tokens recomputed to rebuild windows where a hybrid hit resumed."""

    @property
    def goodput_per_min(self) -> float:
        """Good sessions per minute: the offered rate × the share of sessions that were good."""
        return self.rate_per_min * self.sessions_good / self.sessions if self.sessions else 0.0

    def summary(self) -> dict[str, Any]:
        def pct(xs: list[float], q: float) -> float:
            if not xs:
                return 0.0
            s = sorted(xs)
            return s[min(len(s) - 1, int(q * len(s)))]

        def mean(xs: list[float]) -> float:
            return sum(xs) / len(xs) if xs else 0.0

        return {
            "policy": self.policy,
            "workers": self.workers,
            "sessions": self.sessions,
            "requests": self.requests,
            "rejected": self.rejected,
            "events": self.events,
            "events_per_s": self.events / self.wall_s if self.wall_s else 0.0,
            "wall_s": self.wall_s,
            "sim_s": self.sim_s,
            "e2e_mean_s": mean(self.session_e2e_s),
            "e2e_p95_s": pct(self.session_e2e_s, 0.95),
            "e2e_p99_s": pct(self.session_e2e_s, 0.99),
            "ttft_p50_s": pct(self.ttft_s, 0.5),
            "ttft_p99_s": pct(self.ttft_s, 0.99),
            "tpot_mean_s": mean(self.tpot_s),
            "network_kv_gb": self.network_kv_bytes / 1e9,
            "pd_kv_gb": self.pd_kv_bytes / 1e9,
            "fetch_kv_gb": self.fetch_kv_bytes / 1e9,
            "prefill_tokens": self.prefill_tokens,
            "reused_tokens": self.reused_tokens,
            "decode_interference_s": self.decode_interference_s,
            "owner_hit_rate": self.owner_hits / self.owner_opportunities
            if self.owner_opportunities
            else 1.0,
            "dup_factor": self.dup_factor,
            "max_concurrent_sessions": self.max_concurrent_sessions,
            "actions": dict(sorted(self.actions.items())),
            "cpu_hit_tokens": self.cpu_hit_tokens,
            "sessions_completed": self.sessions_completed,
            "sessions_good": self.sessions_good,
            "slo_ttft_p90_s": self.slo_ttft_p90_s,
            "rate_per_min": self.rate_per_min,
            "goodput_per_min": self.goodput_per_min,
            "queued": self.queued,
            "queue_wait_mean_s": mean(self.queue_waits_s),
            "queue_wait_p99_s": pct(self.queue_waits_s, 0.99),
            "rejected_429": self.rejected_429,
            "paused": self.paused,
            "restores": len(self.restore_load_s),
            "restore_load_mean_s": mean(self.restore_load_s),
            "restore_recompute_mean_s": mean(self.restore_recompute_s),
            "restore_queue_mean_s": mean(self.restore_queue_s),
            "restore_mean_s": mean(
                [
                    a + b + c
                    for a, b, c in zip(
                        self.restore_load_s,
                        self.restore_recompute_s,
                        self.restore_queue_s,
                        strict=True,
                    )
                ]
            ),
            "offload_gb": self.offload_bytes / 1e9,
            "swa_written_gb": self.swa_written_bytes / 1e9,
            "resumes": dict(self.resumes),
            "window_rebuild_tokens": self.window_rebuild_tokens,
        }


class Simulator:
    """Runs one policy over one workload on one cluster spec."""

    def __init__(
        self,
        spec: ClusterSpec,
        profile: TimingProfile,
        policy: Policy,
        *,
        seed: int = 0,
        oracle: bool = False,
        model: str = "sim-model",
        full_view: bool = False,
        gate: ProgramGate | None = None,
        slo_ttft_p90_s: float = 2.0,
        rate_per_min: float | None = None,
        working_set_views: bool = True,
        calibrator: Calibrator | None = None,
        kv_spec: KVStateSpec | None = None,
        typed_state: bool = True,
        retention: Retention | None = None,
    ) -> None:
        self.spec = spec
        self.kv_spec = kv_spec
        """HeteroCache: the model's KV spec (None: dense, the profile's kv_bytes_per_token).
        Blocks are sized by its sealed rate, the planner sees it (`RequestView.kv_spec`), and
        CPU-tier restores and fetches are planned by planner.restore under its SWA policy."""
        self.typed_state = typed_state
        """False (the LRU baseline): the window entries of every token are cached, evicted
        and offloaded with its block, as a cache without typed parts keeps them."""
        self.swa_policy = (
            SwaPolicy.full() if kv_spec is not None and not typed_state else None
        )  # None: the spec's own
        rule = None if kv_spec is None else ResumeRule.of(kv_spec, spec.block_tokens)
        self.resume_rule = rule if rule is not None and rule.hybrid else None
        """A hybrid spec's resume rule (`ownerserve.kvstate.resume`): where a hit resumes on
        its worker (at the windows it holds, or rebuilding them), as the emulated engine
        does; None: a hit resumes at its sealed blocks."""
        self.retention = retention or Retention()
        """Which boundaries a worker's HBM keeps the windows of (vLLM's prefix-cache retention
        interval, `ownerserve.kvstate.retention`): full (the default) keeps every cached
        boundary's; `zero` only each computed prompt's last, `periodic(N)` also every N
        tokens. The sim does not model a window pool evicting apart from the sealed blocks
        (the emulated engine frees window blocks as they leave the window, so under
        pressure its front windows go first)."""
        self.windows_kept = (
            self.resume_rule is not None and typed_state and self.retention.interval is not None
        )
        """Whether workers keep windows at some boundaries only (`_Worker.windows`)."""
        self.offload_bytes = 0
        self.calibrator = calibrator
        """Fed each plan's observed TTFT, TPOT and transfer time once its first token is out,
        as the router's aftermath feeds its own; its scales go into the views the policy sees
        (None: the views stay uncalibrated, as for the peers' models)."""
        self._observed: list[tuple[float, int, Plan, float, float, float | None]] = []
        """(first token's time, seq, plan, TTFT from the plan, TPOT, transfer s), a heap."""
        self._moved_s: float | None = None
        """The KV transfer of the plan `_execute` ran last (None: nothing moved)."""
        self._resumed_blocks = 0
        """Where the last hybrid hit resumed (`_resume`)."""
        # False: `WorkerView.ws_tokens` stays 0 (for policies that do not read it, the peers)
        self.ws_views = working_set_views
        self.gate = gate
        self.slo_ttft_p90_s = slo_ttft_p90_s
        self.rate_per_min = rate_per_min
        self.ws = WorkingSets()
        self.reuse = CopyReuse()
        """The reuse rate of the planner's copies (`planner.copyreuse`): fed each plan's hits
        and copies (`CopyReuse.observe`), as the router feeds its own."""
        self.closed_to_programs: Callable[[str, float], bool] | None = None
        """Whether the gate closed a worker to programs (`WorkerView.programs_closed`)."""
        self.offloads = spec.cpu_blocks > 0
        self.cpu_holders: dict[int, set[int]] = {}
        self.profile = profile
        self.policy = policy
        self.oracle = oracle
        self.model = model
        self.rng = random.Random(seed)
        bt = spec.block_tokens
        hbm = spec.hbm_kv_bytes if spec.hbm_kv_bytes is not None else profile.hbm_kv_bytes
        if kv_spec is None:
            self.block_bytes = profile.kv_bytes_per_token * bt
        else:
            per_token = kv_spec.bytes_per_token()
            if not typed_state:
                per_token += kv_spec.swa_bytes_per_token
            self.block_bytes = max(1, round(per_token * bt))
        capacity = max(1, hbm // self.block_bytes)
        self.workers: list[_Worker] = []
        roles = (
            [Role.PREFILL] * spec.prefill
            + [Role.DECODE] * spec.decode
            + [Role.HYBRID] * spec.hybrid
        )
        for i, role in enumerate(roles):
            node = f"n{i // spec.workers_per_node}"
            self.workers.append(_Worker(i, f"{role.value[0]}{i}", role, node, capacity))
        self.by_id = {w.wid: w for w in self.workers}
        self.holders: dict[int, set[int]] = {}
        self.owner: dict[int, int] = {}
        self.session_owner: dict[int, int] = {}
        self.future_refs: dict[int, int] = {}
        self.nic_free_at: dict[str, float] = {}
        self.cached_blocks = 0
        self._clock = 0
        # a cluster of at most `full_view_max` workers has its views built afresh per request
        # (the reference the kept ones are tested against)
        big = len(self.workers) > spec.full_view_max
        self._full = _FullView(self) if full_view or big else None
        # above `full_view_max` workers the ownerserve policy plans over its exact candidate
        # subset (planner.candidates), unless `full_view` asks it to weigh every worker
        if not full_view and big and isinstance(policy, OwnerServePolicy):
            self.policy = ExactSubsetPolicy(policy, spec.full_view_max)

    # -- cache -------------------------------------------------------------------------------

    def _insert(self, w: _Worker, chain: tuple[int, ...]) -> None:
        """Touch `chain` in `w`'s cache (LRU), inserting missing blocks, then evict.

        Recency values decrease along the chain, so a block is always more recent than its
        descendants: eviction takes tails first (as vLLM's free queue does) and every cache
        stays prefix-closed — a worker holding block k holds blocks 0..k-1 of its chain.
        `w.log` lists (recency, block) in ascending recency; entries whose recency no longer
        matches the cache are stale and skipped at eviction.
        """
        cache = w.cache
        n = len(chain)
        new = [b for b in chain if b not in cache]
        base = self._clock
        cache.update(zip(chain, range(base + n, base, -1), strict=True))
        w.log.extend(zip(range(base + 1, base + n + 1), reversed(chain), strict=True))
        self._clock = base + n + 1
        if new:
            self.cached_blocks += len(new)
            holders = self.holders
            owner = self.owner
            for b in new:
                hs = holders.get(b)
                if hs is None:
                    holders[b] = {w.idx}
                    owner[b] = w.idx
                else:
                    hs.add(w.idx)
        if len(cache) > w.capacity:
            self._evict(w, len(cache) - w.capacity + w.capacity // 16)
        if len(w.log) > 8 * w.capacity + 1024:
            w.log = deque(sorted((v, b) for b, v in cache.items()))

    def _evict(self, w: _Worker, count: int) -> None:
        cache = w.cache
        log = w.log
        refs = self.future_refs if self.oracle else None
        spared: list[tuple[int, int]] = []
        victims: list[int] = []
        while len(victims) < count and log:
            value, b = log.popleft()
            if cache.get(b) != value:
                continue  # stale entry
            if refs is not None and refs.get(b, 0) > 0:
                spared.append((value, b))  # the oracle keeps blocks that will be reused
                continue
            victims.append(b)
        # nothing else left: the oldest spared go; a block's descendants are older than it, so
        # they were met (and evicted) first and caches stay prefix-closed
        short = max(0, count - len(victims))
        victims.extend(b for _, b in spared[:short])
        log.extendleft(reversed(spared[short:]))
        if self.windows_kept:
            w.windows.difference_update(victims)
        for victim in victims:
            del cache[victim]
            hs = self.holders[victim]
            hs.discard(w.idx)
            if not hs:
                del self.holders[victim]
                del self.owner[victim]
            elif self.owner.get(victim) == w.idx:
                # the owner lost its copy: ownership passes to a surviving holder
                self.owner[victim] = next(iter(hs))
        self.cached_blocks -= len(victims)
        if self.offloads:
            self._offload(w, victims)

    def _offload(self, w: _Worker, blocks: list[int]) -> None:
        """`blocks` evicted from `w`'s HBM move to its CPU tier, which evicts its least
        recently used blocks past `cpu_blocks`. Victims come least recent first, tails before
        their prefixes, and are stored in that order: a prefix leaves the tier after its
        tail."""
        cpu = w.cpu
        holders = self.cpu_holders
        for b in blocks:
            if b in cpu:
                cpu.move_to_end(b)
                continue
            cpu[b] = None
            self.offload_bytes += self.block_bytes
            hs = holders.get(b)
            if hs is None:
                holders[b] = {w.idx}
            else:
                hs.add(w.idx)
        over = len(cpu) - self.spec.cpu_blocks
        for _ in range(over if over > 0 else 0):
            b, _none = cpu.popitem(last=False)
            hs = holders[b]
            hs.discard(w.idx)
            if not hs:
                del holders[b]

    def _keep_windows(self, w: _Worker, chain: tuple[int, ...], lo: int, hi: int) -> None:
        """`w` computed (or, P/D, was handed) the prompt `chain` past block `lo`: the
        boundaries in (lo, hi] the retention keeps hold their windows (only tracked when
        `windows_kept`; every boundary past `len(chain)` is none of the prompt's)."""
        if not self.windows_kept:
            return
        bt = self.spec.block_tokens
        last = len(chain) * bt
        keeps = self.retention.keeps
        wins = w.windows
        cache = w.cache
        for j in range(lo + 1, hi + 1):
            if keeps(j * bt, last) and chain[j - 1] in cache:
                wins.add(chain[j - 1])

    def _windows_at(self, w: _Worker, chain: tuple[int, ...], n: int) -> int:
        """The deepest boundary j <= n of `chain` whose windows `w`'s HBM holds (its HBM holds
        blocks [0, n)): n when every boundary keeps them (`windows_kept` off)."""
        if not self.windows_kept:
            return n
        wins = w.windows
        for j in range(n, 0, -1):
            if chain[j - 1] in wins:
                return j
        return 0

    @staticmethod
    def _cpu_extent(w: _Worker, chain: tuple[int, ...], start: int) -> int:
        """How far `w`'s tiers together hold `chain` from block `start` (its HBM prefix) on:
        the blocks past it found in its CPU tier, in order."""
        cpu = w.cpu
        k, n = start, len(chain)
        while k < n and chain[k] in cpu:
            k += 1
        return k

    def _cpu_depths(self, held: _Held, depth: dict[int, int]) -> dict[int, int]:
        """Per worker whose CPU tier extends its HBM prefix of `held`'s chain, that combined
        prefix in blocks (`depth`: the HBM prefixes of the holders)."""
        chain = held.chain
        if not chain:
            return {}
        out: dict[int, int] = {}
        workers = self.workers
        holders = self.cpu_holders
        for wi, n in depth.items():
            if n < len(chain) and wi in holders.get(chain[n], ()):
                out[wi] = self._cpu_extent(workers[wi], chain, n)
        for wi in holders.get(chain[0], ()):
            if wi not in depth:
                out[wi] = self._cpu_extent(workers[wi], chain, 0)
        return out

    def _held(self, chain: tuple[int, ...]) -> _Held:
        """Who holds how much of `chain` (caches are prefix-closed, see `_insert`)."""
        holders = self.holders
        lo, hi = 0, len(chain)
        while lo < hi:  # first block nobody holds
            mid = (lo + hi) // 2
            if chain[mid] in holders:
                lo = mid + 1
            else:
                hi = mid
        return _Held(chain, lo, self)

    # -- views -------------------------------------------------------------------------------

    def _view(self, w: _Worker, now: float, held: _Held) -> WorkerView:
        n = held.depth(w.idx)
        m = self._cpu_extent(w, held.chain, n) if self.offloads else n
        closed = self.closed_to_programs
        return self._view_at(
            w,
            now,
            n,
            m,
            self.ws.tokens(w.wid, now) if self.ws_views else 0,
            closed is not None and closed(w.wid, now),
            self._windows_at(w, held.chain, n) if self.windows_kept and n else None,
        )

    def _view_at(
        self,
        w: _Worker,
        now: float,
        n: int,
        m: int,
        ws_tokens: int,
        closed: bool = False,
        restorable: int | None = None,
    ) -> WorkerView:
        """The view of `w` at `now` for a request whose chain it holds `n` blocks of in HBM
        and `m` in HBM and CPU together; `ws_tokens` its working set; `closed`: admission
        closed it to programs; `restorable`: the deepest boundary whose windows its HBM holds
        (a hybrid spec under a retention that keeps some only; None: every one)."""
        jobs, tokens = w.pending_tokens(now)
        if m > n:
            cached = {Tier.GPU: n, Tier.CPU: m} if n else {Tier.CPU: m}
        else:
            cached = {Tier.GPU: n} if n else {}
        return WorkerView(
            worker_id=w.wid,
            role=w.role,
            running=w.decode_active,
            waiting=jobs,
            inflight_prefill_tokens=tokens,
            kv_usage=self._kv_usage(w, now),
            cached_blocks=cached,
            node=w.node,
            nic_backlog_s=max(0.0, self.nic_free_at.get(w.node, 0.0) - now),
            kv_same_host=self.spec.kv_same_host,
            kv_transport=self.spec.kv_transport,
            kv_capacity_tokens=w.capacity * self.spec.block_tokens,
            ws_tokens=ws_tokens,
            offloads=self.offloads,
            programs_closed=closed,
            restorable_blocks=restorable,
            cached_tokens=len(w.cache) * self.spec.block_tokens,
        )

    def _kv_usage(self, w: _Worker, now: float) -> float:
        """vLLM's kv_cache_usage_perc, as the router sees it: blocks referenced by running
        sequences (not the idle prefix cache), sampled every `load_scrape_s`."""
        period = self.spec.load_scrape_s
        if period <= 0:
            return min(1.0, w.decode_ctx / (w.capacity * self.spec.block_tokens))
        k = now // period
        if k > w.scraped[0]:
            w.scraped = (k, min(1.0, w.decode_ctx / (w.capacity * self.spec.block_tokens)))
        return w.scraped[1]

    # -- run ---------------------------------------------------------------------------------

    def run(self, sessions: list[SimSession]) -> SimResult:
        import time as _time

        t_wall = _time.perf_counter()
        heap: list[tuple[float, int, int, int, int]] = []
        seq = 0
        self._children: dict[int, list[tuple[int, int]]] = {}
        """Parent session -> (turn, subagent) of the subagents its turns spawn, not yet."""
        for si, s in enumerate(sessions):
            if s.spawned_at is not None:  # arrives when its parent's turn does
                parent, at = s.spawned_at
                self._children.setdefault(parent, []).append((at, si))
            else:
                heap.append((s.start_s, seq, _ARRIVE, si, 0))
                seq += 1
            if self.oracle:
                for turn in s.turns:
                    for b in turn.chain:
                        self.future_refs[b] = self.future_refs.get(b, 0) + 1
        heapq.heapify(heap)
        if self.rate_per_min is None:
            span = max((s.start_s for s in sessions), default=0.0) - min(
                (s.start_s for s in sessions), default=0.0
            )
            self.rate_per_min = 60.0 * len(sessions) / span if span > 0 else 0.0
        res = SimResult(
            policy=self.policy.name,
            workers=len(self.workers),
            sessions=len(sessions),
            requests=0,
            events=0,
            wall_s=0.0,
            sim_s=0.0,
            slo_ttft_p90_s=self.slo_ttft_p90_s,
            rate_per_min=self.rate_per_min,
        )
        self._res = res
        self._heap = heap
        self._seq = seq
        self._sessions = sessions
        self._sids = [str(i) for i in range(len(sessions))]
        self._prev_tokens = [0] * len(sessions)
        self._chains: dict[int, tuple[int, ...]] = {}
        """Each session's latest prompt chain (a subagent's prefix shared with its spawner)."""
        self._attained = [0] * len(sessions)
        self._ttfts: list[list[float]] = [[] for _ in sessions]
        self._waiting: dict[Hashable, tuple[int, float]] = {}  # session -> (turn, arrived)
        # decodes in flight: id -> (session, turn, worker, ctx, decode start, decode seconds)
        self._live: dict[int, tuple[int, int, int, int, float, float]] = {}
        live = self._live
        ws = self.ws
        gate = self.gate
        sids = self._sids
        tick_s = gate.tick_s if gate is not None else 0.0
        if tick_s > 0 and heap:
            heapq.heappush(heap, (heap[0][0] + tick_s, -1, _TICK, 0, 0))
        self._session_start = session_start = [s.start_s for s in sessions]
        slo = self.slo_ttft_p90_s
        # time integrals of cached blocks (all copies) and of distinct blocks
        dup_num = dup_den = 0.0
        now = last = heap[0][0] if heap else 0.0
        while heap:
            now, _, kind, a, b = heapq.heappop(heap)
            res.events += 1
            dt = now - last
            if dt > 0:
                dup_num += self.cached_blocks * dt
                dup_den += len(self.holders) * dt
                last = now
            if kind == _TICK:
                assert gate is not None
                gate.tick(now)
                self._release(now)
                if heap or self._waiting:  # more to come: the loop goes on
                    heapq.heappush(heap, (now + tick_s, -1, _TICK, 0, 0))
                continue
            if kind == _DECODE_END:
                si, ti, wi, ctx, ds, need = live[a]
                w = self.workers[wi]
                # progress = time since the decode started minus prefill compute on its worker
                stalled = w.stalled_before(now) - w.stalled_before(ds)
                left = need - (now - ds - stalled)
                if left > 1e-9:
                    heapq.heappush(heap, (now + left, self._seq, _DECODE_END, a, 0))
                    self._seq += 1
                    continue
                del live[a]
                w.decode_active -= 1
                if self._full is not None:
                    self._full.changed(wi)
                w.decode_ctx -= ctx
                sess = sessions[si]
                done = ti + 1 >= len(sess.turns)
                ws.ended(sids[si], ctx, now)
                self._attained[si] += ctx
                if not done:
                    nxt = sess.turns[ti + 1]
                    heapq.heappush(heap, (now + nxt.gap_s, self._seq, _ARRIVE, si, ti + 1))
                    self._seq += 1
                else:
                    self._spawn(si, None, now)
                    res.session_e2e_s.append(now - session_start[si])
                    res.sessions_completed += 1
                    p90 = percentile(self._ttfts[si], 90)
                    if p90 is not None and p90 <= slo:
                        res.sessions_good += 1
                    self._ttfts[si] = []
                if gate is not None:
                    gate.ended(si, w.wid, ctx, now, done)
                    self._release(now)
                continue
            si, ti = a, b
            if si in self._children:
                self._spawn(si, ti, now)
            spawner = sessions[si].spawned_at
            if gate is not None and ti == 0 and spawner and spawner[0] in self.session_owner:
                # a subagent of a session already under way is part of its program, as the
                # router learns from `x-parent-session-id` (router/session.py)
                gate.spawned(si, spawner[0])
            if gate is not None and not gate.arrive(
                si, sessions[si].turns[ti].input_tokens, self._attained[si], now
            ):
                self._waiting[si] = (ti, now)
                self._release(now)  # refused ones end here
                continue
            self._start(si, ti, now, now)
        res.sim_s = now
        res.wall_s = _time.perf_counter() - t_wall
        res.dup_factor = dup_num / dup_den if dup_den else 1.0
        res.offload_bytes = self.offload_bytes
        if gate is not None:
            res.queued = gate.queued
            res.queue_waits_s = list(gate.waits_s)
            res.paused = gate.programs_paused
        # sessions whose whole context fits in the cluster's KV HBM, given the policy's
        # duplication: HBM / (mean final context bytes of a session × duplicate factor)
        total_hbm = sum(w.capacity for w in self.workers) * self.block_bytes
        if sessions:
            mean_ctx = sum(
                s.turns[-1].input_tokens + s.turns[-1].output_tokens for s in sessions
            ) / len(sessions)
            per_session = self._session_bytes(int(mean_ctx)) * max(res.dup_factor, 1.0)
            res.max_concurrent_sessions = total_hbm / per_session
        return res

    def _release(self, now: float) -> None:
        """Plan the waiting requests the gate lets go now; end the sessions it refused."""
        gate = self.gate
        assert gate is not None
        waiting = self._waiting
        for si in gate.rejected(now):
            if waiting.pop(si, None) is not None:
                self._res.rejected_429 += 1  # the client got a 429: its session ends here
                self._spawn(si, None, now)  # type: ignore[arg-type]
        while (si := gate.next_release(now)) is not None:
            entry = waiting.pop(si, None)
            if entry is not None:
                self._start(si, entry[0], now, entry[1])  # type: ignore[arg-type]

    def _spawn(self, si: int, turn: int | None, now: float) -> None:
        """Session `si` reached `turn` (None: it ended): its subagents spawned there (or, once
        it ended, all still unspawned) arrive now, after this event."""
        children = self._children.get(si)
        if not children:
            return
        keep = []
        for t, child in children:
            if turn is None or t <= turn:
                self._session_start[child] = now
                heapq.heappush(self._heap, (now, self._seq, _ARRIVE, child, 0))
                self._seq += 1
            else:
                keep.append((t, child))
        if keep:
            self._children[si] = keep
        else:
            del self._children[si]

    def _start(self, si: int, ti: int, now: float, arrived: float) -> None:
        """Plan and run turn `ti` of session `si` at `now` (it arrived at `arrived`)."""
        prof = self.profile
        res = self._res
        sess = self._sessions[si]
        turn = sess.turns[ti]
        if self.oracle:
            for blk in turn.chain:
                self.future_refs[blk] -= 1
        held = self._held(turn.chain)
        best_avail = held.best
        owner_idx = self.owner.get(turn.chain[best_avail - 1]) if best_avail else None
        so = self.session_owner.get(si if sess.fork_of is None else sess.fork_of)
        sid = self._sids[si]
        if self._full is not None:
            view = self._full.view(now, held)
        else:
            view = ClusterView(workers=tuple(self._view(w, now, held) for w in self.workers))
        cal = self.calibrator
        if cal is not None:
            observed = self._observed
            while observed and observed[0][0] <= now:
                _, _, done, ttft, tpot, moved = heapq.heappop(observed)
                cal.observe_plan(done, ttft_s=ttft, tpot_s=tpot, transfer_s=moved)
            view = cal.apply_all(view)
        home, home_tokens = self.ws.home(sid, now)
        req = RequestView(
            model=self.model,
            prompt_tokens=turn.input_tokens,
            block_size=self.spec.block_tokens,
            chain_blocks=len(turn.chain),
            max_tokens=turn.output_tokens,
            session_id=sid,
            session_owner=self.workers[so].wid if so is not None else None,
            owner=self.workers[owner_idx].wid if owner_idx is not None else None,
            owner_blocks=best_avail,
            previous_prompt_tokens=self._prev_tokens[si],
            idle_s=turn.gap_s,
            is_fork=sess.fork_of is not None,
            kv_bytes_per_token=prof.kv_bytes_per_token,
            kv_spec=self.kv_spec,
            chain=turn.chain,
            home_worker=home,
            home_tokens=home_tokens,
            growth_tokens=self.ws.growth(turn.input_tokens),
            fetch_reuse=self.reuse.rate(CopyKind.FETCH, now),
            prompt_reuse=self.reuse.rate(CopyKind.PROMPT, now),
        )
        try:
            plan = self.policy.plan(req, view)
        except RequestRejectedError:
            res.rejected += 1  # the client got a 429: its session ends here
            self._spawn(si, None, now)
            if self.gate is not None:
                self.gate.ended(si, "", 0, now, True)
            return
        self.reuse.observe(plan, req, view, now)
        wi, ctx, ds, need = self._execute(plan, turn, held, best_avail, now, arrived, res)
        if cal is not None:  # what the router observes: TTFT from the plan, TPOT, the move
            first = arrived + res.ttft_s[-1]
            heapq.heappush(
                self._observed,
                (first, self._seq, plan, first - now, res.tpot_s[-1], self._moved_s),
            )
        seq = self._seq
        self._live[seq] = (si, ti, wi, ctx, ds, need)
        heapq.heappush(self._heap, (ds + need, seq, _DECODE_END, seq, 0))
        self._seq = seq + 1
        res.requests += 1
        self._ttfts[si].append(res.ttft_s[-1])
        kv = self.kv_spec
        if kv is not None and self.offloads:
            # the windows checkpointed as the prompt grew from the last turn's (write-through)
            pol = self.swa_policy or kv.swa_policy
            if pol.resolved:
                res.swa_written_bytes += kv.swa_write_bytes(
                    pol, turn.input_tokens
                ) - kv.swa_write_bytes(pol, min(self._prev_tokens[si], turn.input_tokens))
        self._prev_tokens[si] = turn.input_tokens
        d = self.by_id[plan.chosen.decode_worker]
        self.session_owner[si] = d.idx
        self._chains[si] = turn.chain
        spawner = sess.spawned_at[0] if sess.spawned_at is not None else None
        shared = 0
        if spawner is not None:  # its spawner's prefix, kept once by the engine
            mine, theirs = turn.chain, self._chains.get(spawner, ())
            while shared < len(mine) and shared < len(theirs) and mine[shared] == theirs[shared]:
                shared += 1
        self.ws.started(sid, d.wid, turn.input_tokens, now)
        if spawner is not None:
            self.ws.shares(sid, self._sids[spawner], shared * self.spec.block_tokens)
        if self.gate is not None:
            self.gate.started(si, d.wid, turn.input_tokens, now)

    def _session_bytes(self, tokens: int) -> float:
        """HBM a session of `tokens` holds: K·tokens dense; with a spec its sealed KV, windows
        and tail (`total_bytes`), plus every token's window entries without typed state."""
        kv = self.kv_spec
        if kv is None:
            return tokens * self.profile.kv_bytes_per_token
        extra = 0 if self.typed_state else tokens * kv.swa_bytes_per_token
        return kv.total_bytes(tokens) + extra

    def _resume(
        self, rule: ResumeRule, sealed: int, windows: int, limit: int, res: SimResult
    ) -> float:
        """A hybrid hit of `sealed` blocks with windows at `windows` resumes by the engine's
        rule (`resume_point`, the profile's prefill timing, at most `limit` blocks): sets
        `_resumed_blocks`, counts the resume and its rebuilt tokens, and returns the
        rebuild's seconds (prefill_s(R, S − R) − base_s, as the emulated engine charges)."""
        prof = self.profile
        out = resume_point(rule, prof.prefill, sealed, windows, limit=limit)
        self._resumed_blocks = out.blocks
        res.resumes[out.how] = res.resumes.get(out.how, 0) + 1
        res.window_rebuild_tokens += out.rebuild_tokens
        bs = self.spec.block_tokens
        return rebuild_s(prof.prefill, out.rebuild_tokens, out.blocks * bs)

    def _path(self, src: _Worker, dst: _Worker) -> KVTransport:
        """The KV transport from src into dst, by the planner's rule (`kv_transport_into`)."""
        spec = self.spec
        return kv_transport_into(src.node == dst.node, spec.kv_same_host, spec.kv_transport)

    def _transfer(self, src: _Worker, dst: _Worker, nbytes: float, ready: float) -> float:
        """Queue `nbytes` on the sender's NIC from `ready` (its node's fast link within a node);
        they take the path the planner priced (`_path`). Returns the arrival time."""
        if nbytes <= 0:
            return ready
        same = src.node == dst.node
        key = src.node if not same else f"{src.node}:nvlink"
        start = max(ready, self.nic_free_at.get(key, 0.0))
        done = start + self.profile.link.transfer_s(nbytes, self._path(src, dst))
        self.nic_free_at[key] = done
        if self._full is not None and not same:
            self._full.nic_busy.add(src.node)
        return done

    def _execute(
        self,
        plan: Plan,
        turn: Any,
        held: _Held,
        best_avail: int,
        now: float,
        arrived: float,
        res: SimResult,
    ) -> tuple[int, int, float, float]:
        """Run `plan` for `turn`; returns (decode worker, context tokens, decode start, decode
        seconds without stalls)."""
        prof = self.profile
        bt = self.spec.block_tokens
        c = plan.chosen
        p = self.by_id[c.prefill_worker]
        d = self.by_id[c.decode_worker]
        res.actions[c.action.value] = res.actions.get(c.action.value, 0) + 1
        ready = now
        self._moved_s = None
        reused_blocks = held.depth(p.idx)
        extra_recompute_s = 0.0  # a hybrid restore's windows and incomplete block
        load_ready: float | None = None  # when a CPU-tier restore's load is done
        rule = self.resume_rule
        limit = (turn.input_tokens - 1) // bt  # the engine computes the last prompt token
        resumed = False  # the hybrid resume rule placed the hit already
        if c.action in (Action.ARTIFACT_FETCH, Action.STATE_MIGRATION) and c.source_worker:
            # both copy the source's prefix into P (the router's `fetch`, the emulator's
            # /ownerserve/kv/fetch); the source keeps its copy (it is evictable there)
            src = self.by_id[c.source_worker]
            fetch_blocks = max(0, held.depth(src.idx) - reused_blocks)
            nbytes = fetch_blocks * self.block_bytes
            kv = self.kv_spec
            if kv is not None and rule is not None and fetch_blocks:
                # what the planner priced (RequestCosts.peer_restore): the sealed blocks move
                # (a fetch brings no windows), and P resumes by the rule over its own windows
                lo, hi = reused_blocks * bt, (reused_blocks + fetch_blocks) * bt
                nbytes = kv.sealed_bytes(lo, hi)
                if FETCH_BRINGS_WINDOWS:
                    nbytes += kv.mutable_bytes(hi)
                own = self._windows_at(p, turn.chain, reused_blocks)
                sealed = reused_blocks + fetch_blocks
                windows = moved_windows(own, sealed, FETCH_BRINGS_WINDOWS)
                extra_recompute_s += self._resume(rule, sealed, windows, limit, res)
                resumed = True
            elif kv is not None and fetch_blocks:
                # what the planner priced (RequestCosts.peer_restore): sealed KV and the
                # windows at the boundary from the peer's GPU, the incomplete block recomputed
                r = min((reused_blocks + fetch_blocks) * bt, turn.input_tokens - 1)
                peer = plan_restore(
                    kv,
                    r,
                    Tier.GPU,
                    prof,
                    path=self._path(src, p),
                    resident_tokens=reused_blocks * bt,
                    overlap=False,
                )
                nbytes = peer.loaded_bytes
                extra_recompute_s += peer.restore_s - peer.load_s
            ready = self._transfer(src, p, nbytes, now)
            self._moved_s = ready - now if nbytes else None
            res.fetch_kv_bytes += nbytes
            res.network_kv_bytes += nbytes
            reused_blocks = self._resumed_blocks if resumed else reused_blocks + fetch_blocks
            self._insert(p, turn.chain[: held.depth(src.idx)])
        if self.offloads:
            # the prefix past HBM found in P's CPU tier loads over PCIe instead of recomputing
            # (vLLM's offloading connector: the load runs before the prefill is scheduled)
            extent = self._cpu_extent(p, turn.chain, reused_blocks)
            if extent > reused_blocks:
                loaded = extent - reused_blocks
                cpu = p.cpu
                for blk in turn.chain[reused_blocks:extent]:
                    cpu.move_to_end(blk)
                kv = self.kv_spec
                if kv is None:
                    load_s = loaded * self.block_bytes / prof.link.cpu_load_bps
                else:
                    # the same restore plan the planner priced (RequestCosts.restore), under the
                    # spec's SWA policy (every window kept, without typed state)
                    rp = plan_restore(
                        kv,
                        min(extent * bt, turn.input_tokens - 1),
                        Tier.CPU,
                        prof,
                        resident_tokens=reused_blocks * bt,
                        swa_policy=self.swa_policy,
                        overlap=False,
                    )
                    load_s = rp.load_s
                    extra_recompute_s += rp.restore_s - rp.load_s
                    res.restore_recompute_s.append(rp.restore_s - rp.load_s)
                    res.restore_load_s.append(load_s)
                load_ready = now + load_s
                ready = max(ready, load_ready)
                res.cpu_hit_tokens += min(extent * bt, turn.input_tokens) - min(
                    reused_blocks * bt, turn.input_tokens
                )
                reused_blocks = extent
                resumed = True  # the restore plan rebuilt its windows (planner.restore)
        if rule is not None and not resumed and reused_blocks:
            # a GPU hit resumes where P's windows are, or rebuilds them (the engine's rule)
            k = self._windows_at(p, turn.chain, reused_blocks)
            extra_recompute_s += self._resume(rule, reused_blocks, k, limit, res)
            reused_blocks = self._resumed_blocks
        reused_tokens = min(reused_blocks * bt, turn.input_tokens)
        new_tokens = turn.input_tokens - reused_tokens
        start = max(ready, p.prefill_free_at)
        if load_ready is not None and self.kv_spec is not None:
            res.restore_queue_s.append(start - load_ready)
        dur = prof.prefill_s(new_tokens, reused_tokens) + extra_recompute_s
        if new_tokens > 0 or extra_recompute_s > 0:
            p.add_stall(start, dur)
        if p.decode_active and new_tokens > 0:
            # each chunk's step also advances the running decodes by one token
            chunks = -(-new_tokens // prof.max_batched_tokens)
            dur += chunks * prof.decode_step_s(p.decode_active, p.decode_ctx)
        prefill_end = start + dur
        p.prefill_free_at = prefill_end
        p.pending.append((prefill_end, new_tokens))
        if self._full is not None:
            self._full.changed(p.idx, d.idx, until=prefill_end)
        res.prefill_tokens += new_tokens
        res.reused_tokens += reused_tokens
        if p.decode_active:
            res.decode_interference_s += dur * p.decode_active
        self._insert(p, turn.chain)
        self._keep_windows(p, turn.chain, reused_blocks, len(turn.chain))
        if best_avail:
            res.owner_opportunities += 1
            if reused_blocks >= best_avail:
                res.owner_hits += 1
        decode_ready = prefill_end
        if d is not p:
            d_has = held.depth(d.idx)
            kv = self.kv_spec
            if kv is None:
                nbytes = max(0, turn.input_tokens - d_has * bt) * prof.kv_bytes_per_token
            else:  # RequestCosts.kv_to_decode's bytes: sealed rate, plus windows and tail at N
                nbytes = round(max(0, turn.input_tokens - d_has * bt) * kv.bytes_per_token())
                nbytes += kv.mutable_bytes(turn.input_tokens)
            decode_ready = self._transfer(p, d, nbytes, prefill_end)
            self._moved_s = decode_ready - prefill_end if nbytes else None
            res.pd_kv_bytes += nbytes
            res.network_kv_bytes += nbytes
            self._insert(d, turn.chain)
            # the pull brings the windows at the prompt's end (`kv_to_decode`'s M(N))
            self._keep_windows(d, turn.chain, len(turn.chain) - 1, len(turn.chain))
            # the router's commit: the decode worker claims the blocks this request created;
            # P keeps a transient (evictable) copy
            owner = self.owner
            for b in turn.chain[best_avail:]:
                if owner.get(b) == p.idx:
                    owner[b] = d.idx
        ctx = turn.input_tokens + turn.output_tokens
        d.decode_active += 1
        d.decode_ctx += ctx
        step = prof.decode_step_s(d.decode_active, d.decode_ctx)
        ttft = decode_ready + step - arrived  # a gate's wait included: the client waited
        res.ttft_s.append(ttft)
        res.tpot_s.append(step)
        return d.idx, ctx, decode_ready, step * max(1, turn.output_tokens)
