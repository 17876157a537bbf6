"""How long one planning decision takes on a 64- and a 1,000-worker cluster, per policy and
request kind, and the ownerserve policy over its exact candidate subset against its full view.

    .venv/bin/python -m bench.planner.plan_latency [--workers 64,1000] [--iters 20000]
        [--json FILE] [--policies ownerserve,static-pd] [--scenarios session-turn,...]

The cluster: nodes of 8 workers (per node 2 prefill, 4 decode, 2 hybrid), random loads, the
h100-llama3-8b profile. Scenarios (each a fixed RequestView, rebuilt clusters are not timed):

- `new-long-prefix`: 16k-token first prompt, nothing cached anywhere (same loads).
- `session-turn`: 30k-token context owned by the session's decode owner (GPU) plus partial
  copies on 6 other workers (GPU/CPU), 300 new tokens.
- `shared-prefix-fork`: a forked branch of a prefix owned by another worker than its session
  owner: every decode-capable worker has an artifact-fetch and a state-migration candidate (the
  largest candidate set the ownerserve policy has).

Each policy plans the same request `--iters` times; the median and p99 of per-call wall time are
reported, with the ratio of each baseline's median to ownerserve's in the same run. The row
`reference-enumeration` is the naive way to the same decision (every candidate of
`planner.cost.enumerate_routes` costed by `evaluate`, then the minimum; `--ref-iters` calls):
what the O(P + D) search saves.

The row `ownerserve-subset` is `planner.candidates.ExactSubsetPolicy` (what the simulator and
the router plan clusters above 64 workers with): each call first syncs its load order to the
cluster's views, then plans over the exact candidate subset. It is timed alternating with the
full view (`ownerserve`) call by call, over views that change between calls as a router's do
(4 workers' loads move per call, the views of the others are the same objects), and every
call's choice is asserted equal to the full view's. At 1,000 workers only ownerserve and its
subset run by default (the other policies' timings scale with the worker count).

`--sim-workers 1000` also times both inside a simulator run (`loadgen.sim`, agentic sessions,
a 1:1:1 cluster, calibration on): every request is planned by the subset and by the full
view, alternating which goes first, over the simulator's own views (most workers idle or
lightly loaded, holders of shared prefixes everywhere), each choice asserted equal.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from ownerserve.types import Role, Tier
from planner.candidates import ExactSubsetPolicy
from planner.classify import classify
from planner.cost import CostModel, enumerate_routes, evaluate
from planner.policies import POLICY_NAMES, OwnerServePolicy, get_policy
from planner.types import ClusterView, Plan, RequestClass, RequestView, WorkerView

BLOCK = 16


def make_cluster(n_workers: int, seed: int = 7, cached: bool = True) -> ClusterView:
    rng = random.Random(seed)
    roles = (Role.PREFILL, Role.PREFILL, Role.DECODE, Role.DECODE, Role.DECODE, Role.DECODE,
             Role.HYBRID, Role.HYBRID)  # fmt: skip
    workers = []
    for i in range(n_workers):
        role = roles[i % len(roles)]
        held: dict[Tier, int] = {}
        if i == 2:  # the session owner (a decode worker)
            held = {Tier.GPU: 1875}
        elif i in (6, 10, 19, 27, 38, 51):
            held = {Tier.GPU: rng.randint(100, 1500), Tier.CPU: rng.randint(1500, 1875)}
        workers.append(
            WorkerView(
                worker_id=f"w{i}",
                role=role,
                running=0 if role is Role.PREFILL else rng.randint(4, 120),
                waiting=rng.randint(0, 3),
                inflight_prefill_tokens=rng.randint(0, 30000) if role is not Role.DECODE else 0,
                kv_usage=rng.random() * 0.8,
                cached_blocks=held if cached else {},
                node=f"node{i // 8}",
                prefill_scale=rng.uniform(0.9, 1.2),
                decode_scale=rng.uniform(0.9, 1.2),
            )
        )
    return ClusterView(workers=tuple(workers))


SESSION_TURN = RequestView(
    model="m",
    prompt_tokens=30300,
    block_size=BLOCK,
    chain_blocks=1893,
    session_id="s1",
    session_owner="w2",
    owner="w2",
    owner_blocks=1875,
    previous_prompt_tokens=30000,
    idle_s=4.0,
)
SCENARIOS: dict[str, RequestView] = {
    "new-long-prefix": RequestView(
        model="m", prompt_tokens=16384, block_size=BLOCK, chain_blocks=1024, session_id="s-new"
    ),
    "session-turn": SESSION_TURN,
    # the same context forked into a branch whose session owner is another worker
    "shared-prefix-fork": replace(
        SESSION_TURN, session_id="s1-b3", session_owner="w10", idle_s=0.0, is_fork=True
    ),
}


def time_policy(name: str, model: CostModel, req: RequestView, cluster: ClusterView, iters: int
                ) -> tuple[float, float]:  # fmt: skip
    policy = get_policy(name, model.config, model)
    for _ in range(min(1000, iters)):
        policy.plan(req, cluster)
    samples = []
    clock = time.perf_counter_ns
    for _ in range(iters):
        t0 = clock()
        policy.plan(req, cluster)
        samples.append(clock() - t0)
    samples.sort()
    return statistics.median(samples) / 1e3, samples[int(0.99 * (len(samples) - 1))] / 1e3


def moving_views(cluster: ClusterView, n: int, seed: int = 11) -> list[ClusterView]:
    """n cluster views, each the one before with 4 workers' loads moved (new view objects
    for those, the same objects for the others), as a router's views change between
    requests; a palindrome, so cycling through them moves 4 workers a step throughout."""
    rng = random.Random(seed)
    views = [cluster]
    ws = list(cluster.workers)
    for _ in range(n // 2):
        for i in rng.sample(range(len(ws)), 4):
            w = ws[i]
            ws[i] = replace(
                w,
                running=max(0, w.running + rng.randint(-2, 2)) if w.role is not Role.PREFILL else 0,
                inflight_prefill_tokens=(
                    max(0, w.inflight_prefill_tokens + rng.randint(-3000, 3000))
                    if w.role is not Role.DECODE
                    else 0
                ),
            )
        views.append(ClusterView(workers=tuple(ws)))
    return views + views[-2:0:-1]


def same_choice(a: Plan, b: Plan) -> bool:
    x, y = a.chosen, b.chosen
    return (x.action, x.prefill_worker, x.decode_worker, x.source_worker, x.cost.total) == (
        y.action,
        y.prefill_worker,
        y.decode_worker,
        y.source_worker,
        y.cost.total,
    )


def time_subset(model: CostModel, req: RequestView, cluster: ClusterView, iters: int
                ) -> tuple[float, float, float, float, int]:  # fmt: skip
    """Median and p99 µs of the subset and of the full view, alternating call by call over
    moving views (`moving_views`), each subset choice asserted equal to the full view's;
    and the subset's median candidates."""
    full = OwnerServePolicy(model=model)
    subset = ExactSubsetPolicy(OwnerServePolicy(model=model), full_view_max=0)
    views = moving_views(cluster, 64)
    clock = time.perf_counter_ns
    t_sub: list[int] = []
    t_full: list[int] = []
    cands: list[int] = []
    for i in range(iters + 8):
        view = views[i % len(views)]
        t0 = clock()
        a = subset.plan(req, view)
        t1 = clock()
        b = full.plan(req, view)
        t2 = clock()
        if not same_choice(a, b):
            raise AssertionError(f"subset chose {a.chosen}, the full view {b.chosen}")
        if i >= 8:  # the first calls build the load order
            t_sub.append(t1 - t0)
            t_full.append(t2 - t1)
            cands.append(a.candidates_considered)
    t_sub.sort()
    t_full.sort()
    p99 = int(0.99 * (len(t_sub) - 1))
    return (
        statistics.median(t_sub) / 1e3,
        t_sub[p99] / 1e3,
        statistics.median(t_full) / 1e3,
        t_full[p99] / 1e3,
        int(statistics.median(cands)),
    )


