"""vllm-router's `power_of_two` policy: two random workers, the less loaded one.

Source: vllm-project/router `src/policies/power_of_two.rs` (vllm-router 0.1.17, `--policy
power_of_two`; the router refuses it with fewer than two workers): two distinct healthy
workers drawn uniformly, the one with the lower load (requests in flight, `queue_load`) wins,
the first drawn on a tie. The draw uses the policy's own seeded generator, so runs repeat.
"""

from __future__ import annotations

import random

from planner.cost import CostConfig, CostModel
from planner.policies.base import decode_capable, is_continuation, make_plan, pd_route
from planner.policies.peers.common import queue_load
from planner.types import ClusterView, Plan, RequestView


class PowerOfTwoPolicy:
    """`power_of_two` over the workers that prefill and decode (DECODE or HYBRID)."""

    name = "vllm-power-of-two"

    def __init__(
        self, config: CostConfig | None = None, model: CostModel | None = None, seed: int = 0
    ) -> None:
        self.model = model or CostModel(config)
        self.rng = random.Random(seed)

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        pool = decode_capable(cluster)
        if len(pool) == 1:
            w = pool[0]
        else:
            i, j = self.rng.sample(range(len(pool)), 2)
            a, b = pool[i], pool[j]
            w = a if queue_load(a) <= queue_load(b) else b
        route = pd_route(request, w, w, is_continuation(request, self.model))
        return make_plan(self.name, self.model, request, route, candidates_considered=2)
