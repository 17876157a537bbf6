"""The long fuzz run: `python -m bench.fuzz --cases 10000` sends that many cases
(`bench.fuzz.strategies.all_cases`: every route's bodies, one in four byte-level) to a router
in front of emulated workers, one at a time, then checks the router afterwards (a normal
request served, `/health` ok, no lease or worker request left), and prints a summary: cases
and statuses per route, 5xx answers, hangs, the slowest answer, every failed case. Exit code 1
when anything failed."""

from __future__ import annotations

import argparse
import sys
import time

from hypothesis import HealthCheck, Phase, given, seed, settings

from bench.fuzz.harness import BOUND_S, Fuzzer, FuzzTarget
from bench.fuzz.strategies import Case, all_cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__)
    parser.add_argument("--cases", type=int, default=10_000, help="how many cases (10000)")
    parser.add_argument("--seed", type=int, default=0, help="Hypothesis seed (0)")
    parser.add_argument(
        "--bound-s", type=float, default=BOUND_S, help=f"most seconds a case may take ({BOUND_S:g})"
    )
    parser.add_argument("--progress", type=int, default=500, help="print a line every N cases")
    parser.add_argument("--show", type=int, default=30, help="failed cases printed in full (30)")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    with FuzzTarget() as target:
        fuzzer = Fuzzer(target, bound_s=args.bound_s)
        done = 0

        @seed(args.seed)
        @settings(
            max_examples=args.cases,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(all_cases())
        def one(case: Case) -> None:
            nonlocal done
            outcome = fuzzer.run(case)
            done += 1
            if outcome.problems:
                print(f"FAILED case {done}: {outcome.report()}", flush=True)
            if args.progress and done % args.progress == 0:
                t = fuzzer.tally
                print(
                    f"{done} cases, {time.monotonic() - t0:.0f} s: {len(t.failures)} failed, "
                    f"{t.server_errors} 5xx, {t.hangs} hangs",
                    flush=True,
                )

        one()
        after = fuzzer.after_problems()
        after += fuzzer.wait(fuzzer.held)
        after += fuzzer.wait(fuzzer.workers_busy)
        fuzzer.close()
    tally = fuzzer.tally
    print()
    print(f"{sum(tally.cases.values())} cases in {time.monotonic() - t0:.0f} s (seed {args.seed})")
    print(tally.render())
    print("after the run: " + ("; ".join(after) if after else "router serves, /health ok, "
                               "no lease or worker request left"))  # fmt: skip
    for outcome in tally.failures[: args.show]:
        print("FAILED: " + outcome.report())
    return 1 if tally.failures or after else 0


if __name__ == "__main__":
    sys.exit(main())
