"""NVIDIA Dynamo's KV router (`--router-mode kv`), aggregated and with conditional
disaggregation.

Sources: ai-dynamo/dynamo `docs/components/router/router-concepts.md` (the cost),
`router-configuration.md` (defaults), `router-disaggregated-serving.md` and its
`IslBoundingPolicy` launch scripts (conditional disaggregation). Per worker, lowest wins:

    adjusted_prefill = max(active_prefill_blocks + request_blocks − overlap_credit, 0)
    cost             = prefill_load_scale · adjusted_prefill + active_decode_blocks
                       + request_blocks

request_blocks = ⌈N / bs⌉; overlap_credit = the worker's cached prefix of the request, by tier:
device blocks × 1.0, host blocks beyond them × 0.75, disk blocks beyond both × 0.25 (the index
is fed by KV events, so it is the simulator's exact directory: `WorkerView.cached_blocks`);
active_prefill_blocks = ⌈inflight_prefill_tokens / bs⌉; active_decode_blocks = the blocks the
worker's running sequences hold, kv_usage × its KV capacity in blocks. prefill_load_scale is
`--kv-overlap-score-weight` (default 1.0). Temperature 0 (the default): the least cost, ties
at random (seeded). Not modelled: the optional decay of device credit on busy workers, the
`lmetric` variant, session-affinity headers, queueing and 529 shedding, the predicted side
index.

Conditional disaggregation, policy `isl_bounding`: the decode worker is chosen first (the KV
cost over the decode pool); effective ISL = N − its cached overlap in tokens; the prefill runs
locally on it (bypass) when effective ISL < 2048 *and* effective ISL / N < 0.7, otherwise on
the prefill worker the KV cost picks in the prefill pool (remote prefill, KV moves P → D).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from planner.cost import CostConfig, CostModel, tier_blocks
from planner.policies.base import (
    decode_capable,
    decode_pool,
    is_continuation,
    make_plan,
    pd_route,
    prefill_pool,
    require,
)
from planner.policies.peers.common import random_min, uncached_tokens
from planner.types import ClusterView, Plan, RequestView, WorkerView


@dataclass(frozen=True, slots=True)
class DynamoConfig:
    """The KV router's weights and the `isl_bounding` thresholds."""

    prefill_load_scale: float = 1.0
    device_credit: float = 1.0
    host_credit: float = 0.75
    disk_credit: float = 0.25
    eff_isl_threshold: int = 2048
    eff_isl_ratio_threshold: float = 0.7


def overlap_credit(w: WorkerView, config: DynamoConfig) -> float:
    """device · g + host · max(0, c − g) + disk · max(0, s − max(g, c)), (g, c, s) the
    worker's cached prefix in blocks on GPU, CPU, SSD."""
    g, c, s = tier_blocks(w)
    gc = g if g >= c else c
    return (
        config.device_credit * g
        + config.host_credit * (c - g if c > g else 0)
        + config.disk_credit * (s - gc if s > gc else 0)
    )


def overlap_blocks(w: WorkerView) -> int:
    """The longest cached prefix on any tier, in blocks."""
    g, c, s = tier_blocks(w)
    return max(g, c, s)


def request_blocks(request: RequestView) -> int:
    """⌈N / bs⌉."""
    return -(-request.prompt_tokens // request.block_size)


def kv_cost(
    w: WorkerView, request: RequestView, capacity_blocks: float, config: DynamoConfig
) -> float:
    """prefill_load_scale · max(active_prefill + request_blocks − overlap_credit, 0) +
    active_decode + request_blocks (the module's formula)."""
    bs = request.block_size
    new = request_blocks(request)
    active_prefill = -(-w.inflight_prefill_tokens // bs)
    adjusted = active_prefill + new - overlap_credit(w, config)
    return (
        config.prefill_load_scale * (adjusted if adjusted > 0 else 0.0)
        + w.kv_usage * capacity_blocks
        + new
    )


def isl_bypass(request: RequestView, cached_blocks: int, config: DynamoConfig) -> bool:
    """Prefill locally on the decode worker: effective ISL < eff_isl_threshold and effective
    ISL / N < eff_isl_ratio_threshold."""
    eff = uncached_tokens(request, cached_blocks)
    n = request.prompt_tokens
    return eff < config.eff_isl_threshold and (eff / n if n else 0.0) < (
        config.eff_isl_ratio_threshold
    )


class DynamoKVPolicy:
    """Aggregated KV routing over the workers that prefill and decode (DECODE or HYBRID)."""

    name = "dynamo-kv"

    def __init__(
        self,
        config: CostConfig | None = None,
        model: CostModel | None = None,
        peer_config: DynamoConfig | None = None,
        seed: int = 0,
    ) -> None:
        self.model = model or CostModel(config)
        self.peer_config = peer_config or DynamoConfig()
        self.rng = random.Random(seed)

    def capacity_blocks(self, w: WorkerView, request: RequestView) -> float:
        """The worker's KV capacity in blocks (its timing profile's HBM)."""
        return self.model.profile_of(w).hbm_kv_bytes / (
            request.kv_bytes_per_token * request.block_size
        )

    def best(self, pool: Sequence[WorkerView], request: RequestView) -> WorkerView:
        """The least-cost worker of `pool`, ties at random."""
        cfg = self.peer_config
        return random_min(
            pool, lambda w: kv_cost(w, request, self.capacity_blocks(w, request), cfg), self.rng
        )

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        pool = decode_capable(cluster)
        require(pool, "decode-capable")
        w = self.best(pool, request)
        route = pd_route(request, w, w, is_continuation(request, self.model))
        return make_plan(self.name, self.model, request, route, candidates_considered=len(pool))


class DynamoKVDisaggPolicy(DynamoKVPolicy):
    """KV routing with conditional disaggregation (`isl_bounding`): decode worker first, then a
    local or a remote prefill."""

    name = "dynamo-kv-disagg"

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        ds = decode_pool(cluster)
        require(ds, "decode")
        d = self.best(ds, request)
        cont = is_continuation(request, self.model)
        if isl_bypass(request, overlap_blocks(d), self.peer_config):
            route = pd_route(request, d, d, cont)
            considered = len(ds)
        else:
            ps = prefill_pool(cluster)
            require(ps, "prefill")
            route = pd_route(request, self.best(ps, request), d, cont)
            considered = len(ds) + len(ps)
        return make_plan(self.name, self.model, request, route, candidates_considered=considered)
