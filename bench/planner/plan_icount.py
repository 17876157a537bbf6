"""Machine instructions per planning decision, per source tree: a noise-free A/B where wall
time on the shared VM moves by ±30% (it tracks time closely for this pure-Python code, but
not exactly: it counts no cache misses).

    .venv/bin/python -m bench.planner.plan_icount --tree /tmp/base --tree . [--workers 8,1000]
        [--scenarios session-turn,...] [--policy ownerserve] [--plans 20]

For each tree, worker count and scenario of `bench.planner.plan_latency` (this file's copy,
loaded by path, so every tree plans the same inputs), a child process under Valgrind's
callgrind plans `--plans` times inside `itertools.starmap` after a warm-up, and only the
instructions executed inside `starmap_next` are counted (`--toggle-collect`): the plans,
without the interpreter's start, the imports or the warm-up. Needs `valgrind` on PATH; takes
~15 s of CPU a cell.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

_CHILD = """
import importlib.util, itertools, sys
spec = importlib.util.spec_from_file_location("plan_latency", sys.argv[1])
pl = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pl)
from planner.cost import CostModel
from planner.policies import get_policy
model = CostModel()
policy = get_policy(sys.argv[2], model.config, model)
workers, scen, plans = int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
req = pl.SCENARIOS[scen]
cluster = pl.make_cluster(workers, cached=scen != "new-long-prefix")
for _ in range(30):
    policy.plan(req, cluster)
list(itertools.starmap(lambda: policy.plan(req, cluster), [()] * plans))
"""


def count(tree: Path, policy: str, workers: int, scen: str, plans: int) -> int:
    """Instructions of `plans` plans in `tree` (callgrind's total inside `starmap_next`)."""
    here = Path(__file__).resolve().parent / "plan_latency.py"
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--toggle-collect=starmap_next",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        "-c",
        _CHILD,
        str(here),
        policy,
        str(workers),
        scen,
        str(plans),
    ]
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True)
    m = re.search(r"refs:\s*([\d,]+)", out.stderr)
    if m is None:
        raise RuntimeError(f"no instruction count in valgrind's output:\n{out.stderr[-2000:]}")
    return int(m.group(1).replace(",", ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, action="append", required=True, help="repeatable")
    ap.add_argument("--workers", default="8,1000", help="comma list, each >= 8")
    ap.add_argument("--scenarios", default="new-long-prefix,session-turn,shared-prefix-fork")
    ap.add_argument("--policy", default="ownerserve")
    ap.add_argument("--plans", type=int, default=20)
    args = ap.parse_args(argv)
    trees = [t.resolve() for t in args.tree]
    print(f"# instructions per plan ({args.policy}); ratios to the first tree, {trees[0]}")
    for workers in (int(x) for x in args.workers.split(",")):
        for scen in args.scenarios.split(","):
            per = [count(t, args.policy, workers, scen, args.plans) / args.plans for t in trees]
            cells = "  ".join(f"{p:>12,.0f} ({p / per[0]:.3f})" for p in per)
            print(f"{workers:>6} {scen:<20} {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
