"""Helpers every policy shares: worker pools (never empty: `NoWorkerAvailableError` instead), the
top-two pick (`TopTwo`: chosen and runner-up, with its tie rule), the baselines' base class
(`BaselinePolicy`), and turning routes into a `Plan` whose breakdown comes from
`planner.cost.RequestCosts` (so baselines are costed exactly like the ownerserve policy and
their plans can be compared)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar, cast

from ownerserve.errors import NoWorkerAvailableError
from ownerserve.types import Role
from planner.classify import DEFAULT_ACTION, classify
from planner.cost import (
    CostConfig,
    CostModel,
    RequestCosts,
    Route,
    can_decode,
    can_prefill,
    colocated_action,
    pd_pair,
)
from planner.types import (
    Action,
    Candidate,
    ClusterView,
    Plan,
    RequestClass,
    RequestView,
    WorkerView,
)

K = TypeVar("K", float, tuple[float, float])
T = TypeVar("T")
_INF = float("inf")


def prefill_pool(cluster: ClusterView) -> list[WorkerView]:
    """Healthy PREFILL workers; the healthy HYBRID ones when there are none."""
    pool = [w for w in cluster.workers if w.healthy and w.role is Role.PREFILL]
    return _nonempty(
        pool or [w for w in cluster.workers if w.healthy and w.role is Role.HYBRID], "prefill"
    )


def decode_pool(cluster: ClusterView) -> list[WorkerView]:
    """Healthy DECODE workers; the healthy HYBRID ones when there are none."""
    pool = [w for w in cluster.workers if w.healthy and w.role is Role.DECODE]
    return _nonempty(
        pool or [w for w in cluster.workers if w.healthy and w.role is Role.HYBRID], "decode"
    )


def prefill_capable(cluster: ClusterView) -> list[WorkerView]:
    """Healthy workers that prefill (PREFILL or HYBRID)."""
    return _nonempty(
        [w for w in cluster.workers if w.healthy and can_prefill(w)], "prefill-capable"
    )


def decode_capable(cluster: ClusterView) -> list[WorkerView]:
    """Healthy workers that decode (DECODE or HYBRID)."""
    return _nonempty([w for w in cluster.workers if w.healthy and can_decode(w)], "decode-capable")


def _nonempty(pool: list[WorkerView], what: str) -> list[WorkerView]:
    if not pool:
        raise NoWorkerAvailableError(f"no healthy {what} worker")
    return pool


def decode_load(w: WorkerView) -> tuple[int, int]:
    """Load of a decode worker for the baselines: (running + waiting, inflight prefill tokens)."""
    return (w.running + w.waiting, w.inflight_prefill_tokens)


def prefill_load(w: WorkerView) -> tuple[int, int]:
    """Load of a prefill worker for the baselines: (inflight prefill tokens, waiting)."""
    return (w.inflight_prefill_tokens, w.waiting)


class TopTwo(Generic[K, T]):
    """The pick every policy makes: the chosen item and the runner-up, the two least keys
    offered. An equal key keeps the item offered first (callers that rotate the order spread
    equal loads round-robin); `prefer` lets the request class's default win an exact tie.
    `limit` is a key above every real one."""

    __slots__ = ("first", "first_key", "second", "second_key")

    def __init__(self, limit: K) -> None:
        self.first: T | None = None
        self.second: T | None = None
        self.first_key: K = limit
        self.second_key: K = limit

    def offer(self, key: K, item: T) -> None:
        if key < self.second_key:
            if key < self.first_key:
                self.second, self.second_key = self.first, self.first_key
                self.first, self.first_key = item, key
            else:
                self.second, self.second_key = item, key

    def prefer(self, cost: float, item: T, differs: bool) -> None:
        """Make `item` (the class default, costing `cost`) the choice when it ties the first
        one within a relative 1e-12 (rounding) and `differs` from it; the first becomes the
        runner-up. For float keys."""
        best = cast(float, self.first_key)
        if differs and cost - best <= 1e-12 * (best if best > 1.0 else 1.0):
            self.second, self.second_key = self.first, self.first_key
            self.first, self.first_key = item, cast(K, cost)


def least_two(
    pool: Sequence[WorkerView], key: Callable[[WorkerView], tuple[int, int]], offset: int = 0
) -> tuple[WorkerView, WorkerView | None]:
    """The two least-loaded workers of a non-empty pool; ties go to the first seen when
    scanning from `offset` (callers rotate it so equal loads spread round-robin)."""
    n = len(pool)
    top: TopTwo[tuple[float, float], WorkerView] = TopTwo((_INF, _INF))
    for i in range(n):
        w = pool[(offset + i) % n]
        top.offer(key(w), w)
    assert top.first is not None
    return top.first, top.second


def is_continuation(request: RequestView, model: CostModel) -> bool:
    """The request is a DECODE_CONTINUATION (names colocated routes, see `colocated_action`)."""
    return classify(request, model.config) is RequestClass.DECODE_CONTINUATION


def pd_route(request: RequestView, p: WorkerView, d: WorkerView, continuation: bool) -> Route:
    """Remote prefill P→D, or colocated on D when both are the same worker or they speak no
    common P/D hand-over (`pd_pair`)."""
    if p.worker_id == d.worker_id or not pd_pair(p, d):
        return Route(colocated_action(request, d, continuation), d, d)
    return Route(Action.REMOTE_PREFILL, p, d)


def maybe_pd_route(
    request: RequestView, p: WorkerView | None, d: WorkerView | None, continuation: bool
) -> Route | None:
    """`pd_route` of P→D, None when either is missing (a runner-up the pools cannot give)."""
    return None if p is None or d is None else pd_route(request, p, d, continuation)


def split_pools(cluster: ClusterView) -> tuple[list[WorkerView], list[WorkerView]]:
    """The prefill and the decode pool of a P/D policy (`prefill_pool`, `decode_pool`)."""
    return prefill_pool(cluster), decode_pool(cluster)


Routes = tuple[Route, Route | None, int]
"""A baseline's choice: (chosen route, runner-up or None, candidates considered)."""


