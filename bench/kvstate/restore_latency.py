"""Per-call cost of the KV state model and the restore planner, side by side in one run.

Usage: .venv/bin/python -m bench.kvstate.restore_latency [--number N]

For each shipped spec: `spec.state_bytes`, `plan_restore` without the mix search
(overlap=False) and with it (the default), against the cheapest possible restore estimate
(`LinkTiming.transfer_s` of the prefix's bytes) as the unit.
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable
from functools import partial

from ownerserve.kvstate import list_specs, load_spec
from ownerserve.profiles import load_profile
from ownerserve.types import KVTransport, Tier
from planner.restore import SwaPolicy, plan_restore


def _us(fn: Callable[[], object], number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--number", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=128_100)
    args = ap.parse_args()
    prof = load_profile("h100-llama3-8b")
    n = args.tokens
    pol = SwaPolicy.periodic(4096)
    print(f"cached_tokens={n}, tier=ssd, profile={prof.name}, swa=periodic(4096)")
    head = f"{'spec':<14} {'transfer_s':>10} {'state_bytes':>12} {'plan(no mix)':>13}"
    print(f"{head} {'plan':>9}  ratios")
    for name in list_specs():
        spec = load_spec(name)
        nbytes = spec.total_bytes(n)
        base = _us(partial(prof.link.transfer_s, nbytes, KVTransport.SAME_HOST), args.number)
        sizes = _us(partial(spec.state_bytes, 0, n), args.number)
        plan = partial(plan_restore, spec, n, Tier.SSD, prof, swa_policy=pol)
        nomix = _us(partial(plan, overlap=False), args.number)
        full = _us(plan, args.number)
        print(
            f"{name:<14} {base:>8.2f}us {sizes:>10.2f}us {nomix:>11.1f}us {full:>7.1f}us"
            f"  {sizes / base:.0f}x {nomix / base:.0f}x {full / base:.0f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
