"""What the peer routers' models share: the approximate prefix tree of the SGLang/vLLM routers,
the rejection a peer answers with (Mooncake's 429), and the few helpers they pick workers
with."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from ownerserve.errors import OwnerServeError
from planner.types import RequestView, WorkerView


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
        the tenants holding all of it the one touched last (None when nothing matches). The
        union of prefix-closed parts along one chain is prefix-closed: binary search."""
        at = self._at
        lo, hi = 0, len(chain)
        while lo < hi:
            mid = (lo + hi) // 2
            if chain[mid] in at:
                lo = mid + 1
            else:
                hi = mid
        if lo == 0:
            return 0, None
        tenants = at[chain[lo - 1]]
        return lo, max(tenants, key=tenants.__getitem__)

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
