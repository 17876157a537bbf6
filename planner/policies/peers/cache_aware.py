"""The SGLang model gateway's and vllm-router's `cache_aware` policy, aggregated and P/D.

Sources: sgl-project/sglang `sgl-model-gateway/src/policies/cache_aware.rs` (and `tree.rs`);
vllm-project/router `src/policies/cache_aware.rs` (a fork of it). Defaults are the installed
binaries' (`smg launch --help`, sglang-router 0.3.2 = sgl-model-gateway 0.3.2;
`vllm-router --help`, vllm-router 0.1.17): cache_threshold 0.3, balance_abs_threshold 64,
balance_rel_threshold 1.5; max_tree_size 67,108,864 (sglang) / 33,554,432 characters per worker
(vllm); eviction every 60 s (sglang) / 120 s (vllm).

The rule, per request, over the pool's workers (load = the requests the router has in flight
there, `queue_load`):

1. imbalanced — max_load − min_load > balance_abs_threshold and max_load >
   balance_rel_threshold · min_load: the least-loaded worker (shortest queue);
2. else the tree's best match, when its match rate (matched / prompt, in tokens here: their
   gRPC mode; characters in HTTP mode) is > cache_threshold;
3. else the least-loaded worker.

Either way the prompt is inserted into the chosen worker's tree. Step 3 is what both binaries
run: the source comment still says "smallest tree", but the code takes `min_by_key(load)` and
neither binary has the old `get_smallest_tenant` (checked with `strings`). The tree is
`ApproxTree` (blocks of the prompt's chain; the cap is max_tree_size / 4 characters per token).

P/D (`--pd-disaggregation` / `--vllm-pd-disaggregation` with `--policy cache_aware`): the
prefill and the decode policies are two instances, each with its own tree, choosing in the
prefill pool and in the decode pool; the KV moves P → D. SGLang sends both halves at once (a
bootstrap room), vLLM the prefill first then the decode with its `kv_transfer_params`; the
simulator moves the KV after the prefill in both, so the two differ here only by their tree
caps. Not modelled: vllm-router's exact-match session map (chat requests carrying a session
id), its random choice when a model has no tree yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planner.policies.base import split_pools
from planner.policies.peers.common import (
    AggregatedPeerPolicy,
    ApproxTree,
    PeerPolicy,
    first_min,
    pd_plan,
    queue_load,
)
from planner.types import ClusterView, Plan, RequestView, WorkerView

CHARS_PER_TOKEN = 4
"""The trees are capped in characters; a token of English text is about four."""


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    """The policy's flags (`--cache-threshold`, `--balance-abs-threshold`,
    `--balance-rel-threshold`, `--max-tree-size`)."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 67_108_864


SGLANG = CacheAwareConfig()
VLLM = CacheAwareConfig(max_tree_size=33_554_432)


def imbalanced(loads: Sequence[int], config: CacheAwareConfig) -> bool:
    """max − min > balance_abs_threshold and max > balance_rel_threshold · min."""
    hi, lo = max(loads), min(loads)
    return hi - lo > config.balance_abs_threshold and hi > lo * config.balance_rel_threshold


class CacheAwareSelector:
    """One `cache_aware` policy object of a router: its tree and its choice in one pool."""

    __slots__ = ("config", "tree")

    def __init__(self, config: CacheAwareConfig, block_size: int) -> None:
        self.config = config
        self.tree = ApproxTree(config.max_tree_size // CHARS_PER_TOKEN // block_size)

    def select(self, pool: Sequence[WorkerView], request: RequestView) -> WorkerView:
        """The worker for `request` (rule 1–3 of the module), recorded in the tree."""
        cfg = self.config
        chain = request.chain
        if imbalanced([queue_load(w) for w in pool], cfg):
            chosen = first_min(pool, queue_load)
        else:
            matched, tenant = self.tree.match(chain)
            n = request.prompt_tokens
            rate = min(matched * request.block_size, n) / n if n > 0 else 0.0
            hit = None
            if rate > cfg.cache_threshold:
                hit = next((w for w in pool if w.worker_id == tenant), None)
            chosen = hit if hit is not None else first_min(pool, queue_load)
        if chain:
            self.tree.insert(chain, chosen.worker_id)
        return chosen


class CacheAwarePolicy(AggregatedPeerPolicy[CacheAwareConfig]):
    """Aggregated `cache_aware`: one tree over the workers that prefill and decode (DECODE or
    HYBRID, as the `colocated` baseline), prefill and decode on the chosen one."""

    name = "sglang-cache-aware"
    default_peer_config = SGLANG
    # built on the first request: the tree's cap in blocks needs the request's block size
    _selector: CacheAwareSelector | None = None

    def pick(self, pool: Sequence[WorkerView], request: RequestView) -> WorkerView:
        if self._selector is None:
            self._selector = CacheAwareSelector(self.peer_config, request.block_size)
        return self._selector.select(pool, request)


class CacheAwarePDPolicy(PeerPolicy[CacheAwareConfig]):
    """P/D `cache_aware`: a prefill instance over the prefill pool and a decode instance over
    the decode pool (PREFILL / DECODE workers, HYBRID ones when a role has none)."""

    name = "sglang-cache-aware-pd"
    default_peer_config = SGLANG
    # built on the first request, as `CacheAwarePolicy._selector`
    _prefill: CacheAwareSelector | None = None
    _decode: CacheAwareSelector | None = None

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        ps, ds = split_pools(cluster)
        if self._prefill is None or self._decode is None:
            self._prefill = CacheAwareSelector(self.peer_config, request.block_size)
            self._decode = CacheAwareSelector(self.peer_config, request.block_size)
        p = self._prefill.select(ps, request)
        d = self._decode.select(ds, request)
        return pd_plan(self, request, p, d, len(ps) * len(ds))


class VllmCacheAwarePolicy(CacheAwarePolicy):
    name = "vllm-cache-aware"
    default_peer_config = VLLM


class VllmCacheAwarePDPolicy(CacheAwarePDPolicy):
    name = "vllm-cache-aware-pd"
    default_peer_config = VLLM
