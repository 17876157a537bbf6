"""Baseline `colocated`: no P/D split — prefill and decode on one worker, the least-loaded
decode-capable (DECODE or HYBRID) one; equal loads rotate round-robin. No KV locality."""

from __future__ import annotations

from planner.policies.base import (
    BaselinePolicy,
    Routes,
    decode_capable,
    decode_load,
    least_two,
    maybe_pd_route,
    pd_route,
)
from planner.types import ClusterView, RequestView


class ColocatedPolicy(BaselinePolicy):
    name = "colocated"

    def routes(
        self, request: RequestView, cluster: ClusterView, continuation: bool, turn: int
    ) -> Routes:
        pool = decode_capable(cluster)
        w, w2 = least_two(pool, decode_load, turn)
        runner = maybe_pd_route(request, w2, w2, continuation)
        return pd_route(request, w, w, continuation), runner, len(pool)
