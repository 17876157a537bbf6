"""The cost-based PD-hybrid planner: request classification, the cost model, every policy,
online calibration. Pure code: no I/O while planning. Imports only `ownerserve`."""

from planner.calibration import CalibrationConfig, Calibrator, WorkerScales
from planner.classify import DEFAULT_ACTION, classify
from planner.cost import CostConfig, CostModel, RequestCosts, Route, evaluate
from planner.explain import parse_plan_header, plan_to_dict, plan_to_header
from planner.policies import POLICY_NAMES, Planner, get_policy
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
    "DEFAULT_ACTION",
    "POLICY_NAMES",
    "Action",
    "CalibrationConfig",
    "Calibrator",
    "Candidate",
    "ClusterView",
    "CostBreakdown",
    "CostConfig",
    "CostModel",
    "Plan",
    "Planner",
    "Policy",
    "RequestClass",
    "RequestCosts",
    "RequestView",
    "Route",
    "WorkerScales",
    "WorkerView",
    "classify",
    "evaluate",
    "get_policy",
    "parse_plan_header",
    "plan_to_dict",
    "plan_to_header",
]
