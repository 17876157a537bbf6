"""Mooncake's Conductor (KVCache-centric scheduling with early rejection), on a P/D cluster.

Source: Qin et al., "Mooncake: A KVCache-centric Disaggregated Architecture for LLM Serving"
(FAST '25), §5–6 and Algorithm 1 (kvcache-ai/Mooncake ships the transfer engine and the
store; the Conductor is described there, not shipped). For each prefill instance p, with
local = the prefix p holds, best = the longest prefix any instance holds (on `source`):

    TTFT(p) = T_queue(p) + T_prefill(N, local)                         if best / local <
                                                                          kvcache_balancing_threshold
            = T_transfer(best − local: source → p) + T_queue(p) + T_prefill(N, best)   otherwise

and the instance with the least TTFT prefills (fetching the longer prefix first in the second
case). The Conductor tracks every copy of a prefix and the transfers it started: `source` is a
holder of the best prefix on p's node when there is one, else the holder whose node's NIC has
the least queued (`WorkerView.nic_backlog_s`), and a transfer across nodes waits for that
queue. The decode instance is the one with the least predicted TBT. The request is rejected
early (HTTP 429, `RequestRejectedError`) when the least TTFT exceeds the TTFT SLO or that TBT
exceeds the TBT SLO.

The estimates are the timing profile's (the ones the simulator runs on): T_queue =
per_token_s · inflight prefill tokens + base_s · waiting prefills; T_prefill(N, r) =
prefill_s(N − r, r); T_transfer = the link's transfer_s (+ the source node's NIC backlog
across nodes); TBT = decode_step_s(running + 1,
context + N), context = kv_usage · KV capacity. The paper sets no value for
kvcache_balancing_threshold nor universal SLOs (its evaluation scales them from the unloaded
latencies): here a remote prefix is used once it is 1.25× the local one, and the SLOs are 10×
the request's prefill alone on an idle instance and 5× an idle decode step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ownerserve.profiles import kv_transport_into
from planner.cost import Route, held_blocks
from planner.policies.base import is_continuation, make_plan, pd_route, split_pools
from planner.policies.peers.common import PeerPolicy, RequestRejectedError
from planner.types import Action, ClusterView, Plan, RequestView, WorkerView


@dataclass(frozen=True, slots=True)
class MooncakeConfig:
    """The balancing threshold (a ratio of prefix lengths) and the SLOs, as multiples of the
    request's unloaded TTFT and TBT."""

    kvcache_balancing_threshold: float = 1.25
    ttft_slo_factor: float = 10.0
    tbt_slo_factor: float = 5.0


@dataclass(frozen=True, slots=True)
class PrefillOption:
    """One prefill instance's predicted TTFT, and the instance to fetch the prefix from (None:
    its own prefix)."""

    worker: WorkerView
    ttft_s: float
    source: WorkerView | None = None


class MooncakeConductorPolicy(PeerPolicy[MooncakeConfig]):
    """The Conductor over the prefill pool (PREFILL workers, HYBRID when none) and the decode
    pool (DECODE, HYBRID when none)."""

    name = "mooncake-conductor"
    default_peer_config = MooncakeConfig()

    def queue_s(self, w: WorkerView) -> float:
        """per_token_s · inflight_prefill_tokens + base_s · waiting."""
        pf = self.model.profile_of(w).prefill
        return pf.per_token_s * w.inflight_prefill_tokens + pf.base_s * w.waiting

    def prefill_s(self, w: WorkerView, request: RequestView, blocks: int) -> float:
        """prefill_s(N − r, r), r = min(blocks · bs, N)."""
        r = min(blocks * request.block_size, request.prompt_tokens)
        return self.model.profile_of(w).prefill_s(request.prompt_tokens - r, r)

    def transfer_s(self, src: WorkerView, dst: WorkerView, blocks: int, bs: int, k: int) -> float:
        """The link's time for `blocks` blocks from src to dst, after src's node's NIC backlog
        when they cross nodes."""
        if blocks <= 0:
            return 0.0
        same = src.node == dst.node
        path = kv_transport_into(same, dst.kv_same_host, dst.kv_transport)
        t = self.model.profile_of(dst).link.transfer_s(blocks * bs * k, path)
        return t if same else t + src.nic_backlog_s

    def option(
        self, p: WorkerView, request: RequestView, best: int, source: WorkerView | None
    ) -> PrefillOption:
        """p's TTFT by Algorithm 1 (the module's formula)."""
        local = held_blocks(p)
        q = self.queue_s(p)
        ratio = best / local if local else (float("inf") if best else 0.0)
        if source is None or ratio < self.peer_config.kvcache_balancing_threshold:
            return PrefillOption(p, q + self.prefill_s(p, request, local))
        t = self.transfer_s(source, p, best - local, request.block_size, request.kv_bytes_per_token)
        return PrefillOption(p, t + q + self.prefill_s(p, request, best), source)

    def best_prefill(
        self, pool: Sequence[WorkerView], request: RequestView, cluster: ClusterView
    ) -> PrefillOption:
        """The prefill option with the least TTFT (the first on a tie)."""
        best = max(held_blocks(w) for w in cluster.workers)
        near: dict[str, WorkerView] = {}
        far: WorkerView | None = None
        if best:
            for w in cluster.workers:
                if held_blocks(w) == best:
                    near.setdefault(w.node, w)
                    if far is None or w.nic_backlog_s < far.nic_backlog_s:
                        far = w
        chosen: PrefillOption | None = None
        for p in pool:
            o = self.option(p, request, best, near.get(p.node, far))
            if chosen is None or o.ttft_s < chosen.ttft_s:
                chosen = o
        assert chosen is not None
        return chosen

    def tbt_s(self, d: WorkerView, request: RequestView) -> float:
        """decode_step_s(running + 1, kv_usage · capacity + N), the capacity the worker's pool
        as it reports it (`kv_capacity_tokens`), else its profile's HBM."""
        prof = self.model.profile_of(d)
        cap = d.kv_capacity_tokens or prof.hbm_kv_bytes / request.kv_bytes_per_token
        ctx = d.kv_usage * cap
        return prof.decode_step_s(d.running + 1, int(ctx) + request.prompt_tokens)

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        ps, ds = split_pools(cluster)
        o = self.best_prefill(ps, request, cluster)
        d = min(ds, key=lambda w: self.tbt_s(w, request))
        cfg = self.peer_config
        prof = self.model.profile_of(o.worker)
        ttft_slo = cfg.ttft_slo_factor * prof.prefill_s(request.prompt_tokens, 0)
        tbt_slo = cfg.tbt_slo_factor * prof.decode_step_s(1, request.prompt_tokens)
        if o.ttft_s > ttft_slo or self.tbt_s(d, request) > tbt_slo:
            raise RequestRejectedError(
                f"mooncake-conductor: predicted TTFT {o.ttft_s:.3f}s (SLO {ttft_slo:.3f}s) or "
                f"TBT {self.tbt_s(d, request) * 1e3:.1f}ms (SLO {tbt_slo * 1e3:.1f}ms) unmet"
            )
        cont = is_continuation(request, self.model)
        if o.source is not None:
            route = Route(Action.ARTIFACT_FETCH, o.worker, d, o.source)
        else:
            route = pd_route(request, o.worker, d, cont)
        return make_plan(
            self.name, self.model, request, route, candidates_considered=len(ps) * len(ds)
        )
