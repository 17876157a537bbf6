"""Baseline `static-pd`: always prefill on a P worker, ship the KV, decode on a D worker.

P is the least-loaded of the prefill pool (PREFILL workers, else HYBRID), D the least-loaded of
the decode pool (DECODE workers, else HYBRID); equal loads rotate round-robin; P ≠ D unless a
single hybrid is all there is. No KV locality."""

from __future__ import annotations

from planner.cost import CostConfig, CostModel
from planner.policies.base import (
    decode_load,
    is_continuation,
    least_two,
    make_plan,
    pd_route,
    prefill_load,
    split_pools,
)
from planner.types import ClusterView, Plan, RequestView


class StaticPDPolicy:
    name = "static-pd"

    def __init__(self, config: CostConfig | None = None, model: CostModel | None = None) -> None:
        self.model = model or CostModel(config)
        self._turn = 0

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        cont = is_continuation(request, self.model)
        ps, ds = split_pools(cluster)
        self._turn += 1
        p, p2 = least_two(ps, prefill_load, self._turn)
        d, d2 = least_two(ds, decode_load, self._turn)
        if p is d and p2 is not None:  # hybrid pools: P and D stay separate workers
            p, p2 = p2, p
        runner = None
        if d2 is not None:
            runner = pd_route(request, p, d2, cont)
        elif p2 is not None:
            runner = pd_route(request, p2, d, cont)
        return make_plan(
            self.name,
            self.model,
            request,
            pd_route(request, p, d, cont),
            runner,
            candidates_considered=len(ps) * len(ds),
        )
