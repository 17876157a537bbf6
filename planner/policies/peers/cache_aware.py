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
2. else the tree's best match, when its match rate is > cache_threshold: in their HTTP mode
   (the one measured here) the matched bytes of the routing text — the messages' contents
   joined, without the template or the tool-call JSON — over its length, when the request's
   `RoutingText` knows them; else matched tokens over the prompt's (their gRPC mode);
3. else the least-loaded worker.

Either way the prompt is inserted into the chosen worker's tree. Step 3 is what both binaries
run: the source comment still says "smallest tree", but the code takes `min_by_key(load)` and
neither binary has the old `get_smallest_tenant` (checked with `strings`). The tree is
`ApproxTree` (blocks of the prompt's chain; the cap is max_tree_size / 4 characters per token).

P/D (`--pd-disaggregation` / `--vllm-pd-disaggregation` with `--policy cache_aware`): the
prefill and the decode policies are two instances, each with its own tree, choosing in the
prefill pool and in the decode pool; the KV moves P → D. SGLang sends both halves at once (a
bootstrap room), vLLM the prefill first then the decode with its `kv_transfer_params`; the
simulator moves the KV after the prefill in both.

Where the binaries depart from that rule (measured against them on the emulated cluster,
`bench/sim/validate_peers.py`):
- vllm-router 0.1.17 routes a chat request that carries tool messages (a tool result, an
  assistant `tool_calls` turn) without its tree: its decision counter says `missing_tokens`
  (it first asks the worker to render the prompt to tokens), the request goes to the least
  loaded worker and is not inserted. On an agent workload that is every turn but the first, in
  both of its modes (`tree_skips_tool_turns`).
- sglang-router 0.3.2 in P/D mode builds its trees when it starts, keyed by the workers' model
  as known then, and looks them up by the model the workers report later, so every choice
  logs "No tree found for model ..., using random worker selection": prefill and decode
  worker uniformly at random (`pd_tree_found` False).
Not modelled: vllm-router's exact-match session map (newer releases), the random choice of
an aggregated router before its tree exists.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from planner.cost import CostConfig, CostModel
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
    tree_skips_tool_turns: bool = False
    """A request carrying tool messages goes to the least loaded worker, unrecorded
    (vllm-router 0.1.17)."""
    pd_tree_found: bool = True
    """Whether the P/D mode finds its trees; when not, it picks at random (sglang-router
    0.3.2)."""


SGLANG = CacheAwareConfig(pd_tree_found=False)
VLLM = CacheAwareConfig(max_tree_size=33_554_432, tree_skips_tool_turns=True)


class RoutingText(Protocol):
    """What the routers read from a request's JSON body that a `RequestView` does not carry."""

    def carries_tools(self, request: RequestView) -> bool:
        """Whether its messages hold a tool result or an assistant `tool_calls` turn."""
        ...

    def content_bytes(self, request: RequestView) -> tuple[Sequence[int], int] | None:
        """Its routing text (the messages' contents, joined) as the HTTP routers match it, in
        UTF-8 bytes: the bytes of it within the prompt's first k blocks for k = 0 … len(chain),
        and its whole length; None when unknown (the match rate is then counted in tokens)."""
        ...


class AgentTraffic:
    """The default `RoutingText` when only the simulator's sessions are known: every turn after
    a session's first returns the previous turn's tool call and result; the text's bytes are
    unknown."""

    def carries_tools(self, request: RequestView) -> bool:
        return request.previous_prompt_tokens > 0

    def content_bytes(self, request: RequestView) -> tuple[Sequence[int], int] | None:
        return None


AGENT_TRAFFIC = AgentTraffic()


def match_rate(request: RequestView, matched: int, text: RoutingText) -> float:
    """The share of the request's routing text its best tree match (`matched` blocks)
    covers: bytes of the message contents when known (the binaries' HTTP mode: the template's
    framing and the tool-call JSON are not in the text), else tokens of the prompt (their gRPC
    mode)."""
    known = text.content_bytes(request)
    if known is not None:
        by_block, total = known
        return by_block[min(matched, len(by_block) - 1)] / total if total > 0 else 0.0
    n = request.prompt_tokens
    return min(matched * request.block_size, n) / n if n > 0 else 0.0


def imbalanced(loads: Sequence[int], config: CacheAwareConfig) -> bool:
    """max − min > balance_abs_threshold and max > balance_rel_threshold · min."""
    hi, lo = max(loads), min(loads)
    return hi - lo > config.balance_abs_threshold and hi > lo * config.balance_rel_threshold


class CacheAwareSelector:
    """One `cache_aware` policy object of a router: its tree and its choice in one pool."""

    __slots__ = ("config", "text", "tree")

    def __init__(
        self, config: CacheAwareConfig, block_size: int, text: RoutingText = AGENT_TRAFFIC
    ) -> None:
        self.config = config
        self.text = text
        self.tree = ApproxTree(config.max_tree_size // CHARS_PER_TOKEN // block_size)

    def select(self, pool: Sequence[WorkerView], request: RequestView) -> WorkerView:
        """The worker for `request` (rule 1–3 of the module), recorded in the tree; a tool turn
        where the tree skips those: the least loaded, unrecorded."""
        cfg = self.config
        chain = request.chain
        if cfg.tree_skips_tool_turns and self.text.carries_tools(request):
            return first_min(pool, queue_load)
        if imbalanced([queue_load(w) for w in pool], cfg):
            chosen = first_min(pool, queue_load)
        else:
            matched, tenant = self.tree.match(chain)
            hit = None
            if match_rate(request, matched, self.text) > cfg.cache_threshold:
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

    def __init__(
        self,
        config: CostConfig | None = None,
        model: CostModel | None = None,
        peer_config: CacheAwareConfig | None = None,
        text: RoutingText = AGENT_TRAFFIC,
    ) -> None:
        super().__init__(config, model, peer_config)
        self.text = text

    def pick(self, pool: Sequence[WorkerView], request: RequestView) -> WorkerView:
        if self._selector is None:
            self._selector = CacheAwareSelector(self.peer_config, request.block_size, self.text)
        return self._selector.select(pool, request)


class CacheAwarePDPolicy(PeerPolicy[CacheAwareConfig]):
    """P/D `cache_aware`: a prefill instance over the prefill pool and a decode instance over
    the decode pool (PREFILL / DECODE workers, HYBRID ones when a role has none)."""

    name = "sglang-cache-aware-pd"
    default_peer_config = SGLANG
    # built on the first request, as `CacheAwarePolicy._selector`
    _prefill: CacheAwareSelector | None = None
    _decode: CacheAwareSelector | None = None

    def __init__(
        self,
        config: CostConfig | None = None,
        model: CostModel | None = None,
        peer_config: CacheAwareConfig | None = None,
        text: RoutingText = AGENT_TRAFFIC,
        seed: int = 0,
    ) -> None:
        super().__init__(config, model, peer_config)
        self.text = text
        # the random choice of a P/D mode that finds no tree (seeded: runs repeat)
        self.rng = random.Random(seed)

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        ps, ds = split_pools(cluster)
        if not self.peer_config.pd_tree_found:
            p, d = self.rng.choice(ps), self.rng.choice(ds)
            return pd_plan(self, request, p, d, len(ps) * len(ds))
        if self._prefill is None or self._decode is None:
            bs = request.block_size
            self._prefill = CacheAwareSelector(self.peer_config, bs, self.text)
            self._decode = CacheAwareSelector(self.peer_config, bs, self.text)
        p = self._prefill.select(ps, request)
        d = self._decode.select(ds, request)
        return pd_plan(self, request, p, d, len(ps) * len(ds))


class VllmCacheAwarePolicy(CacheAwarePolicy):
    name = "vllm-cache-aware"
    default_peer_config = VLLM


class VllmCacheAwarePDPolicy(CacheAwarePDPolicy):
    name = "vllm-cache-aware-pd"
    default_peer_config = VLLM
