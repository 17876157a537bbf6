"""What each part of the router is given instead of the whole `Router`: one small frozen bundle
of services per stage of the request path (`RequestServices`, which `router.state.Router`
rebuilds whenever what it holds changes), so a stage's signature says which services it
reads; and the router's state as the planner's views (`ClusterSources`) and worker membership
(`Members`) read it."""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ownerserve.config import ServerSettings, Settings
from ownerserve.directory.base import Directory
from ownerserve.kvstate import KVStateSpec
from planner.calibration import Calibrator
from planner.copyreuse import CopyReuse
from planner.policies import Planner
from planner.workingset import WorkingSets
from router.admission import Admission
from router.commit import CommittedLeases, Lifetimes, PendingCommits
from router.executor import PlanExecutor
from router.lease import LeaseServices
from router.links import NicLedger
from router.plans import PlanRecord
from router.pool import WorkerPool
from router.session import DerivedSessionCache, SessionTable
from router.telemetry import RouterMetrics
from router.tokens import TokenizationCache

Spawn = Callable[[Awaitable[Any]], Any]
"""Run a coroutine in the background (`Router.spawn`: the router's close waits for it)."""
Span = Callable[..., Any]
"""`Telemetry.start_span`: a span as a context manager (a shared no-op with tracing off)."""


class ClusterSources(Protocol):
    """What `router.views.cluster_view` builds the planner's `ClusterView` from."""

    @property
    def pool(self) -> WorkerPool: ...
    @property
    def calibrator(self) -> Calibrator: ...
    @property
    def nics(self) -> NicLedger: ...
    @property
    def working_sets(self) -> WorkingSets: ...
    @property
    def admission(self) -> Admission: ...
    @property
    def settings(self) -> Settings: ...
    @property
    def copy_reuse(self) -> CopyReuse: ...


class Members(Protocol):
    """The router's state as `router.membership` reads and changes it."""

    @property
    def settings(self) -> Settings: ...
    @property
    def pool(self) -> WorkerPool: ...
    @property
    def tokenizers(self) -> TokenizationCache: ...
    @property
    def directory(self) -> Directory | None: ...
    @property
    def subscribers(self) -> list[Any]: ...
    @property
    def started(self) -> bool: ...
    @property
    def undropped(self) -> set[str]: ...
    @property
    def working_sets(self) -> WorkingSets: ...
    @property
    def calibrator(self) -> Calibrator: ...
    @property
    def metrics(self) -> RouterMetrics: ...
    @property
    def committed_leases(self) -> CommittedLeases: ...


@dataclass(frozen=True, slots=True)
class ParseServices:
    """`parse`: the configured models' tokenizers, and the pool (a model no worker serves is
    a 404)."""

    tokenizers: TokenizationCache
    pool: WorkerPool


@dataclass(frozen=True, slots=True)
class LookUpServices:
    """`look_up`: the directory, the session's commits still in flight (waited for first),
    and the counter of failed lookups."""

    directory: Directory | None
    pending: PendingCommits
    errors: Any


@dataclass(frozen=True, slots=True)
class ViewServices:
    """`view`: the policies, whether a request may pick one (`planner.allow_policy_header`),
    the sessions it marks seen, what the request view reads of the working sets, each
    model's KV state spec by name (`models[].kv_spec`; None: dense), and the reuse rates of
    the planner's copies (`copy_reuse`)."""

    planner: Planner
    policy_header: bool
    sessions: SessionTable
    working_sets: WorkingSets
    kv_bytes_per_token: int
    kv_specs: Mapping[str, KVStateSpec | None]
    copy_reuse: CopyReuse


@dataclass(frozen=True, slots=True)
class ClusterServices:
    """`plan`: the `ClusterSources` of the planner's cluster view, and the reuse rates of the
    planner's copies each plan feeds (`copy_reuse`)."""

    pool: WorkerPool
    calibrator: Calibrator
    nics: NicLedger
    working_sets: WorkingSets
    admission: Admission
    settings: Settings
    copy_reuse: CopyReuse


@dataclass(frozen=True, slots=True)
class ExecuteServices:
    """`execute`: the plan executor (None until the router starts), the pool, each hop's
    bounds, and the metrics of fetches and of hops given up."""

    executor: PlanExecutor | None
    pool: WorkerPool
    limits: ServerSettings
    metrics: RouterMetrics


@dataclass(frozen=True, slots=True)
class StreamServices:
    """`stream`: the metrics of failed streams, the pool (a worker that failed mid-stream is
    checked at once, in the background), the plans `GET /admin/plans` lists, and the KV
    transports planned at a measured price (`plans.kv_prices_field`; "" when none)."""

    metrics: RouterMetrics
    pool: WorkerPool
    spawn: Spawn
    recent_plans: deque[PlanRecord]
    kv_prices: str = ""


@dataclass(frozen=True, slots=True)
class CommitServices:
    """`commit` and what follows an answer: the directory and how its writes run (`inline`
    with the in-process one), the sessions' commit times, what the writes' lifetimes are,
    the executor and pool of a replica's copy, the counter of failed writes, and the leases
    held for workers without KV events."""

    directory: Directory | None
    inline: bool
    sessions: SessionTable
    lifetimes: Lifetimes
    refresh_period_s: float
    kv_bytes_per_token: int
    executor: PlanExecutor | None
    pool: WorkerPool
    span: Span
    spawn: Spawn
    pending: PendingCommits
    errors: Any
    committed: CommittedLeases


@dataclass(frozen=True, slots=True)
class ObserveServices:
    """`observe`: the metrics, and the calibrator that learns from served plans."""

    metrics: RouterMetrics
    calibrator: Calibrator


@dataclass(frozen=True, slots=True)
class RequestServices:
    """Every stage's services, for the runner (`router.pipeline`) to hand each stage its own;
    `identify`, `tokenize` and `admit` take their one service as a plain argument."""

    parse: ParseServices
    derived_sessions: DerivedSessionCache
    sessions: SessionTable
    admission: Admission
    look_up: LookUpServices
    view: ViewServices
    cluster: ClusterServices
    execute: ExecuteServices
    stream: StreamServices
    commit: CommitServices
    observe: ObserveServices
    lease: LeaseServices
