"""A plan in words for the router's `x-ownerserve-plan` header and for logs."""

from __future__ import annotations

import functools
import re
from typing import Any

from planner.types import Action, Candidate, CostBreakdown, Plan

_UNSAFE = re.compile(r"[^A-Za-z0-9._:/@+-]")


@functools.lru_cache(maxsize=4096)  # worker ids and policy names recur on every request
def _safe(text: str) -> str:
    """Header-safe: only [A-Za-z0-9._:/@+-]; anything else (';', '=', spaces, non-ASCII) → '_'."""
    return _UNSAFE.sub("_", text)


def _workers(c: Candidate) -> str:
    if c.action is Action.REMOTE_PREFILL:
        return f"{_safe(c.prefill_worker)}>{_safe(c.decode_worker)}"
    return _safe(c.decode_worker)


def plan_to_header(plan: Plan) -> str:
    """Compact `key=value;...` form, e.g.
    `policy=ownerserve;class=new_long_prefix;action=remote_prefill;p=p0;d=d1;cost=0.0123;`
    `runner_up=colocated_prefill@h0:0.015;margin=0.0027` — plus `src=` (fetch/migration source),
    `replica=` (read-only replica to add) and `default=` (the class default, when overridden)."""
    c = plan.chosen
    parts = [
        f"policy={_safe(plan.policy)}",
        f"class={plan.request_class.value}",
        f"action={c.action.value}",
        f"p={_safe(c.prefill_worker)}",
        f"d={_safe(c.decode_worker)}",
    ]
    if c.source_worker is not None:
        parts.append(f"src={_safe(c.source_worker)}")
    parts.append(f"cost={c.cost.total:.6g}")
    if plan.runner_up is not None:
        r = plan.runner_up
        parts.append(f"runner_up={r.action.value}@{_workers(r)}:{r.cost.total:.6g}")
        parts.append(f"margin={plan.margin_s:.6g}")
    if plan.add_replica_on is not None:
        parts.append(f"replica={_safe(plan.add_replica_on)}")
    if plan.overrides_default and plan.default_action is not None:
        default = plan.default_action.value
        if plan.default_cost_s is not None:
            default += f":{plan.default_cost_s:.6g}"
        parts.append(f"default={default}")
    return ";".join(parts)


DECISION_TERMS: tuple[str, ...] = (
    "queue",
    "compute",
    "network",
    "restore",
    "hbm",
    "interference",
    "move",
    "displacement",
)
"""The additive terms of C(a) (`CostBreakdown.total`), as `deciding_term` names them."""
ONLY_CANDIDATE = "only_candidate"
"""`deciding_term` of a plan that priced no other candidate."""
NOT_BY_COST = "policy"
"""`deciding_term` of a plan whose chosen candidate costs more than its runner-up: the policy
chose by its own rule (a baseline, a class default), not by the cost model."""


def _terms(b: CostBreakdown) -> tuple[float, ...]:
    """`b`'s additive terms in `DECISION_TERMS`' order; they sum to `b.total`."""
    return (
        b.t_queue,
        b.t_compute,
        b.t_network,
        b.t_restore,
        b.lam * b.m_hbm_bytes,
        b.mu * b.i_decode,
        b.h_move,
        b.w_disp,
    )


def deciding_term(plan: Plan) -> str:
    """What the plan's choice turned on: the term of C(a) in which the chosen candidate saves
    the most against the runner-up (runner-up's term less the chosen's, the largest; ties to
    the earlier term). `ONLY_CANDIDATE` without a runner-up; `NOT_BY_COST` when the chosen
    costs more than the runner-up. E.g. a decode continuation chosen for the KV it holds
    saves in `compute`; one chosen over a busier owner in `queue`."""
    runner = plan.runner_up
    if runner is None:
        return ONLY_CANDIDATE
    if plan.margin_s < 0:
        return NOT_BY_COST
    saved = [r - c for r, c in zip(_terms(runner.cost), _terms(plan.chosen.cost), strict=True)]
    return DECISION_TERMS[saved.index(max(saved))]


def candidate_to_dict(c: Candidate) -> dict[str, Any]:
    b = c.cost
    return {
        "action": c.action.value,
        "prefill_worker": c.prefill_worker,
        "decode_worker": c.decode_worker,
        "source_worker": c.source_worker,
        "reused_blocks": c.reused_blocks,
        "cost": {
            "total_s": b.total,
            "t_queue_s": b.t_queue,
            "t_compute_s": b.t_compute,
            "t_prefill_s": b.t_prefill,
            "t_decode_step_s": b.t_decode_step,
            "t_network_s": b.t_network,
            "t_nic_s": b.t_nic,
            "t_restore_s": b.t_restore,
            "m_hbm_bytes": b.m_hbm_bytes,
            "i_decode_s": b.i_decode,
            "h_move_s": b.h_move,
            "w_disp_s": b.w_disp,
            "lambda": b.lam,
            "mu": b.mu,
        },
    }


def parse_plan_header(header: str) -> dict[str, str]:
    """The inverse of `plan_to_header`: its `key=value` fields (parts without `=` are skipped)."""
    out: dict[str, str] = {}
    for part in header.split(";"):
        key, sep, value = part.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """Every field of the plan as JSON-ready values (for logs and the admin API)."""
    return {
        "policy": plan.policy,
        "request_class": plan.request_class.value,
        "action": plan.action.value,
        "chosen": candidate_to_dict(plan.chosen),
        "runner_up": None if plan.runner_up is None else candidate_to_dict(plan.runner_up),
        "margin_s": plan.margin_s,
        "add_replica_on": plan.add_replica_on,
        "candidates_considered": plan.candidates_considered,
        "default_action": None if plan.default_action is None else plan.default_action.value,
        "default_cost_s": plan.default_cost_s,
        "overrides_default": plan.overrides_default,
    }
