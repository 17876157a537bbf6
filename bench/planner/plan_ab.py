"""Plan latency of two source trees, A/B, interleaved in time (a noisy shared VM moves a plain
run by ±30%: alternating whole runs compares different minutes, alternating short batches in
two live processes compares the same ones).

    .venv/bin/python -m bench.planner.plan_ab --a /tmp/base --b . [--workers 8,1000]
        [--batches 30] [--batch-s 0.05] [--policy ownerserve] [--json FILE]

One child process per tree (`PYTHONPATH=tree`), each with its own copy of the clusters and
scenarios of `bench.planner.plan_latency` (this file's copy, loaded by path, so both trees
are timed on the same inputs). Per (workers, scenario), each round asks A then B (then B
then A the next round) for one batch of plans of about `--batch-s` seconds and takes the
batch's median µs per plan; the reported figure per tree is the median over rounds, and the
ratio B/A the median of the rounds' paired ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

_CHILD = """
import importlib.util, json, statistics, sys, time
spec = importlib.util.spec_from_file_location("plan_latency", sys.argv[1])
pl = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pl)
from planner.cost import CostModel
from planner.policies import get_policy
model = CostModel()
policy = get_policy(sys.argv[2], model.config, model)
clusters = {}
clock = time.perf_counter_ns
for line in sys.stdin:
    workers, scen, batch_s = line.split()
    workers, batch_s = int(workers), float(batch_s)
    key = (workers, scen)
    if key not in clusters:
        clusters[key] = pl.make_cluster(workers, cached=scen != "new-long-prefix")
        for _ in range(50):
            policy.plan(pl.SCENARIOS[scen], clusters[key])
    req, cluster = pl.SCENARIOS[scen], clusters[key]
    plan = policy.plan(req, cluster)
    samples = []
    end = clock() + batch_s * 1e9
    while clock() < end or len(samples) < 5:
        t0 = clock()
        policy.plan(req, cluster)
        samples.append(clock() - t0)
    print(json.dumps([statistics.median(samples) / 1e3, plan.action.value,
                      plan.chosen.decode_worker, plan.candidates_considered]), flush=True)
"""


def _child(tree: Path, policy: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    here = Path(__file__).resolve().parent / "plan_latency.py"
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(here), policy],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=tree,
        env=env,
    )


def _ask(proc: subprocess.Popen[str], workers: int, scen: str, batch_s: float) -> list[Any]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"{workers} {scen} {batch_s}\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the child of {proc.args!r} ended")
    out: list[Any] = json.loads(line)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", type=Path, required=True, help="tree A (before)")
    ap.add_argument("--b", type=Path, required=True, help="tree B (after)")
    ap.add_argument("--workers", default="8,1000", help="comma list, each >= 8")
    ap.add_argument("--scenarios", default="new-long-prefix,session-turn,shared-prefix-fork")
    ap.add_argument("--policy", default="ownerserve")
    ap.add_argument("--batches", type=int, default=30, help="rounds per cell")
    ap.add_argument("--batch-s", type=float, default=0.05)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.workers.split(",")]
    if min(sizes) < 8 or args.batches < 1:
        ap.error("--workers must be >= 8 and --batches >= 1")
    a, b = _child(args.a.resolve(), args.policy), _child(args.b.resolve(), args.policy)
    rows = []
    try:
        for workers in sizes:
            for scen in args.scenarios.split(","):
                ta: list[float] = []
                tb: list[float] = []
                same = True
                for r in range(args.batches):
                    order = (a, b) if r % 2 == 0 else (b, a)
                    got = {id(p): _ask(p, workers, scen, args.batch_s) for p in order}
                    ra, rb = got[id(a)], got[id(b)]
                    same = same and ra[1:] == rb[1:]
                    ta.append(ra[0])
                    tb.append(rb[0])
                ratios = sorted(y / x for x, y in zip(ta, tb, strict=True))
                row = {
                    "workers": workers,
                    "scenario": scen,
                    "a_us": round(statistics.median(ta), 2),
                    "b_us": round(statistics.median(tb), 2),
                    "ratio": round(statistics.median(ratios), 3),
                    "ratio_q1_q3": [
                        round(ratios[len(ratios) // 4], 3),
                        round(ratios[(3 * len(ratios)) // 4], 3),
                    ],
                    "same_plan": same,
                }
                rows.append(row)
                print(
                    f"{workers:>6} {scen:<20} A {row['a_us']:>9.1f} µs  B {row['b_us']:>9.1f} µs"
                    f"  B/A {row['ratio']:.3f} (IQR {row['ratio_q1_q3'][0]:.3f}–"
                    f"{row['ratio_q1_q3'][1]:.3f})  same plan: {same}",
                    flush=True,
                )
    finally:
        for p in (a, b):
            if p.stdin is not None:
                p.stdin.close()
            p.wait(timeout=30)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