class BaselinePolicy(ABC):
    """A baseline: its cost model (its plans are costed like the ownerserve policy's) and its
    turn, which advances with every plan whose pools have a worker; baselines rotate by it the
    order equal loads are scanned in, or the pools themselves. `routes` is the baseline's
    choice."""

    name: str

    def __init__(self, config: CostConfig | None = None, model: CostModel | None = None) -> None:
        self.model = model or CostModel(config)
        self._turn = 0

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        turn = self._turn + 1
        chosen, runner_up, considered = self.routes(
            request, cluster, is_continuation(request, self.model), turn
        )
        self._turn = turn  # not when `routes` raised (a pool without workers)
        return make_plan(
            self.name, self.model, request, chosen, runner_up, candidates_considered=considered
        )

    @abstractmethod
    def routes(
        self, request: RequestView, cluster: ClusterView, continuation: bool, turn: int
    ) -> Routes:
        """The baseline's `Routes` for `request`; `continuation`: it is a DECODE_CONTINUATION
        (`is_continuation`); `turn`: this plan's turn (1 on the first)."""


def make_plan(
    policy: str,
    model: CostModel,
    request: RequestView,
    chosen: Route,
    runner_up: Route | None = None,
    *,
    request_class: RequestClass | None = None,
    candidates_considered: int = 1,
    add_replica_on: str | None = None,
    default_cost_s: float | None = None,
) -> Plan:
    """The plan of `chosen` (and `runner_up`), each with its full breakdown from
    `RequestCosts.candidate`."""
    rclass = request_class or classify(request, model.config)
    k = RequestCosts(model, request)
    return plan_of(
        policy,
        rclass,
        k.candidate(chosen),
        None if runner_up is None else k.candidate(runner_up),
        candidates_considered=candidates_considered,
        add_replica_on=add_replica_on,
        default_cost_s=default_cost_s,
    )


def plan_of(
    policy: str,
    request_class: RequestClass,
    chosen: Candidate,
    runner_up: Candidate | None = None,
    *,
    candidates_considered: int = 1,
    add_replica_on: str | None = None,
    default_cost_s: float | None = None,
) -> Plan:
    """The plan of candidates that already carry their breakdowns (`make_plan` costs routes)."""
    return Plan(
        policy=policy,
        request_class=request_class,
        chosen=chosen,
        runner_up=runner_up,
        add_replica_on=add_replica_on,
        candidates_considered=candidates_considered,
        default_action=DEFAULT_ACTION[request_class],
        default_cost_s=default_cost_s,
    )
