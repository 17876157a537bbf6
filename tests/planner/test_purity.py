"""Planning does no I/O: profiles and specs are read when the model is built, never per plan."""

from __future__ import annotations

import builtins
import socket
from pathlib import Path
from typing import Any

import pytest

from ownerserve.types import Role, Tier
from planner.calibration import Calibrator
from planner.cost import CostConfig, CostModel
from planner.explain import plan_to_dict, plan_to_header
from planner.policies import POLICY_NAMES, get_policy
from planner.types import ClusterView, RequestView, WorkerView


def test_no_file_or_socket_is_touched_while_planning(monkeypatch: pytest.MonkeyPatch) -> None:
    model = CostModel(CostConfig(kv_spec="llama3-8b"))  # reads YAML here, once
    policies = [get_policy(n, model=model) for n in POLICY_NAMES]
    cal = Calibrator()

    def forbidden(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("I/O while planning")

    # only reachable by patching: planning has no I/O to make fail for real
    monkeypatch.setattr(builtins, "open", forbidden)
    monkeypatch.setattr(Path, "read_text", forbidden)
    monkeypatch.setattr(Path, "open", forbidden)
    monkeypatch.setattr(socket, "socket", forbidden)

    ws = (
        WorkerView(worker_id="p0", role=Role.PREFILL),
        WorkerView(worker_id="d0", role=Role.DECODE, cached_blocks={Tier.CPU: 40}, running=5),
        WorkerView(worker_id="h0", role=Role.HYBRID, cached_blocks={Tier.GPU: 10}, node="n1"),
    )
    req = RequestView(
        model="m", prompt_tokens=700, block_size=16, chain_blocks=43, session_owner="d0",
        owner="h0", owner_blocks=10, previous_prompt_tokens=690, idle_s=900.0,
    )  # fmt: skip
    for p in policies:
        plan = p.plan(req, cal.apply_all(ClusterView(workers=ws)))
        cal.observe_plan(plan, ttft_s=0.1, tpot_s=0.01, transfer_s=0.001)
        assert plan_to_header(plan) and plan_to_dict(plan)
