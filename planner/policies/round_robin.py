"""Baseline `round-robin`: P and D taken in turn from the prefill and decode pools (see
`planner.policies.base`), ignoring load and KV locality; colocated when both turns land on the
same hybrid worker. The turn counter lives in the policy object (deterministic, no I/O)."""

from __future__ import annotations

from planner.policies.base import BaselinePolicy, Routes, pd_route, split_pools
from planner.types import ClusterView, RequestView


class RoundRobinPolicy(BaselinePolicy):
    name = "round-robin"

    def routes(
        self, request: RequestView, cluster: ClusterView, continuation: bool, turn: int
    ) -> Routes:
        ps, ds = split_pools(cluster)
        p = ps[(turn - 1) % len(ps)]  # the first plan takes the pools' first workers
        d = ds[(turn - 1) % len(ds)]
        nd = ds[turn % len(ds)]
        runner = pd_route(request, p, nd, continuation) if len(ds) > 1 else None
        return pd_route(request, p, d, continuation), runner, 1
