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

from collections.abc import Sequence
from dataclasses import dataclass

from planner.cost import tier_blocks
from planner.policies.peers.common import (
    RandomTiesPeerPolicy,
    decode_first_plan,
    random_min,
    uncached_tokens,
)
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


class DynamoKVPolicy(RandomTiesPeerPolicy[DynamoConfig]):
    """Aggregated KV routing over the workers that prefill and decode (DECODE or HYBRID)."""

    name = "dynamo-kv"
    default_peer_config = DynamoConfig()

    def capacity_blocks(self, w: WorkerView, request: RequestView) -> float:
        """The worker's KV capacity in blocks: its pool as it reports it
        (`kv_capacity_tokens`), else its timing profile's HBM."""
        if w.kv_capacity_tokens:
            return w.kv_capacity_tokens / request.block_size
        return self.model.profile_of(w).hbm_kv_bytes / (
            request.kv_bytes_per_token * request.block_size
        )

    def pick(self, pool: Sequence[WorkerView], request: RequestView) -> WorkerView:
        """The least-cost worker of `pool`, ties at random."""
        cfg = self.peer_config
        return random_min(
            pool, lambda w: kv_cost(w, request, self.capacity_blocks(w, request), cfg), self.rng
        )


class DynamoKVDisaggPolicy(DynamoKVPolicy):
    """KV routing with conditional disaggregation (`isl_bounding`): decode worker first, then a
    local or a remote prefill."""

    name = "dynamo-kv-disagg"

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        cfg = self.peer_config
        return decode_first_plan(
            self, request, cluster, lambda d: not isl_bypass(request, overlap_blocks(d), cfg)
        )
