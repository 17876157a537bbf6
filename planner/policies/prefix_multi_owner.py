"""Baseline `prefix-multi-owner`: cache-aware routing like the SGLang gateway, without owners.

Pick the worker holding the longest cached prefix of the request (any tier; ties to the least
loaded) unless the pool's load is imbalanced — max − min > imbalance_abs and max > imbalance_rel
· min, loads = running + waiting — then the least-loaded one. Any worker may cache any prefix, so
duplicates are allowed. With PREFILL workers in the cluster the choice is made among them and the
KV goes to the least-loaded decode worker (remote prefill); otherwise it runs colocated."""

from __future__ import annotations

from collections.abc import Sequence

from ownerserve.types import Role
from planner.cost import CostConfig, CostModel, held_blocks
from planner.policies.base import (
    decode_capable,
    decode_load,
    decode_pool,
    is_continuation,
    least_two,
    make_plan,
    pd_route,
    require,
)
from planner.types import ClusterView, Plan, RequestView, WorkerView


class PrefixMultiOwnerPolicy:
    name = "prefix-multi-owner"

    def __init__(self, config: CostConfig | None = None, model: CostModel | None = None) -> None:
        self.model = model or CostModel(config)
        self._turn = 0

    def _imbalanced(self, pool: Sequence[WorkerView]) -> bool:
        loads = [w.running + w.waiting for w in pool]
        hi, lo = max(loads), min(loads)
        cfg = self.model.config
        return hi - lo > cfg.imbalance_abs and hi > cfg.imbalance_rel * lo

    def _cache_aware(self, pool: Sequence[WorkerView]) -> tuple[WorkerView, WorkerView | None]:
        self._turn += 1
        if self._imbalanced(pool):
            return least_two(pool, decode_load, self._turn)
        ranked = sorted(pool, key=lambda w: (-held_blocks(w), w.running + w.waiting))
        return ranked[0], (ranked[1] if len(ranked) > 1 else None)

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        cont = is_continuation(request, self.model)
        prefillers = [w for w in cluster.workers if w.healthy and w.role is Role.PREFILL]
        if prefillers:
            ds = decode_pool(cluster)
            require(ds, "decode")
            p, p2 = self._cache_aware(prefillers)
            d, _ = least_two(ds, decode_load, self._turn)
            chosen = pd_route(request, p, d, cont)
            runner = None if p2 is None else pd_route(request, p2, d, cont)
            considered = len(prefillers)
        else:
            pool = decode_capable(cluster)
            require(pool, "decode-capable")
            w, w2 = self._cache_aware(pool)
            chosen = pd_route(request, w, w, cont)
            runner = None if w2 is None else pd_route(request, w2, w2, cont)
            considered = len(pool)
        return make_plan(
            self.name, self.model, request, chosen, runner, candidates_considered=considered
        )
