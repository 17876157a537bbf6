"""The cost-based PD-hybrid planner: request classification, the cost model, every policy.
Pure code: no I/O. Imports only `ownerserve`."""

from planner.types import (
    Action,
    Candidate,
    ClusterView,
    CostBreakdown,
    Plan,
    Policy,
    RequestClass,
    RequestView,
    WorkerView,
)

__all__ = [
    "Action",
    "Candidate",
    "ClusterView",
    "CostBreakdown",
    "Plan",
    "Policy",
    "RequestClass",
    "RequestView",
    "WorkerView",
]
