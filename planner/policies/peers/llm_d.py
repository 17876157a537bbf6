"""The llm-d inference scheduler (its endpoint picker), aggregated and P/D.

Sources: llm-d/llm-d-inference-scheduler (`docs/architecture.md`, the `pd-profile-handler` and
the precise prefix-cache scorer) on kubernetes-sigs/gateway-api-inference-extension's
scheduler (`pkg/epp/scheduling/framework/plugins`: scorers return values in [0, 1], the
max-score picker breaks ties at random). Default profile weights: precise prefix cache 3,
queue 2, KV-cache utilisation 2. Per pod:

    prefix = cached prefix blocks / prompt blocks (the precise scorer's index is fed by the
             engines' KV events: the simulator's exact directory)
    queue  = (max_q − q) / (max_q − min_q) over the candidate pods, q = waiting requests;
             1 for every pod when all queues are equal
    kv     = 1 − kv_usage
    score  = 3 · prefix + 2 · queue + 2 · kv;  the highest wins, ties at random (seeded)

P/D (`pd-profile-handler`): the decode pod is chosen first (the decode profile's scorers over
the decode pods); when the prompt tokens it does not hold are ≥ `threshold`, the prefill
profile (the same scorers over the prefill pods) picks a prefill pod and the KV moves P → D;
below it the decode pod prefills itself. The handler's `threshold` has no shipped default
(deployments set it; examples use 0 and 10): 2048 here, Dynamo's effective-ISL bound, so the
two conditional P/D peers split at one point. Not modelled: session/prefix-affinity filters,
the load-aware and token-load scorers (not in the default profile), predicted-latency routing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planner.cost import held_blocks
from planner.policies.peers.common import (
    RandomTiesPeerPolicy,
    decode_first_plan,
    random_min,
    uncached_tokens,
)
from planner.types import ClusterView, Plan, RequestView, WorkerView


@dataclass(frozen=True, slots=True)
class LlmDConfig:
    """Scorer weights of the default profile and the P/D handler's threshold (tokens)."""

    prefix_weight: float = 3.0
    queue_weight: float = 2.0
    kv_weight: float = 2.0
    pd_threshold: int = 2048


def prefix_score(w: WorkerView, request: RequestView) -> float:
    """Cached prefix blocks / the prompt's blocks, in [0, 1] (0 for a prompt under a block)."""
    n = request.chain_blocks
    return min(held_blocks(w), n) / n if n > 0 else 0.0


def queue_scores(pool: Sequence[WorkerView]) -> list[float]:
    """(max_q − q) / (max_q − min_q) per pod, q = waiting; all 1 when the queues are equal."""
    qs = [w.waiting for w in pool]
    hi, lo = max(qs), min(qs)
    if hi == lo:
        return [1.0] * len(qs)
    return [(hi - q) / (hi - lo) for q in qs]


def kv_score(w: WorkerView) -> float:
    """1 − kv_usage."""
    return 1.0 - w.kv_usage


def scores(
    pool: Sequence[WorkerView], request: RequestView, config: LlmDConfig
) -> dict[str, float]:
    """Each pod's weighted score (the module's formula)."""
    return {
        w.worker_id: config.prefix_weight * prefix_score(w, request)
        + config.queue_weight * q
        + config.kv_weight * kv_score(w)
        for w, q in zip(pool, queue_scores(pool), strict=True)
    }


class LlmDPolicy(RandomTiesPeerPolicy[LlmDConfig]):
    """The default scheduling profile over the pods that prefill and decode (DECODE or
    HYBRID)."""

    name = "llm-d"
    default_peer_config = LlmDConfig()

    def pick(self, pool: Sequence[WorkerView], request: RequestView) -> WorkerView:
        """The max-score pod of `pool`, ties at random."""
        s = scores(pool, request, self.peer_config)
        return random_min(pool, lambda w: -s[w.worker_id], self.rng)


class LlmDPDPolicy(LlmDPolicy):
    """The P/D profiles: decode pod first, a prefill pod when enough of the prompt is not
    cached on it."""

    name = "llm-d-pd"

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        threshold = self.peer_config.pd_threshold
        return decode_first_plan(
            self,
            request,
            cluster,
            lambda d: uncached_tokens(request, held_blocks(d)) >= threshold,
        )
