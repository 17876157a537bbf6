"""How a plan is shown to clients and operators: the `x-ownerserve-plan` response header and
the record kept for the admin API."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from planner.types import Plan


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def plan_header(plan: Plan, fetched: bool | None = None) -> bytes:
    """`key=value;...` header value: policy, action, class, workers, cost terms, runner-up."""
    try:
        from planner import plan_to_header  # type: ignore[attr-defined]

        text = str(plan_to_header(plan))
    except ImportError:
        text = _local_header(plan)
    if fetched is not None:
        text += f";fetched={'1' if fetched else '0'}"
    return text.encode("latin-1", errors="replace")


def _local_header(plan: Plan) -> str:
    c = plan.chosen
    cost = c.cost
    parts = [
        f"policy={plan.policy}",
        f"action={c.action.value}",
        f"class={plan.request_class.value}",
        f"p={c.prefill_worker}",
        f"d={c.decode_worker}",
    ]
    if c.source_worker:
        parts.append(f"src={c.source_worker}")
    parts += [
        f"reused_blocks={c.reused_blocks}",
        f"cost={_fmt(cost.total)}",
        f"t_queue={_fmt(cost.t_queue)}",
        f"t_compute={_fmt(cost.t_compute)}",
        f"t_network={_fmt(cost.t_network)}",
        f"t_restore={_fmt(cost.t_restore)}",
        f"m_hbm={_fmt(cost.m_hbm_bytes)}",
        f"i_decode={_fmt(cost.i_decode)}",
    ]
    if plan.runner_up is not None:
        parts.append(f"runner_up={plan.runner_up.action.value}")
        parts.append(f"margin={_fmt(plan.margin_s)}")
    return ";".join(parts)


@dataclass(frozen=True, slots=True)
class PlanRecord:
    """One executed plan, as `GET /admin/plans` lists it."""

    at: float
    session_id: str | None
    policy: str
    action: str
    request_class: str
    prefill_worker: str
    decode_worker: str
    source_worker: str | None
    cost_s: float
    runner_up: str | None
    margin_s: float
    fetched: bool | None

    @classmethod
    def of(cls, plan: Plan, session_id: str | None, fetched: bool | None) -> PlanRecord:
        c = plan.chosen
        return cls(
            at=time.time(),
            session_id=session_id,
            policy=plan.policy,
            action=c.action.value,
            request_class=plan.request_class.value,
            prefill_worker=c.prefill_worker,
            decode_worker=c.decode_worker,
            source_worker=c.source_worker,
            cost_s=c.cost.total,
            runner_up=plan.runner_up.action.value if plan.runner_up else None,
            margin_s=plan.margin_s,
            fetched=fetched,
        )

    def as_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}
