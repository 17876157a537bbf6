"""Value types the planner reads (`RequestView`, `ClusterView`) and returns (`Plan`).

The router builds the views from the directory's `Match` and the worker pool's load; policies
are pure functions of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from ownerserve.kvstate import KVStateSpec
from ownerserve.records import fast_init
from ownerserve.types import KVTransport, Role, Tier


class Action(StrEnum):
    """The planner's action set: where prefill and decode run, decided per step."""

    COLOCATED_PREFILL = "colocated_prefill"
    REMOTE_PREFILL = "remote_prefill"
    DECODE_CONTINUATION = "decode_continuation"
    ARTIFACT_FETCH = "artifact_fetch"
    TAIL_RECOMPUTE = "tail_recompute"
    STATE_MIGRATION = "state_migration"


class RequestClass(StrEnum):
    """The request classes (planner/README.md, *Actions and request classes*)."""

    NEW_LONG_PREFIX = "new_long_prefix"
    SMALL_INCREMENTAL_TURN = "small_incremental_turn"
    LONG_TOOL_OUTPUT = "long_tool_output"
    DECODE_CONTINUATION = "decode_continuation"
    FORKED_ROLLOUT = "forked_rollout"
    COLD_RESUME = "cold_resume"


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as the planner sees it for one request."""

    worker_id: str
    role: Role
    healthy: bool = True
    profile: str = "default"
    running: int = 0
    waiting: int = 0
    inflight_prefill_tokens: int = 0
    kv_usage: float = 0.0
    # longest prefix of this request's chain held on this worker, in blocks, per tier
    cached_blocks: dict[Tier, int] = field(default_factory=dict)
    node: str = "node0"
    # online calibration: observed/predicted ratios (1.0 = profile is exact)
    prefill_scale: float = 1.0
    decode_scale: float = 1.0
    # online calibration of KV transfers *into* this worker (observed/predicted)
    link_scale: float = 1.0
    # seconds of KV transfers already queued to leave this worker's node over its inter-node
    # link (the node's NIC), as far as the router knows them (the transfers it started): a
    # transfer from this worker to another node starts only after them. A property of the
    # node: every worker of a node carries the same value.
    nic_backlog_s: float = 0.0
    # the data path KV takes into it (`ownerserve.profiles.kv_transport_into`): from a peer on
    # its node through host memory when `kv_same_host`, else through the store transport its
    # KV client speaks (`kv_transport`: store_rdma, priced as the profile's inter-node link
    # unless the profile names it; or store_tcp)
    kv_same_host: bool = True
    kv_transport: KVTransport = KVTransport.STORE_RDMA
    # tokens of KV this worker's pool holds in all (0: unknown, the profile's HBM); with
    # kv_usage, what a request's KV must fit in (T_queue's wait for KV)
    kv_capacity_tokens: int = 0
    # tokens of KV the router counts in this worker's working set (planner.workingset): the
    # sessions whose KV lives here with a request in flight or inside a tool gap predicted
    # short — reusable KV that a request needing room here displaces (W_disp)
    ws_tokens: int = 0
    # the worker offloads evicted KV to a CPU tier: displaced KV is reloaded from there, not
    # recomputed (W_disp)
    offloads: bool = False
    # seconds a KV hand-over into this worker (a remote prefill's D, a fetch's or migration's
    # P) has taken beyond what the profile predicts, learnt online (planner.calibration):
    # queueing on two engines, the pull, the protocol's round trips — the T_network of a
    # route moving KV into it adds them
    handover_s: float = 0.0
    # the router's admission closed this worker to programs (its sessions' working set is
    # over the high watermark): a session whose KV is not counted here may not start or resume
    # on it while another worker is open (T_queue + PROGRAMS_CLOSED_S)
    programs_closed: bool = False
    # how KV can move into or out of it (its `kv_paths`): `pd_group` names the P/D hand-over
    # it speaks (a remote prefill pairs a P and a D of one group; None: it takes part in
    # none); `kv_api` that it can pull a fetched prefix in and serve its own (artifact fetch
    # and state migration need it at both ends)
    pd_group: str | None = "pd"
    kv_api: bool = True
    # its KV API also pulls and serves position-independent chunks (a chunk fetch's ends)
    chunk_api: bool = True
    # chunk reuse (ownerserve/chunks.py): the request's chunks (indices into
    # `RequestView.chunk_spans`) whose KV this worker's chunk store holds, as the directory
    # says; a prefill here copies them (re-rotated) instead of computing them
    chunks_held: tuple[int, ...] = ()
    # HeteroCache: the deepest boundary of the request's chain (blocks) at which this worker's
    # HBM holds every KV cache group — the sliding windows and per-sequence state too, not only
    # the sealed blocks (the directory's restorable unit, `Match.restorable`); a hybrid model's
    # hit resumes there or rebuilds its windows (`ownerserve.kvstate.resume`). None: not known
    # (its events name no KV cache groups), as if its HBM kept every cached boundary's windows
    restorable_blocks: int | None = None
    # its engine rebuilds a hybrid model's windows at the sealed boundary when that is the
    # cheaper (`ownerserve.kvstate.resume`, the emulated engine); False: it only cuts the hit
    # back to `restorable_blocks` (vLLM)
    rebuilds_windows: bool = True
    # tokens of KV its HBM pool holds in all: the running sequences' and the idle prefix
    # cache's (the GPU blocks its KV events say are stored, × block size; the simulator's
    # cache); what a copy put here evicts once the pool is full (X_dup). 0: not known
    cached_tokens: int = 0


@fast_init
@dataclass(frozen=True, slots=True)
class RequestView:
    """One agent step as the planner sees it."""

    model: str
    prompt_tokens: int
    block_size: int
    chain_blocks: int
    max_tokens: int = 256
    session_id: str | None = None
    session_owner: str | None = None
    owner: str | None = None
    owner_blocks: int = 0
    previous_prompt_tokens: int = 0
    idle_s: float = 0.0
    n: int = 1
    is_fork: bool = False
    kv_bytes_per_token: int = 131072
    # the prompt's block hashes as the router computes them (each names its whole prefix):
    # what the peer routers' own prefix trees are keyed by (planner.policies.peers)
    chain: tuple[int, ...] = ()
    # where this request's own session is counted in a working set (planner.workingset) and
    # with how many tokens: on that worker they are the request's own KV, not displaced
    home_worker: str | None = None
    home_tokens: int = 0
    # tokens of KV the session is expected to add beyond this request (planner.workingset
    # .WorkingSets.growth): a placement that fits it now but not its growth still displaces
    growth_tokens: int = 0
    # the share of copied blocks hit again soon (planner.copyreuse.CopyReuse.rate; 1: every
    # copy is reused), per kind of copy: a fetch's replica (`fetch_reuse`), a remote prefill's
    # prompt kept on P (`prompt_reuse`). X_dup weighs each by 1 / max(u, floor)
    # (planner.cost.reuse_weight)
    fetch_reuse: float = 1.0
    prompt_reuse: float = 1.0
    # chunk reuse: the prompt's chunks as token spans [start, end), in prompt order
    # (ownerserve/chunks.py); () for a prompt without chunks
    chunk_spans: tuple[tuple[int, int], ...] = ()
    # HeteroCache: the model's KV state spec. When set, the cost terms size KV by it (its
    # sealed bytes per token for K, its windows and tail at N where the state moves) and
    # price every restore (CPU/SSD tier, fetch, migration) with planner.restore; None: K =
    # kv_bytes_per_token as a dense model
    kv_spec: KVStateSpec | None = None


@fast_init
@dataclass(frozen=True, slots=True)
class ClusterView:
    """The workers that may serve a request (`workers`), and those that may only be a source
    of its KV (`sources`: e.g. draining workers, whose sessions move away by fetch or
    migration). `pd_mixed`: the workers speak more than one P/D hand-over (`pd_group`)."""

    workers: tuple[WorkerView, ...]
    sources: tuple[WorkerView, ...] = ()
    pd_mixed: bool = False

    def by_id(self, worker_id: str) -> WorkerView | None:
        for w in self.workers:
            if w.worker_id == worker_id:
                return w
        for w in self.sources:
            if w.worker_id == worker_id:
                return w
        return None


@fast_init
@dataclass(frozen=True, slots=True)
class CostBreakdown:
    """C(a) = T_queue + T_compute + T_network + T_restore + λ·M_HBM + μ·I_decode + H_move
    + W_disp (seconds)."""

    t_queue: float = 0.0
    t_compute: float = 0.0
    t_network: float = 0.0
    t_restore: float = 0.0
    m_hbm_bytes: float = 0.0
    i_decode: float = 0.0
    lam: float = 0.0
    mu: float = 0.0
    # informational parts of the prediction (not added to `total`): the prefill part of
    # t_compute, and one decode step of this request on its decode worker (predicted TPOT)
    t_prefill: float = 0.0
    t_decode_step: float = 0.0
    # a state migration's hysteresis (planner.cost.h_move); 0 for every other action
    h_move: float = 0.0
    # informational: the time the transfer adds to its source node's NIC backlog (planner.cost
    # .t_nic; 0 when no KV crosses nodes)
    t_nic: float = 0.0
    # the reload of other sessions' reusable KV the route's new KV displaces (planner.cost
    # .RequestCosts.displacement, on P and D)
    w_disp: float = 0.0
    # informational: the KV transfer's own predicted seconds inside t_network (transfer_s, the
    # link at its learnt scale and the NIC backlog), without the learnt hand-over overhead or
    # P->D's handshake: what the link scale is calibrated against (planner.calibration)
    t_transfer: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.t_queue
            + self.t_compute
            + self.t_network
            + self.t_restore
            + self.lam * self.m_hbm_bytes
            + self.mu * self.i_decode
            + self.h_move
            + self.w_disp
        )


@fast_init
@dataclass(frozen=True, slots=True)
class Candidate:
    """One (action, workers) option with its cost."""

    action: Action
    prefill_worker: str
    decode_worker: str
    cost: CostBreakdown
    source_worker: str | None = None
    reused_blocks: int = 0
    # chunk reuse: the request's chunks (indices into `RequestView.chunk_spans`) its prefill
    # worker fetches before it runs, each with the holder it comes from (planner.cost
    # .RequestCosts.chunk_fetch); () when it fetches none
    chunk_fetches: tuple[tuple[int, str], ...] = ()


@fast_init
@dataclass(frozen=True, slots=True)
class Plan:
    """The policy's decision: the chosen candidate, the runner-up and the margin between them."""

    policy: str
    request_class: RequestClass
    chosen: Candidate
    runner_up: Candidate | None = None
    add_replica_on: str | None = None
    candidates_considered: int = 1
    # the request class's default action and the cost of its cheapest candidate (None when no
    # candidate had that action, or the policy does not weigh it: the baselines); the cost
    # model overrides the default when another candidate is cheaper
    default_action: Action | None = None
    default_cost_s: float | None = None

    @property
    def action(self) -> Action:
        return self.chosen.action

    @property
    def margin_s(self) -> float:
        return 0.0 if self.runner_up is None else self.runner_up.cost.total - self.chosen.cost.total

    @property
    def overrides_default(self) -> bool:
        """True when the cost model chose another action than the request class's default."""
        return self.default_action is not None and self.chosen.action != self.default_action


class Policy(Protocol):
    """A routing policy: pure, no I/O, fast enough to run per request."""

    name: str

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        """Choose where prefill runs and where decode continues for `request`."""
        ...
