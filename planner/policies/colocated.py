"""Baseline `colocated`: no P/D split — prefill and decode on one worker, the least-loaded
decode-capable (DECODE or HYBRID) one; equal loads rotate round-robin. No KV locality."""

from __future__ import annotations

from planner.cost import CostConfig, CostModel, Route, colocated_action
from planner.policies.base import (
    decode_capable,
    decode_load,
    is_continuation,
    least_two,
    make_plan,
    require,
)
from planner.types import ClusterView, Plan, RequestView


class ColocatedPolicy:
    name = "colocated"

    def __init__(self, config: CostConfig | None = None, model: CostModel | None = None) -> None:
        self.model = model or CostModel(config)
        self._turn = 0

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        cont = is_continuation(request, self.model)
        pool = decode_capable(cluster)
        require(pool, "decode-capable")
        self._turn += 1
        w, w2 = least_two(pool, decode_load, self._turn)
        runner = None if w2 is None else Route(colocated_action(request, w2, cont), w2, w2)
        return make_plan(
            self.name,
            self.model,
            request,
            Route(colocated_action(request, w, cont), w, w),
            runner,
            candidates_considered=len(pool),
        )
