"""The simulator feeds its own policies' calibrator as the router's aftermath does: each
plan's observed TTFT, TPOT and transfer, once its first token is out, never before."""

from __future__ import annotations

from loadgen.sim.cli import main_rows
from loadgen.sim.engine import ClusterSpec, Simulator
from loadgen.sim.workload import SimSession, SimTurn
from ownerserve.profiles import load_profile
from planner.calibration import Calibrator
from planner.policies import get_policy
from planner.types import ClusterView, Plan, RequestView

PROFILE = load_profile("h100-llama3-8b")
BT = 512


class _Seen:
    """The ownerserve policy, keeping every view it was shown."""

    def __init__(self) -> None:
        self.inner = get_policy("ownerserve")
        self.name = self.inner.name
        self.views: list[ClusterView] = []

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        self.views.append(cluster)
        return self.inner.plan(request, cluster)


def _session(i: int, start: float) -> SimSession:
    chain = tuple(1000 * i + k for k in range(16))  # 8k tokens: a prefill of ~0.4 s
    return SimSession(i, start, (SimTurn(chain, len(chain) * BT, 20, 0.0),))


def _calibrated(view: ClusterView) -> bool:
    return any(
        (w.prefill_scale, w.decode_scale, w.link_scale, w.handover_s) != (1.0, 1.0, 1.0, 0.0)
        for w in view.workers
    )


def test_observations_reach_the_views_only_after_the_first_token() -> None:
    policy = _Seen()
    cal = Calibrator()
    sim = Simulator(ClusterSpec(0, 0, 2, block_tokens=BT), PROFILE, policy, calibrator=cal)
    # the second arrives before the first's first token, the third long after both
    sim.run([_session(0, 0.0), _session(1, 0.001), _session(2, 30.0)])
    assert [_calibrated(v) for v in policy.views] == [False, False, True]
    assert cal.samples >= 4  # TTFT and TPOT of the first two plans


def test_without_a_calibrator_the_views_keep_the_profile() -> None:
    policy = _Seen()
    sim = Simulator(ClusterSpec(0, 0, 2, block_tokens=BT), PROFILE, policy)
    sim.run([_session(0, 0.0), _session(1, 0.001), _session(2, 30.0)])
    assert not any(_calibrated(v) for v in policy.views)


def test_the_cli_calibrates_the_own_policies_unless_told_not_to() -> None:
    argv = ["--workers", "6", "--sessions", "40", "--rate", "2", "--policies", "ownerserve"]
    on = main_rows(argv)[0]
    off = main_rows([*argv, "--calibration", "off"])[0]
    assert on["e2e_mean_s"] != off["e2e_mean_s"]
