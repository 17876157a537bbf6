"""Online calibration: observed TTFT, TPOT and transfer times correct each worker's profile.

Per worker and per kind (prefill, decode, link) a scale multiplies the profile's prediction; it
moves towards observed/predicted by a bounded EWMA in log space,

    s ← clamp(s · clamp(observed / predicted, 1/R, R)^α, min_scale, max_scale)

(predicted already includes s, so s converges to the true observed/raw ratio). The scales go
into `WorkerView.prefill_scale/decode_scale/link_scale` (`apply`), so a slow or overloaded
worker's costs rise and it loses traffic.

A KV hand-over (a remote prefill into D; a fetch or migration into P) has a cost no scale
captures: the other engine's queue, the pull, admission, the protocol's round trips, fixed
per hand-over. Its TTFT's excess over the prediction is learnt per receiving worker as an
additive overhead (`WorkerView.handover_s`):

    o ← clamp(o + α · (ttft − predicted_ttft), 0, max_handover_s)

(predicted_ttft = t_queue + t_prefill + t_network + t_restore already includes o, so o
converges to the mean excess). Such a plan's TTFT feeds only that, not the prefill scale.
In-memory state, no I/O; one instance per router.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from planner.types import Action, ClusterView, CostBreakdown, Plan, WorkerView


def predicted_ttft_s(cost: CostBreakdown) -> float:
    """The time to first token a plan's cost predicts: T_queue + T_prefill + T_network +
    T_restore (what a remote prefill's or a moved plan's TTFT is observed against)."""
    return cost.t_queue + cost.t_prefill + cost.t_network + cost.t_restore


@dataclass(frozen=True, slots=True)
class CalibrationConfig:
    """α (`alpha`) is the weight of one sample; `max_sample_ratio` is R, the most one sample
    can claim (a 10× outlier counts as R×); scales stay within [min_scale, max_scale];
    predictions below `min_predicted_s` carry too little signal and are ignored."""

    alpha: float = 0.2
    min_scale: float = 0.25
    max_scale: float = 8.0
    max_handover_s: float = 10.0
    max_sample_ratio: float = 4.0
    min_predicted_s: float = 1e-5

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        if not 0.0 < self.min_scale <= 1.0 <= self.max_scale:
            raise ValueError("need 0 < min_scale <= 1 <= max_scale")
        if self.max_sample_ratio < 1.0:
            raise ValueError("max_sample_ratio must be >= 1")


@dataclass(frozen=True, slots=True)
class WorkerScales:
    """observed/predicted ratios of one worker (1.0: the profile is exact)."""

    prefill: float = 1.0
    decode: float = 1.0
    link: float = 1.0
    handover_s: float = 0.0
    """Seconds a P/D hand-over into the worker takes beyond its prediction (additive)."""


_KINDS = ("prefill", "decode", "link")


class Calibrator:
    """Per-worker scales learned from observed timings (not thread-safe: one event loop)."""

    __slots__ = ("_applied", "_scales", "config", "samples")

    def __init__(self, config: CalibrationConfig | None = None) -> None:
        self.config = config or CalibrationConfig()
        self._scales: dict[str, list[float]] = {}
        # per worker the last view `apply` scaled, its scales then and the result: a view
        # that did not change keeps its scaled object (consumers compare views by identity)
        self._applied: dict[str, tuple[WorkerView, tuple[float, ...], WorkerView]] = {}
        self.samples = 0

    def _update(self, worker: str, kind: int, observed_s: float, predicted_s: float) -> bool:
        cfg = self.config
        if not (predicted_s >= cfg.min_predicted_s and observed_s > 0.0):
            return False  # also rejects NaN
        if math.isinf(observed_s) or math.isinf(predicted_s):
            return False
        r = observed_s / predicted_s
        r = min(max(r, 1.0 / cfg.max_sample_ratio), cfg.max_sample_ratio)
        s = self._scales.setdefault(worker, [1.0, 1.0, 1.0, 0.0])
        s[kind] = min(max(s[kind] * r**cfg.alpha, cfg.min_scale), cfg.max_scale)
        self.samples += 1
        return True

    def observe_prefill(self, worker: str, observed_s: float, predicted_s: float) -> bool:
        """A prefill (queue + compute) on `worker` took `observed_s` where the plan said
        `predicted_s`; returns whether the sample was used."""
        return self._update(worker, 0, observed_s, predicted_s)

    def observe_decode(self, worker: str, observed_s: float, predicted_s: float) -> bool:
        """A decode step (TPOT) on `worker`: observed vs predicted seconds."""
        return self._update(worker, 1, observed_s, predicted_s)

    def observe_handover(self, worker: str, observed_s: float, predicted_s: float) -> bool:
        """A plan that moved KV into `worker` reached its first token in `observed_s` where
        it said `predicted_s`: the excess moves the worker's hand-over overhead."""
        if math.isnan(observed_s) or math.isinf(observed_s) or math.isinf(predicted_s):
            return False
        if observed_s <= 0.0 or predicted_s < 0.0:
            return False
        cfg = self.config
        s = self._scales.setdefault(worker, [1.0, 1.0, 1.0, 0.0])
        o = s[3] + cfg.alpha * (observed_s - predicted_s)
        s[3] = min(max(o, 0.0), cfg.max_handover_s)
        self.samples += 1
        return True

    def observe_transfer(self, worker: str, observed_s: float, predicted_s: float) -> bool:
        """A KV transfer *into* `worker`: observed vs predicted seconds."""
        return self._update(worker, 2, observed_s, predicted_s)

    def observe_plan(
        self,
        plan: Plan,
        *,
        ttft_s: float | None = None,
        tpot_s: float | None = None,
        transfer_s: float | None = None,
    ) -> int:
        """Feed one executed plan's observed timings back; returns how many samples were used.

        TTFT: the prefill worker's sample is (ttft − t_network − t_restore) against
        (t_queue + t_prefill), the parts the prefill scale multiplies. TPOT: the decode worker's
        sample against t_decode_step. Transfer: the worker the KV moved into (D for remote
        prefill, P for fetch/migration) against t_transfer, the transfer's own seconds (not
        t_network, which also holds the learnt hand-over overhead and P→D's handshake: against
        it the link looked faster as the overhead grew). A remote prefill's TTFT goes to
        D's hand-over overhead (`observe_handover`) against t_queue + t_prefill + t_network +
        t_restore, not to P's prefill scale; so does a fetch's or migration's that moved KV,
        to P's."""
        c = plan.chosen
        b = c.cost
        used = 0
        if ttft_s is not None:
            if c.action is Action.REMOTE_PREFILL or (c.source_worker and b.t_network > 0.0):
                used += self.observe_handover(c.decode_worker, ttft_s, predicted_ttft_s(b))
            else:
                observed = ttft_s - b.t_network - b.t_restore
                used += self.observe_prefill(c.prefill_worker, observed, b.t_queue + b.t_prefill)
        if tpot_s is not None:
            used += self.observe_decode(c.decode_worker, tpot_s, b.t_decode_step)
        if transfer_s is not None and b.t_transfer > 0.0:
            into = c.decode_worker if c.action is Action.REMOTE_PREFILL else c.prefill_worker
            used += self.observe_transfer(into, transfer_s, b.t_transfer)
        return used

    def scales(self, worker: str) -> WorkerScales:
        s = self._scales.get(worker)
        return WorkerScales() if s is None else WorkerScales(s[0], s[1], s[2], s[3])

    def snapshot(self) -> dict[str, WorkerScales]:
        """Every calibrated worker's scales (for the admin API and logs)."""
        return {w: WorkerScales(s[0], s[1], s[2], s[3]) for w, s in self._scales.items()}

    def forget(self, worker: str) -> None:
        """Drop a worker's scales (it restarted or left the pool)."""
        self._scales.pop(worker, None)
        self._applied.pop(worker, None)

    def apply(self, view: WorkerView) -> WorkerView:
        """`view` with this calibrator's scales for its worker."""
        s = self._scales.get(view.worker_id)
        if s is None:
            return view
        key = (s[0], s[1], s[2], s[3])
        last = self._applied.get(view.worker_id)
        if last is not None and last[0] is view and last[1] == key:
            return last[2]
        out = replace(view, prefill_scale=s[0], decode_scale=s[1], link_scale=s[2], handover_s=s[3])
        self._applied[view.worker_id] = (view, key, out)
        return out

    def apply_all(self, cluster: ClusterView) -> ClusterView:
        return replace(cluster, workers=tuple(self.apply(w) for w in cluster.workers))


__all__ = ["CalibrationConfig", "Calibrator", "WorkerScales"]
