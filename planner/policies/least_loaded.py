"""Baseline `least-loaded`: P = least prefill load among prefill-capable workers (PREFILL or
HYBRID), D = least decode load among decode-capable ones (DECODE or HYBRID); colocated when
both are the same hybrid. Load-aware, locality-blind."""

from __future__ import annotations

from planner.policies.base import (
    BaselinePolicy,
    Routes,
    decode_capable,
    decode_load,
    least_two,
    maybe_pd_route,
    pd_route,
    prefill_capable,
    prefill_load,
)
from planner.types import ClusterView, RequestView


class LeastLoadedPolicy(BaselinePolicy):
    name = "least-loaded"

    def routes(
        self, request: RequestView, cluster: ClusterView, continuation: bool, turn: int
    ) -> Routes:
        ps, ds = prefill_capable(cluster), decode_capable(cluster)
        p, _ = least_two(ps, prefill_load, turn)
        d, d2 = least_two(ds, decode_load, turn)
        runner = maybe_pd_route(request, p, d2, continuation)
        return pd_route(request, p, d, continuation), runner, len(ps) * len(ds)
