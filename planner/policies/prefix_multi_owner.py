"""Baseline `prefix-multi-owner`: cache-aware routing like the SGLang gateway, without owners.

Pick the worker holding the longest cached prefix of the request (any tier; ties to the least
loaded) unless the pool's load is imbalanced — max − min > imbalance_abs and max > imbalance_rel
· min, loads = running + waiting — then the least-loaded one. Any worker may cache any prefix, so
duplicates are allowed. With PREFILL workers in the cluster the choice is made among them and the
KV goes to the least-loaded decode worker (remote prefill); otherwise it runs colocated."""

from __future__ import annotations

from collections.abc import Sequence

from ownerserve.types import Role
from planner.cost import held_blocks
from planner.policies.base import (
    BaselinePolicy,
    Routes,
    decode_capable,
    decode_load,
    decode_pool,
    least_two,
    maybe_pd_route,
    pd_route,
)
from planner.types import ClusterView, RequestView, WorkerView


class PrefixMultiOwnerPolicy(BaselinePolicy):
    name = "prefix-multi-owner"

    def _imbalanced(self, pool: Sequence[WorkerView]) -> bool:
        loads = [w.running + w.waiting for w in pool]
        hi, lo = max(loads), min(loads)
        cfg = self.model.config
        return hi - lo > cfg.imbalance_abs and hi > cfg.imbalance_rel * lo

    def _cache_aware(
        self, pool: Sequence[WorkerView], turn: int
    ) -> tuple[WorkerView, WorkerView | None]:
        if self._imbalanced(pool):
            return least_two(pool, decode_load, turn)
        ranked = sorted(pool, key=lambda w: (-held_blocks(w), w.running + w.waiting))
        return ranked[0], (ranked[1] if len(ranked) > 1 else None)

    def routes(
        self, request: RequestView, cluster: ClusterView, continuation: bool, turn: int
    ) -> Routes:
        prefillers = [w for w in cluster.workers if w.healthy and w.role is Role.PREFILL]
        if prefillers:
            ds = decode_pool(cluster)
            p, p2 = self._cache_aware(prefillers, turn)
            d, _ = least_two(ds, decode_load, turn)
            runner = maybe_pd_route(request, p2, d, continuation)
            return pd_route(request, p, d, continuation), runner, len(prefillers)
        pool = decode_capable(cluster)
        w, w2 = self._cache_aware(pool, turn)
        runner = maybe_pd_route(request, w2, w2, continuation)
        return pd_route(request, w, w, continuation), runner, len(pool)
