"""What the peer routers' models share: their policy base classes (settings, aggregated and
conditional P/D plans), the approximate prefix tree of the SGLang/vLLM routers, the rejection a
peer answers with (Mooncake's 429), and the few helpers they pick workers with."""

from __future__ import annotations

import bisect
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from ownerserve.errors import OwnerServeError
from planner.cost import CostConfig, CostModel
from planner.policies.base import (
    decode_capable,
    decode_pool,
    is_continuation,
    make_plan,
    pd_route,
    prefill_pool,
)
from planner.types import ClusterView, Plan, RequestView, WorkerView

C = TypeVar("C")


class RequestRejectedError(OwnerServeError):
    """A peer refused the request before running it (Mooncake's early rejection, a 429): no
    worker is predicted to meet the SLO. The simulator counts these apart from served
    requests."""

    status_code = 429
    error_type = "rate_limit_exceeded"
    code = "slo_unattainable"


def queue_load(w: WorkerView) -> int:
    """A router's per-worker load: requests it sent there and not yet finished (running +
    waiting), as the Rust routers' `worker.load()` counts them."""
    return w.running + w.waiting


def first_min(pool: Sequence[WorkerView], key: Callable[[WorkerView], float]) -> WorkerView:
    """The first worker of a non-empty pool with the least key (Rust's `min_by_key` keeps the
    first of equal keys)."""
    best = pool[0]
    best_key = key(best)
    for w in pool[1:]:
        k = key(w)
        if k < best_key:
            best, best_key = w, k
    return best


def random_min(
    pool: Sequence[WorkerView], key: Callable[[WorkerView], float], rng: random.Random
) -> WorkerView:
    """A uniformly random one of the workers with the least key (Dynamo's and llm-d's pickers
    break ties at random); `rng` is the policy's own, seeded, so runs repeat."""
    best: list[WorkerView] = []
    best_key = float("inf")
    for w in pool:
        k = key(w)
        if k < best_key:
            best, best_key = [w], k
        elif k == best_key:
            best.append(w)
    return best[0] if len(best) == 1 else best[rng.randrange(len(best))]


class PeerPolicy(Generic[C]):
    """A peer's state: the cost model (the timing profiles it predicts with) and the peer's own
    settings, `default_peer_config` (its shipped defaults) unless given."""

    name: str
    default_peer_config: C

    def __init__(
        self,
        config: CostConfig | None = None,
        model: CostModel | None = None,
        peer_config: C | None = None,
    ) -> None:
        self.model = model or CostModel(config)
        self.peer_config = peer_config or self.default_peer_config


class AggregatedPeerPolicy(PeerPolicy[C], ABC):
    """A peer that picks one worker among those that prefill and decode (DECODE or HYBRID),
    which then runs both halves."""

    @abstractmethod
    def pick(self, pool: Sequence[WorkerView], request: RequestView) -> WorkerView:
        """The worker of the non-empty `pool` the peer sends `request` to."""

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        pool = decode_capable(cluster)
        w = self.pick(pool, request)
        return pd_plan(self, request, w, w, len(pool))


