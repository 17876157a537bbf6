"""The load-vs-recompute crossover per timing profile and KV data path (`planner.crossover`): the
prompt length in tokens above which loading a prefix's KV beats recomputing it, for the dense
K of each profile and the sealed bytes per token of each shipped KV spec (`configs/models/`).

Each profile's three transports at their configured prices (`kv_transports:` or the link
defaults); `--measurements FILE` adds rows at a probe's measured prices
(`python -m workers.mooncake_store.probe --own-master --out FILE`), `--path LABEL:GBPS:LAT_US`
rows at a rate measured elsewhere (e.g. a bench's GPU<->store load). Two tables: recompute as
prefill_s(n, 0), and `marginal` (its base_s left out: the rest of the prompt is computed anyway).

    .venv/bin/python -m bench.planner.crossover [--measurements FILE] [--profiles a,b]
        [--path LABEL:GBPS:LAT_US ...]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from ownerserve.kvprobe import load_measurements
from ownerserve.kvstate import list_specs, load_spec
from ownerserve.profiles import PROFILES_DIR, TransportTiming, load_profile
from ownerserve.types import KVTransport
from planner.crossover import crossover_tokens


def _fmt(n: int | None) -> str:
    return "never" if n is None else f"{n:,}"


def rows(
    profiles: Sequence[str],
    measured: dict[KVTransport, TransportTiming],
    extra: Sequence[tuple[str, TransportTiming]] = (),
    *,
    marginal: bool = False,
) -> list[list[str]]:
    """One row per (profile, path, priced as): the crossover for the profile's own K and for
    each spec's sealed rate."""
    specs = [load_spec(s) for s in list_specs()]
    out = []
    for name in profiles:
        prof = load_profile(name)
        prices = [(t.value, prof.link.path(t), "configured") for t in KVTransport]
        prices += [(t.value, timing, "measured (probe)") for t, timing in measured.items()]
        prices += [(label, timing, "given") for label, timing in extra]
        for label, timing, source in prices:
            cells = [
                name,
                label,
                source,
                f"{timing.bps / 1e9:.3g}",
                f"{timing.latency_s * 1e6:.4g}",
                _fmt(crossover_tokens(prof, timing, prof.kv_bytes_per_token, marginal=marginal)),
            ]
            cells += [
                _fmt(crossover_tokens(prof, timing, s.bytes_per_token(), marginal=marginal))
                for s in specs
            ]
            out.append(cells)
    return out


def _path(text: str) -> tuple[str, TransportTiming]:
    label, gbps, lat_us = text.split(":")
    return label, TransportTiming(float(gbps) * 1e9, float(lat_us) * 1e-6)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--measurements", type=Path, help="a probe's measurements file")
    p.add_argument(
        "--profiles",
        default=",".join(sorted(f.stem for f in PROFILES_DIR.glob("*.yaml"))),
        help="profiles, comma-separated (default: every one in configs/profiles/)",
    )
    p.add_argument(
        "--path",
        type=_path,
        action="append",
        default=[],
        help="LABEL:GBPS:LAT_US, a path priced as given (repeatable)",
    )
    a = p.parse_args(argv)
    measured = {} if a.measurements is None else load_measurements(a.measurements)
    specs = list_specs()
    head = ["profile", "path", "price", "GB/s", "latency µs", "profile's K"]
    head += [f"{s} ({load_spec(s).bytes_per_token():,.0f} B/tok)" for s in specs]
    for marginal in (False, True):
        print("recompute_s(n) = prefill_s(n, 0)" + (" − base_s (marginal)" if marginal else ""))
        print()
        print("| " + " | ".join(head) + " |")
        print("|" + "|".join(["---"] * 3 + ["---:"] * (len(head) - 3)) + "|")
        for r in rows(a.profiles.split(","), measured, a.path, marginal=marginal):
            print("| " + " | ".join(r) + " |")
        print()


if __name__ == "__main__":
    main()
