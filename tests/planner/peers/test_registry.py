"""The peers are registered by name next to OwnerServe's policies, and a `Planner` serves them."""

from __future__ import annotations

from ownerserve.types import Role
from planner.policies import PEER_POLICY_NAMES, POLICY_NAMES, Planner, get_policy
from tests.planner.util import UNIT_CONFIG, cluster, request, unit_model, worker

MODEL = unit_model()


def test_every_peer_is_built_by_name_and_planned_through_a_planner() -> None:
    assert PEER_POLICY_NAMES == (
        "sglang-cache-aware", "sglang-cache-aware-pd", "vllm-cache-aware", "vllm-cache-aware-pd",
        "vllm-consistent-hash", "vllm-power-of-two", "dynamo-kv", "dynamo-kv-disagg", "llm-d",
        "llm-d-pd", "mooncake-conductor", "thunderagent",
    )  # fmt: skip
    assert not set(PEER_POLICY_NAMES) & set(POLICY_NAMES)
    planner = Planner(UNIT_CONFIG, model=MODEL)
    cl = cluster(worker("p0", Role.PREFILL), worker("d0", Role.DECODE), worker("h0", Role.HYBRID))
    for name in PEER_POLICY_NAMES:
        assert get_policy(name, UNIT_CONFIG, MODEL).name == name
        assert name in planner.names
        pol = planner.for_request(name)
        assert pol is planner.for_request(name)  # built once: a peer's tree persists
        assert pol.plan(request(500, chain=(1, 2, 3, 4, 5)), cl).policy == name