class RandomTiesPeerPolicy(AggregatedPeerPolicy[C], ABC):
    """An aggregated peer whose picker breaks ties at random (Dynamo, llm-d), with its own
    seeded generator so runs repeat."""

    def __init__(
        self,
        config: CostConfig | None = None,
        model: CostModel | None = None,
        peer_config: C | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(config, model, peer_config)
        self.rng = random.Random(seed)


def decode_first_plan(
    policy: AggregatedPeerPolicy[C],
    request: RequestView,
    cluster: ClusterView,
    remote_prefill: Callable[[WorkerView], bool],
) -> Plan:
    """Conditional disaggregation (Dynamo's `isl_bounding`, llm-d's `pd-profile-handler`): the
    policy picks the decode worker d first; when `remote_prefill(d)` it picks a prefill worker
    too and the KV moves P → D, else d prefills itself."""
    ds = decode_pool(cluster)
    d = policy.pick(ds, request)
    if not remote_prefill(d):
        return pd_plan(policy, request, d, d, len(ds))
    ps = prefill_pool(cluster)
    return pd_plan(policy, request, policy.pick(ps, request), d, len(ds) + len(ps))


def pd_plan(
    policy: PeerPolicy[C], request: RequestView, p: WorkerView, d: WorkerView, considered: int
) -> Plan:
    """The policy's plan: prefill on p, decode on d (colocated when they are one worker)."""
    route = pd_route(request, p, d, is_continuation(request, policy.model))
    return make_plan(policy.name, policy.model, request, route, candidates_considered=considered)


def uncached_tokens(request: RequestView, blocks: int) -> int:
    """Prompt tokens not covered by `blocks` cached prefix blocks: N − min(N, blocks · bs)."""
    return request.prompt_tokens - min(request.prompt_tokens, blocks * request.block_size)


class ApproxTree:
    """The SGLang/vLLM routers' approximate radix tree: per worker ("tenant"), the prompts the
    router sent there, with no word from the engines. Here a prompt is its chain of block
    hashes (`RequestView.chain`, each hash names its whole prefix), so the tree is a map from
    block to the tenants that were sent it, with their last access.

    Each tenant's part stays prefix-closed: an insert touches the whole chain, later blocks
    with older stamps, and eviction drops a tenant's least recently touched blocks first, so
    tails go before their prefixes (the Rust tree evicts LRU leaves). The Rust routers evict on
    a timer (`--eviction-interval-secs`) down to `--max-tree-size`; a policy here has no
    clock, so a tenant is trimmed when an insert takes it past the cap, to 15/16 of it (the
    timer's slack)."""

    __slots__ = ("_at", "_clock", "_size", "max_blocks")

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._at: dict[int, dict[str, int]] = {}
        self._size: dict[str, int] = {}
        self._clock = 0

    def size(self, tenant: str) -> int:
        """Blocks held for `tenant`."""
        return self._size.get(tenant, 0)

    def match(self, chain: Sequence[int]) -> tuple[int, str | None]:
        """(blocks matched, tenant): the longest prefix of `chain` any tenant was sent, and of
        the tenants holding all of it the one that has held it longest (None when nothing
        matches). The Rust tree answers the first tenant of its node's hash map
        (`tenant_last_access_time.iter().next()`): an arbitrary one, but one that stays the
        same as requests touch the node — not the last sent, which would follow each new
        request. The union of prefix-closed parts along one chain is prefix-closed: binary
        search."""
        at = self._at
        lo = bisect.bisect_left(range(len(chain)), True, key=lambda i: chain[i] not in at)
        if lo == 0:
            return 0, None
        # dicts keep insertion order; a tenant evicted and sent the block again goes last
        return lo, next(iter(at[chain[lo - 1]]))

    def insert(self, chain: Sequence[int], tenant: str) -> None:
        """Record that `chain` was sent to `tenant` (touching every block of it)."""
        at = self._at
        n = len(chain)
        stamp = self._clock + n
        added = 0
        for b in chain:
            holders = at.get(b)
            if holders is None:
                at[b] = {tenant: stamp}
                added += 1
            else:
                if tenant not in holders:
                    added += 1
                holders[tenant] = stamp
            stamp -= 1
        self._clock += n + 1
        size = self._size.get(tenant, 0) + added
        self._size[tenant] = size
        if size > self.max_blocks:
            self._evict(tenant, size - self.max_blocks + self.max_blocks // 16)

    def _evict(self, tenant: str, count: int) -> None:
        at = self._at
        mine = sorted((h[tenant], b) for b, h in at.items() if tenant in h)
        for _, b in mine[:count]:
            holders = at[b]
            del holders[tenant]
            if not holders:
                del at[b]
        self._size[tenant] -= min(count, len(mine))
