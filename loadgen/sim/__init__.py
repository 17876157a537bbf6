"""Trace-driven discrete-event simulation of routing policies on large xPyD clusters."""

from loadgen.sim.engine import ClusterSpec, SimResult, Simulator
from loadgen.sim.workload import AgenticShape, SimSession, SimTurn, agentic_sessions, trace_sessions

__all__ = [
    "AgenticShape",
    "ClusterSpec",
    "SimResult",
    "SimSession",
    "SimTurn",
    "Simulator",
    "agentic_sessions",
    "trace_sessions",
]
