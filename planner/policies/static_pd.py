"""Baseline `static-pd`: always prefill on a P worker, ship the KV, decode on a D worker.

P is the least-loaded of the prefill pool (PREFILL workers, else HYBRID), D the least-loaded of
the decode pool (DECODE workers, else HYBRID); equal loads rotate round-robin; P ≠ D unless a
single hybrid is all there is. No KV locality."""

from __future__ import annotations

from planner.policies.base import (
    BaselinePolicy,
    Routes,
    decode_load,
    least_two,
    maybe_pd_route,
    pd_route,
    prefill_load,
    split_pools,
)
from planner.types import ClusterView, RequestView


class StaticPDPolicy(BaselinePolicy):
    name = "static-pd"

    def routes(
        self, request: RequestView, cluster: ClusterView, continuation: bool, turn: int
    ) -> Routes:
        ps, ds = split_pools(cluster)
        p, p2 = least_two(ps, prefill_load, turn)
        d, d2 = least_two(ds, decode_load, turn)
        if p is d and p2 is not None:  # hybrid pools: P and D stay separate workers
            p, p2 = p2, p
        runner = maybe_pd_route(request, p, d2, continuation) or maybe_pd_route(
            request, p2, d, continuation
        )
        return pd_route(request, p, d, continuation), runner, len(ps) * len(ds)
