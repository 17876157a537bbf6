"""Trace-driven discrete-event simulation of routing policies on large xPyD clusters."""

from loadgen.sim.admission import AdmissionConfig, ProgramGate, RouterAdmission, ThunderAgentGate
from loadgen.sim.engine import ClusterSpec, SimResult, Simulator
from loadgen.sim.workload import (
    AgenticShape,
    SimSession,
    SimTurn,
    agentic_sessions,
    kv_working_set,
    trace_sessions,
)

__all__ = [
    "AdmissionConfig",
    "AgenticShape",
    "ClusterSpec",
    "ProgramGate",
    "RouterAdmission",
    "SimResult",
    "SimSession",
    "SimTurn",
    "Simulator",
    "ThunderAgentGate",
    "agentic_sessions",
    "kv_working_set",
    "trace_sessions",
]
