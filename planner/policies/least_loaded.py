"""Baseline `least-loaded`: P = least prefill load among prefill-capable workers (PREFILL or
HYBRID), D = least decode load among decode-capable ones (DECODE or HYBRID); colocated when
both are the same hybrid. Load-aware, locality-blind."""

from __future__ import annotations

from planner.cost import CostConfig, CostModel
from planner.policies.base import (
    decode_capable,
    decode_load,
    is_continuation,
    least_two,
    make_plan,
    pd_route,
    prefill_capable,
    prefill_load,
    require,
)
from planner.types import ClusterView, Plan, RequestView


class LeastLoadedPolicy:
    name = "least-loaded"

    def __init__(self, config: CostConfig | None = None, model: CostModel | None = None) -> None:
        self.model = model or CostModel(config)
        self._turn = 0

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        cont = is_continuation(request, self.model)
        ps, ds = prefill_capable(cluster), decode_capable(cluster)
        require(ps, "prefill-capable")
        require(ds, "decode-capable")
        self._turn += 1
        p, _ = least_two(ps, prefill_load, self._turn)
        d, d2 = least_two(ds, decode_load, self._turn)
        return make_plan(
            self.name,
            self.model,
            request,
            pd_route(request, p, d, cont),
            None if d2 is None else pd_route(request, p, d2, cont),
            candidates_considered=len(ps) * len(ds),
        )
