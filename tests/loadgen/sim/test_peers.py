"""The peer routers' models in the simulator: they see every worker, get their own deployment
shape, and a refused request is counted apart."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest

from loadgen.sim.cli import main_rows, peer_spec
from loadgen.sim.engine import ClusterSpec, Simulator
from loadgen.sim.workload import agentic_sessions
from ownerserve.profiles import load_profile
from planner.policies import PEER_POLICY_NAMES, get_policy
from planner.policies.peers import RequestRejectedError
from planner.types import ClusterView, Plan, Policy, RequestView

PROFILE = load_profile("h100-llama3-8b")


@dataclass
class Recording:
    """Wraps a policy; records how many workers and which chains each request showed it."""

    inner: Policy
    name: str = "recording"
    seen: list[int] = field(default_factory=list)
    chains: list[tuple[int, ...]] = field(default_factory=list)

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        self.seen.append(len(cluster.workers))
        self.chains.append(request.chain)
        return self.inner.plan(request, cluster)


def test_every_policy_sees_every_worker_above_the_subset_threshold() -> None:
    sessions = agentic_sessions(20, 1.0, seed=3)
    spec = ClusterSpec.of_size(90)
    own = Recording(get_policy("least-loaded"))
    Simulator(spec, PROFILE, own).run(sessions)
    assert set(own.seen) == {90}
    full = Recording(get_policy("dynamo-kv"))
    Simulator(spec, PROFILE, full, full_view=True).run(sessions)
    assert set(full.seen) == {90}
    # the request carries its prompt's chain, as the router's does
    turns = [t.chain for s in sessions for t in s.turns]
    assert sorted(full.chains) == sorted(turns)


class RejectOdd:
    name = "reject-odd"

    def __init__(self) -> None:
        self.inner = get_policy("least-loaded")
        self.calls = 0

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        self.calls += 1
        if self.calls % 2:
            raise RequestRejectedError("no")
        return self.inner.plan(request, cluster)


def test_a_rejected_request_is_counted_and_ends_its_session() -> None:
    sessions = agentic_sessions(30, 0.5, seed=4)
    res = Simulator(ClusterSpec.of_size(6), PROFILE, RejectOdd()).run(sessions)
    assert res.rejected > 0
    assert res.requests + res.rejected < sum(len(s.turns) for s in sessions)
    # only sessions that were never refused finish (and count in E2E)
    assert len(res.session_e2e_s) == len(sessions) - res.rejected
    assert res.summary()["rejected"] == res.rejected


def test_peers_run_in_their_own_deployment_shape() -> None:
    spec = ClusterSpec.of_size(64)
    agg, pd = peer_spec(spec, "dynamo-kv"), peer_spec(spec, "dynamo-kv-disagg")
    assert (agg.prefill, agg.decode, agg.hybrid) == (0, 0, 64)
    assert (pd.prefill, pd.decode, pd.hybrid) == (32, 32, 0)


def test_every_peer_runs_in_the_cli() -> None:
    argv = ["--workers", "8", "--sessions", "30", "--policies", ",".join(PEER_POLICY_NAMES)]
    rows = main_rows(argv)
    assert [r["policy"] for r in rows] == list(PEER_POLICY_NAMES)
    for r in rows:
        assert r["requests"] > 30 and r["e2e_mean_s"] > 0
    by = {r["policy"]: r for r in rows}
    assert by["sglang-cache-aware"]["network_kv_gb"] == 0.0  # aggregated: no KV moves
    assert by["sglang-cache-aware-pd"]["pd_kv_gb"] > 0.0
    # load-blind power-of-two recomputes more prompt than the prefix-aware peers
    assert by["vllm-power-of-two"]["prefill_tokens"] > by["dynamo-kv"]["prefill_tokens"]


class Snapshots:
    """Wraps a policy; keeps every view it was shown."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.name = inner.name
        self.views: list[ClusterView] = []

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        self.views.append(cluster)
        return self.inner.plan(request, cluster)


@pytest.mark.parametrize(
    ("policy", "scrape_s"),
    [("dynamo-kv-disagg", 0.0), ("llm-d", 2.0), ("mooncake-conductor", 0.0)],
)
def test_kept_full_views_equal_views_built_afresh(policy: str, scrape_s: float) -> None:
    """The full view, rebuilt only where a worker changed, is the view the simulator builds
    from scratch for every worker on every request (a cluster under `full_view_max`)."""
    sessions = agentic_sessions(60, 2.0, seed=5)
    spec = replace(ClusterSpec.of_size(24), load_scrape_s=scrape_s)
    fresh = Snapshots(get_policy(policy))
    a = Simulator(spec, PROFILE, fresh).run(sessions)
    kept = Snapshots(get_policy(policy))
    b = Simulator(replace(spec, full_view_max=0), PROFILE, kept, full_view=True).run(sessions)
    assert fresh.views == kept.views
    assert a.summary() | {"wall_s": 0, "events_per_s": 0} == b.summary() | {
        "wall_s": 0,
        "events_per_s": 0,
    }
