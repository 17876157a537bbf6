"""The peer routers' policies, modelled from their own documentation and code behind the
`Policy` protocol, so the simulator (and the router) can run them next to OwnerServe's. Each
module names its source and ships the peer's defaults; `PEERS` maps the registered names to
their classes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from planner.cost import CostConfig, CostModel
from planner.policies.peers.cache_aware import (
    CacheAwarePDPolicy,
    CacheAwarePolicy,
    VllmCacheAwarePDPolicy,
    VllmCacheAwarePolicy,
)
from planner.policies.peers.common import RequestRejectedError
from planner.policies.peers.consistent_hash import ConsistentHashPolicy
from planner.policies.peers.dynamo import DynamoKVDisaggPolicy, DynamoKVPolicy
from planner.policies.peers.llm_d import LlmDPDPolicy, LlmDPolicy
from planner.policies.peers.mooncake import MooncakeConductorPolicy
from planner.policies.peers.power_of_two import PowerOfTwoPolicy
from planner.policies.peers.thunderagent import ThunderAgentPolicy
from planner.types import Policy

PEERS: Mapping[str, Callable[[CostConfig | None, CostModel | None], Policy]] = MappingProxyType(
    {
        cls.name: cls
        for cls in (
            CacheAwarePolicy,
            CacheAwarePDPolicy,
            VllmCacheAwarePolicy,
            VllmCacheAwarePDPolicy,
            ConsistentHashPolicy,
            PowerOfTwoPolicy,
            DynamoKVPolicy,
            DynamoKVDisaggPolicy,
            LlmDPolicy,
            LlmDPDPolicy,
            MooncakeConductorPolicy,
            ThunderAgentPolicy,
        )
    }
)

DISAGGREGATED: frozenset[str] = frozenset(
    {
        CacheAwarePDPolicy.name,
        VllmCacheAwarePDPolicy.name,
        DynamoKVDisaggPolicy.name,
        LlmDPDPolicy.name,
        MooncakeConductorPolicy.name,
    }
)
"""The peers that run on separate prefill and decode pools; the others run aggregated
(every worker prefills and decodes)."""

__all__ = [
    "DISAGGREGATED",
    "PEERS",
    "CacheAwarePDPolicy",
    "CacheAwarePolicy",
    "ConsistentHashPolicy",
    "DynamoKVDisaggPolicy",
    "DynamoKVPolicy",
    "LlmDPDPolicy",
    "LlmDPolicy",
    "MooncakeConductorPolicy",
    "PowerOfTwoPolicy",
    "RequestRejectedError",
    "ThunderAgentPolicy",
    "VllmCacheAwarePDPolicy",
    "VllmCacheAwarePolicy",
]
