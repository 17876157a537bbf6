"""Samples the routers of a running `ownerserve bench chaos` (started with
`OWNERSERVE_SERVER__DEBUG_MEMORY=1` in its environment, so that each replica serves
`GET /admin/debug/memory`, and `OWNERSERVE_SERVER__DEBUG_MEMORY_FRAMES=N` to trace): every
`--every` seconds each replica's RSS, the allocators' heap (untraced) or the traced heap and its
top allocation sites gained since the first sample, tasks and sockets by peer, the directory's
stats (the local mirror's cached pairs and evictions), one JSON line each.

    .venv/bin/python -m bench.router_memory.live --log-dir /tmp/chaos/logs --out trace.jsonl

`--log-dir` is the chaos run's (it holds each replica's `router_<name>.yaml`: port, admin token).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import yaml


def _replicas(log_dir: Path) -> dict[str, tuple[str, str]]:
    """Replica name -> (base URL, admin token), from the chaos run's router configs."""
    out: dict[str, tuple[str, str]] = {}
    for path in sorted(log_dir.glob("router_*.yaml")):
        server = yaml.safe_load(path.read_text())["server"]
        out[path.stem.removeprefix("router_")] = (
            f"http://127.0.0.1:{server['port']}",
            server["admin_token"],
        )
    return out


def _kv_gauges(exposition: str) -> dict[str, float]:
    """The GPU blocks the router's directory shows cached: per worker, distinct and copies (the
    size of its mirror of the workers' caches)."""
    out: dict[str, float] = {}
    for line in exposition.splitlines():
        if 'tier="gpu"' not in line or not line.startswith("ownerserve_kv_block"):
            continue
        name, _, value = line.rpartition(" ")
        if name.startswith("ownerserve_kv_blocks{") and 'source="events"' in name:
            out[name.split('worker="')[1].split('"')[0]] = float(value)
        elif name.startswith(("ownerserve_kv_blocks_distinct", "ownerserve_kv_block_copies")):
            out[name.split("{")[0].removeprefix("ownerserve_kv_")] = float(value)
    return out


async def sample(log_dir: Path, every_s: float, duration_s: float, top: int, out: Path) -> None:
    while not (replicas := _replicas(log_dir)):
        await asyncio.sleep(1.0)
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=600.0) as client:
        with out.open("a") as f:
            while time.monotonic() - t0 < duration_s:
                for name, (url, token) in replicas.items():
                    row: dict[str, Any] = {"t_s": round(time.monotonic() - t0, 1), "replica": name}
                    try:
                        resp = await client.get(
                            url + "/admin/debug/memory",
                            params={"top": top},
                            headers={"authorization": f"Bearer {token}"},
                        )
                        row.update(resp.json())
                        metrics = await client.get(url + "/metrics")
                        row["kv_gpu_blocks"] = _kv_gauges(metrics.text)
                    except (httpx.HTTPError, ValueError) as exc:
                        row["error"] = repr(exc)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    print(
                        name,
                        row["t_s"],
                        row.get("rss_mb"),
                        row.get("traced_mb"),
                        row.get("traced_gained_mb"),
                        row.get("tasks_total"),
                        row.get("directory", {}).get("mirror_cached_pairs"),
                        flush=True,
                    )
                await asyncio.sleep(every_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log-dir", type=Path, required=True)
    ap.add_argument("--every", type=float, default=60.0, help="seconds between samples")
    ap.add_argument("--duration", type=float, default=1800.0)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", type=Path, default=Path("router_memory_live.jsonl"))
    args = ap.parse_args()
    asyncio.run(sample(args.log_dir, args.every, args.duration, args.top, args.out))


if __name__ == "__main__":
    main()
