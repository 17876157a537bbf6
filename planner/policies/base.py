"""Helpers every policy shares: worker pools, least-loaded picking, and turning routes into a
`Plan` whose breakdown comes from `planner.cost.evaluate` (so baselines are costed exactly like
the ownerserve policy and their plans can be compared)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ownerserve.errors import NoWorkerAvailableError
from ownerserve.types import Role
from planner.classify import DEFAULT_ACTION, classify
from planner.cost import CostModel, Route, can_decode, can_prefill, colocated_action, to_candidate
from planner.types import Action, ClusterView, Plan, RequestClass, RequestView, WorkerView


def prefill_pool(cluster: ClusterView) -> list[WorkerView]:
    """Healthy PREFILL workers; the healthy HYBRID ones when there are none."""
    pool = [w for w in cluster.workers if w.healthy and w.role is Role.PREFILL]
    return pool or [w for w in cluster.workers if w.healthy and w.role is Role.HYBRID]


def decode_pool(cluster: ClusterView) -> list[WorkerView]:
    """Healthy DECODE workers; the healthy HYBRID ones when there are none."""
    pool = [w for w in cluster.workers if w.healthy and w.role is Role.DECODE]
    return pool or [w for w in cluster.workers if w.healthy and w.role is Role.HYBRID]


def prefill_capable(cluster: ClusterView) -> list[WorkerView]:
    return [w for w in cluster.workers if w.healthy and can_prefill(w)]


def decode_capable(cluster: ClusterView) -> list[WorkerView]:
    return [w for w in cluster.workers if w.healthy and can_decode(w)]


def decode_load(w: WorkerView) -> tuple[int, int]:
    """Load of a decode worker for the baselines: (running + waiting, inflight prefill tokens)."""
    return (w.running + w.waiting, w.inflight_prefill_tokens)


def prefill_load(w: WorkerView) -> tuple[int, int]:
    """Load of a prefill worker for the baselines: (inflight prefill tokens, waiting)."""
    return (w.inflight_prefill_tokens, w.waiting)


def least_two(
    pool: Sequence[WorkerView], key: Callable[[WorkerView], tuple[int, int]], offset: int = 0
) -> tuple[WorkerView, WorkerView | None]:
    """The two least-loaded workers of a non-empty pool; ties go to the first seen when
    scanning from `offset` (callers rotate it so equal loads spread round-robin)."""
    n = len(pool)
    best: WorkerView | None = None
    second: WorkerView | None = None
    kb = ks = None
    for i in range(n):
        w = pool[(offset + i) % n]
        k = key(w)
        if kb is None or k < kb:
            second, ks = best, kb
            best, kb = w, k
        elif ks is None or k < ks:
            second, ks = w, k
    assert best is not None
    return best, second


def is_continuation(request: RequestView, model: CostModel) -> bool:
    """The request is a DECODE_CONTINUATION (names colocated routes, see `colocated_action`)."""
    return classify(request, model.config) is RequestClass.DECODE_CONTINUATION


def pd_route(request: RequestView, p: WorkerView, d: WorkerView, continuation: bool) -> Route:
    """Remote prefill P→D, or colocated when both are the same worker."""
    if p.worker_id == d.worker_id:
        return Route(colocated_action(request, d, continuation), d, d)
    return Route(Action.REMOTE_PREFILL, p, d)


def require(pool: Sequence[WorkerView], what: str) -> None:
    if not pool:
        raise NoWorkerAvailableError(f"no healthy {what} worker")


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
    rclass = request_class or classify(request, model.config)
    return Plan(
        policy=policy,
        request_class=rclass,
        chosen=to_candidate(model, request, chosen),
        runner_up=None if runner_up is None else to_candidate(model, request, runner_up),
        add_replica_on=add_replica_on,
        candidates_considered=candidates_considered,
        default_action=DEFAULT_ACTION[rclass],
        default_cost_s=default_cost_s,
    )