class _Shadow:
    """A simulator policy planning each request both ways (subset, full view), timed,
    alternating which goes first; their choices asserted equal."""

    name = "ownerserve"

    def __init__(self, model: CostModel) -> None:
        self.full = OwnerServePolicy(model=model)
        self.subset = ExactSubsetPolicy(OwnerServePolicy(model=model), full_view_max=0)
        self.t_sub: list[int] = []
        self.t_full: list[int] = []
        self.cands: list[int] = []

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        clock = time.perf_counter_ns
        first = len(self.t_sub) % 2 == 0
        if first:
            t0 = clock()
            a = self.subset.plan(request, cluster)
            t1 = clock()
        t2 = clock()
        b = self.full.plan(request, cluster)
        t3 = clock()
        if not first:
            t0 = clock()
            a = self.subset.plan(request, cluster)
            t1 = clock()
        if not same_choice(a, b):
            raise AssertionError(f"subset chose {a.chosen}, the full view {b.chosen}")
        self.t_sub.append(t1 - t0)
        self.t_full.append(t3 - t2)
        self.cands.append(a.candidates_considered)
        return b


def time_in_sim(workers: int, sessions: int, seed: int = 0) -> dict[str, Any]:
    """`_Shadow` over a simulator run: medians and p99s of both, and the requests planned."""
    from loadgen.sim.engine import ClusterSpec, Simulator
    from loadgen.sim.workload import agentic_sessions
    from ownerserve.profiles import load_profile
    from planner.calibration import Calibrator

    shadow = _Shadow(CostModel())
    spec = ClusterSpec.of_size(workers)
    sim = Simulator(spec, load_profile("h100-llama3-8b"), shadow, calibrator=Calibrator())
    sim.run(agentic_sessions(sessions, 5.0, seed=seed))
    out: dict[str, Any] = {"workers": workers, "sessions": sessions, "plans": len(shadow.t_sub)}
    for key, ts in (("subset", shadow.t_sub), ("full_view", shadow.t_full)):
        ts = sorted(ts)
        out[f"{key}_median_us"] = round(statistics.median(ts) / 1e3, 1)
        out[f"{key}_p99_us"] = round(ts[int(0.99 * (len(ts) - 1))] / 1e3, 1)
    out["subset_candidates_median"] = int(statistics.median(shadow.cands))
    return out


