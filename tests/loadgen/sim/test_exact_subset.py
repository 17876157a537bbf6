"""The simulator's ownerserve runs above `full_view_max` workers: planned over the exact
candidate subset (planner.candidates), they are the runs weighing every worker."""

from __future__ import annotations

import pytest

from loadgen.sim.engine import ClusterSpec, Simulator
from loadgen.sim.workload import agentic_sessions
from ownerserve.profiles import load_profile
from planner.calibration import Calibrator
from planner.candidates import ExactSubsetPolicy
from planner.policies import get_policy

PROFILE = load_profile("h100-llama3-8b")


@pytest.mark.parametrize("calibration", [False, True])
def test_the_exact_subset_runs_as_the_full_view(calibration: bool) -> None:
    """Above `full_view_max` the ownerserve policy plans over its exact candidate subset
    (planner.candidates): every plan, so the whole run, is the one weighing every worker."""
    sessions = agentic_sessions(40, 3.0, seed=11)
    spec = ClusterSpec.of_size(120)
    runs = []
    for full_view in (False, True):
        sim = Simulator(
            spec,
            PROFILE,
            get_policy("ownerserve"),
            full_view=full_view,
            calibrator=Calibrator() if calibration else None,
        )
        assert isinstance(sim.policy, ExactSubsetPolicy) is not full_view
        runs.append(sim.run(sessions).summary() | {"wall_s": 0, "events_per_s": 0})
    assert runs[0] == runs[1]
