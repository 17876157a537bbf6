"""How a plan is shown to clients and operators: the `x-ownerserve-plan` response header
(the planner's `plan_to_header` plus the chosen candidate's cost breakdown) and the record
kept for `GET /admin/plans`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ownerserve.records import fast_init
from planner import plan_to_dict, plan_to_header
from planner.types import Plan


def plan_header(plan: Plan, fetched: bool | None = None) -> bytes:
    """`key=value;...`: policy, class, action, workers, cost and runner-up, then the cost
    terms of the chosen candidate (seconds; `m_hbm` in bytes) and whether a fetch succeeded."""
    b = plan.chosen.cost
    text = (
        f"{plan_to_header(plan)};t_queue={b.t_queue:.6g};t_compute={b.t_compute:.6g}"
        f";t_network={b.t_network:.6g};t_restore={b.t_restore:.6g};m_hbm={b.m_hbm_bytes:.6g}"
        f";i_decode={b.i_decode:.6g}"
    )
    if fetched is not None:
        text += f";fetched={'1' if fetched else '0'}"
    return text.encode("latin-1", errors="replace")


@fast_init
@dataclass(frozen=True, slots=True)
class PlanRecord:
    """One executed plan, as `GET /admin/plans` lists it (the dict is built lazily)."""

    at: float
    session_id: str | None
    plan: Plan
    fetched: bool | None

    @classmethod
    def of(cls, plan: Plan, session_id: str | None, fetched: bool | None) -> PlanRecord:
        return cls(time.time(), session_id, plan, fetched)

    def as_dict(self) -> dict[str, Any]:
        out = plan_to_dict(self.plan)
        out.update(at=self.at, session_id=self.session_id, fetched=self.fetched)
        return out
