"""Where a live router's memory grows under the chaos bench's load: one router (the chaos
topology's settings: emulated P/D and hybrid workers, a real redis-server directory) served
in this process, the chaos load (`loadgen.chaos.load`, many agent sessions, no tool gaps)
against it, and at each interval a tracemalloc snapshot diffed against the one taken after
warm-up (top lines by bytes gained) and `gc.get_objects()` counted by type (top types by
objects gained), written as markdown.

    .venv/bin/python -m bench.router_memory.growth [--minutes 4] [--sessions 12] [--every 60]

No faults: what grows with sessions and requests alone (the chaos run adds the faults).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import tempfile
import time
import tracemalloc
from collections import Counter
from pathlib import Path

from loadgen.chaos.load import ChaosLoad, LoadOptions
from loadgen.chaos.topology import RouterTimeouts, Topology
from loadgen.cluster import MODEL, ClusterSpec
from ownerserve.config import settings_from_dict
from router.app import create_app
from router.server import running_app


def type_counts() -> Counter[str]:
    return Counter(type(o).__qualname__ for o in gc.get_objects())


def report_step(
    label: str, base: tracemalloc.Snapshot, base_types: Counter[str], top: int
) -> list[str]:
    gc.collect()
    snap = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__)]
    )
    diff = snap.compare_to(base, "lineno")
    gained = sum(d.size_diff for d in diff)
    lines = [f"### {label}: traced heap {gained / 2**20:+.2f} MiB since warm-up", ""]
    lines += ["| bytes gained | blocks gained | allocated at |", "| ---: | ---: | --- |"]
    for d in diff[:top]:
        f = d.traceback[0]
        lines.append(
            f"| {d.size_diff / 2**10:+.0f} KiB | {d.count_diff:+d} | "
            f"{f.filename.split('/work/main/')[-1]}:{f.lineno} |"
        )
    types = type_counts()
    grew = sorted(((types[t] - base_types.get(t, 0), t) for t in types), reverse=True)[:top]
    lines += ["", "| objects gained | type |", "| ---: | --- |"]
    lines += [f"| {n:+d} | {t} |" for n, t in grew]
    return [*lines, ""]


async def run(minutes: float, sessions: int, every_s: float, top: int, out: Path) -> None:
    log_dir = Path(tempfile.mkdtemp(prefix="router-memory-"))
    spec = ClusterSpec(1, 1, 4, speed=4.0, model=MODEL, extra_args=("--kv-lease-duration", "10"))
    topo = Topology(spec, log_dir, lease_s=10.0, timeouts=RouterTimeouts(), replicas=1)
    topo.redis.start()
    topo.cluster.start()
    try:
        data = topo.router_config(0)
        app = create_app(settings_from_dict(data))
        async with running_app(app, "127.0.0.1", 0) as url:
            opts = LoadOptions(
                targets=(url,),
                sessions=sessions,
                duration_s=minutes * 60,
                seed=1,
                model=MODEL,
                time_scale=0.0,
            )
            load = ChaosLoad(opts)
            task = asyncio.create_task(load.run())
            tracemalloc.start(1)
            await asyncio.sleep(min(every_s, 30.0))  # warm-up: pools, caches of a few sessions
            gc.collect()
            base = tracemalloc.take_snapshot()
            base_types = type_counts()
            t0 = time.monotonic()
            text = [f"# router memory growth: {sessions} sessions for {minutes:g} min", ""]
            while not task.done():
                done = await asyncio.wait({task}, timeout=every_s)
                n = len(load.sessions)
                ok = sum(1 for a in load.attempts if a.ok)
                label = f"{time.monotonic() - t0:.0f} s: {n} sessions, {ok} requests ok"
                text += report_step(label, base, base_types, top)
                out.write_text("\n".join(text))
                print(label, flush=True)
                if done[0]:
                    break
            await task
    finally:
        topo.cluster.stop()
        topo.redis.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--sessions", type=int, default=12, help="concurrent sessions")
    ap.add_argument("--every", type=float, default=60.0, help="seconds between snapshots")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", type=Path, default=Path("router_memory_growth.md"))
    args = ap.parse_args()
    asyncio.run(run(args.minutes, args.sessions, args.every, args.top, args.out))


if __name__ == "__main__":
    main()
