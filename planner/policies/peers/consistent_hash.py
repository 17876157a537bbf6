"""vllm-router's `consistent_hash` policy: a session's requests always go to one worker.

Source: vllm-project/router `src/policies/consistent_hash.rs` (vllm-router 0.1.17,
`--policy consistent_hash`). Each worker has 160 virtual nodes on a hash ring (key
"<url>:<i>"); a request's key (its session id: the `x-session-id` header, then the body's
session/user fields) maps to the first virtual node at or after its hash, wrapping around; a
target that is not healthy falls back to the first healthy worker. Load is never looked at.
The ring's hash here is BLAKE2b (theirs is FurcHash + MurmurHash64A): what matters is a uniform,
stable spread, not the exact bits. A request without a session id is keyed by the first block
of its prompt.
"""

from __future__ import annotations

import bisect
from hashlib import blake2b

from planner.cost import CostConfig, CostModel, can_decode
from planner.policies.base import decode_capable, is_continuation, make_plan, pd_route
from planner.types import ClusterView, Plan, RequestView

VIRTUAL_NODES_PER_WORKER = 160


def ring_hash(key: str) -> int:
    """A stable 64-bit hash of `key`."""
    return int.from_bytes(blake2b(key.encode(), digest_size=8).digest(), "little")


class HashRing:
    """The ring of one worker set: sorted virtual-node hashes and their workers."""

    __slots__ = ("hashes", "owners", "workers")

    def __init__(self, workers: tuple[str, ...], virtual_nodes: int) -> None:
        self.workers = workers
        points = sorted((ring_hash(f"{w}:{i}"), w) for w in workers for i in range(virtual_nodes))
        self.hashes = [h for h, _ in points]
        self.owners = [w for _, w in points]

    def lookup(self, key: str) -> str:
        """The worker of the first virtual node at or after hash(key), wrapping around."""
        i = bisect.bisect_left(self.hashes, ring_hash(key))
        return self.owners[i if i < len(self.owners) else 0]


class ConsistentHashPolicy:
    """`consistent_hash` over the workers that prefill and decode (DECODE or HYBRID)."""

    name = "vllm-consistent-hash"

    def __init__(self, config: CostConfig | None = None, model: CostModel | None = None) -> None:
        self.model = model or CostModel(config)
        self._ring: HashRing | None = None

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        # the ring holds every worker of the pool, healthy or not (the router rebuilds it when
        # the worker list changes)
        pool = [w for w in cluster.workers if can_decode(w)]
        decode_capable(cluster)  # raises when none is healthy
        ids = tuple(w.worker_id for w in pool)
        if self._ring is None or self._ring.workers != ids:
            self._ring = HashRing(ids, VIRTUAL_NODES_PER_WORKER)
        key = request.session_id or (str(request.chain[0]) if request.chain else "")
        target = self._ring.lookup(key)
        w = next(w for w in pool if w.worker_id == target)
        if not w.healthy:
            w = next(w for w in pool if w.healthy)
        route = pd_route(request, w, w, is_continuation(request, self.model))
        return make_plan(self.name, self.model, request, route)
