"""Baseline `round-robin`: P and D taken in turn from the prefill and decode pools (see
`planner.policies.base`), ignoring load and KV locality; colocated when both turns land on the
same hybrid worker. The turn counters live in the policy object (deterministic, no I/O)."""

from __future__ import annotations

from planner.cost import CostConfig, CostModel
from planner.policies.base import (
    is_continuation,
    make_plan,
    pd_route,
    split_pools,
)
from planner.types import ClusterView, Plan, RequestView


class RoundRobinPolicy:
    name = "round-robin"

    def __init__(self, config: CostConfig | None = None, model: CostModel | None = None) -> None:
        self.model = model or CostModel(config)
        self._next_p = 0
        self._next_d = 0

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        cont = is_continuation(request, self.model)
        ps, ds = split_pools(cluster)
        p = ps[self._next_p % len(ps)]
        d = ds[self._next_d % len(ds)]
        self._next_p += 1
        self._next_d += 1
        nd = ds[self._next_d % len(ds)]
        runner = pd_route(request, p, nd, cont) if len(ds) > 1 else None
        return make_plan(
            self.name,
            self.model,
            request,
            pd_route(request, p, d, cont),
            runner,
            candidates_considered=1,
        )