def time_reference(model: CostModel, req: RequestView, cluster: ClusterView, iters: int
                   ) -> tuple[float, float, int]:  # fmt: skip
    """The naive decision: cost every candidate with `evaluate`, take the minimum."""
    cont = classify(req, model.config) is RequestClass.DECODE_CONTINUATION
    samples = []
    n = 0
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        routes = enumerate_routes(req, cluster, continuation=cont)
        min(evaluate(model, req, r).total for r in routes)
        samples.append(time.perf_counter_ns() - t0)
        n = len(routes)
    samples.sort()
    return statistics.median(samples) / 1e3, samples[int(0.99 * (len(samples) - 1))] / 1e3, n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--workers", default="64,1000", help="comma list of cluster sizes (multiples of 8)"
    )
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument(
        "--big-iters",
        type=int,
        default=300,
        help="calls per cell above 64 workers (the full view takes ms there)",
    )
    ap.add_argument("--ref-iters", type=int, default=30, help="calls of the naive reference")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument(
        "--policies",
        default=",".join(POLICY_NAMES),
        help="comma list (ownerserve first: the ratios are to it); above 64 workers only "
        "ownerserve and its subset unless --all-policies",
    )
    ap.add_argument("--all-policies", action="store_true", help="every policy at every size")
    ap.add_argument(
        "--sim-workers", type=int, default=0, help="also time both inside a simulator run"
    )
    ap.add_argument("--sim-sessions", type=int, default=150, help="its agentic sessions")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma list")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.workers.split(",") if x]
    if not sizes or min(sizes) < 8 or args.iters < 1:
        ap.error("--workers must be >= 8 (one node of every role) and --iters >= 1")
    policies = [p for p in args.policies.split(",") if p]
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = [p for p in policies if p not in POLICY_NAMES] + [
        s for s in scenarios if s not in SCENARIOS
    ]
    if unknown:
        ap.error(f"unknown policies or scenarios: {', '.join(unknown)}")
    model = CostModel()
    rows: list[dict[str, Any]] = []
    for n in sizes:
        big = n > 64
        iters = args.big_iters if big else args.iters
        for scen in scenarios:
            req = SCENARIOS[scen]
            cluster = make_cluster(n, cached=scen != "new-long-prefix")
            base = None
            names = policies if args.all_policies or not big else ["ownerserve"]
            for name in names:
                med, p99 = time_policy(name, model, req, cluster, iters)
                if name == "ownerserve":
                    base = med
                plan = get_policy(name, model.config, model).plan(req, cluster)
                rows.append(
                    {
                        "workers": n,
                        "scenario": scen,
                        "policy": name,
                        "median_us": round(med, 2),
                        "p99_us": round(p99, 2),
                        "ratio_to_ownerserve": round(med / base, 2) if base else None,
                        "action": plan.action.value,
                        "candidates": plan.candidates_considered,
                    }
                )
            med, p99, med_full, p99_full, cands = time_subset(model, req, cluster, iters)
            rows.append(
                {
                    "workers": n,
                    "scenario": scen,
                    "policy": "ownerserve-subset",
                    "median_us": round(med, 2),
                    "p99_us": round(p99, 2),
                    # to the full view timed alternating with it (same views, same calls)
                    "ratio_to_ownerserve": round(med / med_full, 2),
                    "full_view_median_us": round(med_full, 2),
                    "full_view_p99_us": round(p99_full, 2),
                    "action": "same as full view",
                    "candidates": cands,
                }
            )
            if args.ref_iters > 0 and base and not big:
                med, p99, nr = time_reference(model, req, cluster, args.ref_iters)
                rows.append(
                    {
                        "workers": n,
                        "scenario": scen,
                        "policy": "reference-enumeration",
                        "median_us": round(med, 2),
                        "p99_us": round(p99, 2),
                        "ratio_to_ownerserve": round(med / base, 2),
                        "action": "-",
                        "candidates": nr,
                    }
                )
    print(f"# plan latency, {args.workers} workers, {args.iters} ({args.big_iters} above 64) calls")
    print(f"# {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, Python {platform.python_version()}")
    print(
        f"{'workers':>7}  {'scenario':<20}{'policy':<22}{'median µs':>10}{'p99 µs':>9}{'×os':>7}"
        "  action"
    )
    for r in rows:
        ratio = "-" if r["ratio_to_ownerserve"] is None else f"{r['ratio_to_ownerserve']:.2f}"
        print(
            f"{r['workers']:>7}  {r['scenario']:<20}{r['policy']:<22}{r['median_us']:>10.1f}"
            f"{r['p99_us']:>9.1f}{ratio:>7}  {r['action']} ({r['candidates']} candidates)"
        )
    sim = None
    if args.sim_workers:
        sim = time_in_sim(args.sim_workers, args.sim_sessions)
        print(
            f"# in the simulator, {sim['workers']} workers, {sim['plans']} plans: subset median "
            f"{sim['subset_median_us']} µs (p99 {sim['subset_p99_us']}), full view "
            f"{sim['full_view_median_us']} µs (p99 {sim['full_view_p99_us']}), "
            f"{sim['full_view_median_us'] / sim['subset_median_us']:.1f}× faster, "
            f"{sim['subset_candidates_median']} candidates (median), same choices"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "sim": sim}, f, indent=1)
    for n in sizes:
        own = [
            r["median_us"]
            for r in rows
            if r["workers"] == n
            and r["policy"] == ("ownerserve-subset" if n > 64 else "ownerserve")
        ]
        target = 100 if n > 64 else 50
        if own:
            print(
                f"# {n} workers: ownerserve worst median {max(own):.1f} µs (target ≤ {target} µs)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
