"""The router's state on one screen, as `GET /admin/status` answers it (and `ownerserve status`
shows it): each worker's health, load, KV fill and the working set admission decides by, its
calibration and NIC backlog; the admission queue; the mix of the recent plans; the sessions
holding the most KV. Bounded: one entry per worker, `TOP_SESSIONS` sessions, counts of the
recent plans (`GET /admin/plans` has them whole)."""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from router.telemetry import TOP_SESSIONS

if TYPE_CHECKING:
    from router.state import Router


def worker_status(router: Router, now: float) -> list[dict[str, Any]]:
    """Each worker as the status shows it."""
    scales = router.calibrator.snapshot()
    backlog = router.nics.snapshot(now)
    admission = router.admission
    out = []
    for w in router.pool.all():
        a = admission.shown(w, now)
        s = scales.get(w.worker_id)
        load = w.load
        out.append(
            {
                "id": w.worker_id,
                "role": w.settings.role.value,
                "kind": w.settings.kind.value,
                "node": w.settings.node,
                "healthy": w.healthy,
                "draining": w.draining,
                "breaker": w.breaker.state.name.lower(),
                "inflight": w.inflight,
                "running": load.running,
                "waiting": load.waiting,
                "kv_usage": load.kv_usage,
                "kv_capacity_tokens": a.kv_capacity_tokens,
                "admission": {
                    "kv_usage": a.kv_usage,
                    "paused": a.paused,
                    "working_set_tokens": a.programs_tokens,
                    "budget_tokens": a.programs_budget_tokens,
                    "sessions": a.sessions,
                    "closed": a.closed,
                },
                "calibration": None
                if s is None
                else {"prefill": s.prefill, "decode": s.decode, "link": s.link},
                "nic_backlog_s": backlog.get(w.settings.node, 0.0),
            }
        )
    return out


def plan_mix(router: Router) -> dict[str, Any]:
    """The recent plans (`Router.recent_plans`) counted by action, request class and policy,
    with how many fell back to something else or continued a moved answer."""
    plans = list(router.recent_plans)
    return {
        "recent": len(plans),
        "actions": dict(Counter(p.plan.chosen.action.value for p in plans).most_common()),
        "classes": dict(Counter(p.plan.request_class.value for p in plans).most_common()),
        "policies": dict(Counter(p.plan.policy for p in plans).most_common()),
        "fallbacks": sum(p.fallback is not None for p in plans),
        "migrated": sum(p.migrated_from is not None for p in plans),
    }


def kv_prices(router: Router) -> list[dict[str, Any]]:
    """Each KV transport's price as the planner plans with it (`CostModel.kv_prices`): bytes
    per second, fixed latency, measured or configured, and why."""
    return [
        {
            "transport": p.transport.value,
            "bps": p.timing.bps,
            "latency_s": p.timing.latency_s,
            "source": p.source.value,
            "detail": p.detail,
        }
        for p in router.planner.model.kv_prices
    ]


async def router_status(router: Router) -> dict[str, Any]:
    """The whole status: the JSON of `GET /admin/status`."""
    now = time.monotonic()
    settings = router.settings
    a = router.admission
    s = settings.admission
    body: dict[str, Any] = {
        "policy": settings.planner.policy,
        "requests_in_flight": router.leases.open,
        "workers": worker_status(router, now),
        "admission": {
            "enabled": a.enabled,
            "queued": a.queued,
            "max_queued": s.max_queued,
            "high_watermark": s.high_watermark,
            "low_watermark": s.low_watermark,
            "pause_watermark": s.pause_watermark,
            "cluster_full": a.cluster_full(now),
        },
        "plans": plan_mix(router),
        "kv_prices": kv_prices(router),
        "top_sessions": [
            {"session": sid, "worker": w, "tokens": t}
            for sid, w, t in router.working_sets.largest(TOP_SESSIONS, now)
        ],
        "directory": None,
    }
    if router.directory is not None:
        dh = await router.directory.health()
        body["directory"] = {"backend": dh.backend, "healthy": dh.healthy, "detail": dh.detail}
    return body
