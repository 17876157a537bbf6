"""How many concurrent streaming requests one emulated engine sustains, and its CPU per request.

Starts one emulated engine as its own process (`python -m workers.emulator`), then drives it from
this process with C concurrent keep-alive connections, each sending streaming chat completions
back to back (closed loop) for a fixed time. A minimal raw-socket HTTP/1.1 client keeps the load
generator's own CPU low. Every response is checked: status 200, SSE chunks, a usage chunk whose
completion_tokens equals max_tokens, and the final `[DONE]`; anything else is an error.

Reports per run: requests, errors, throughput, TTFT percentiles, time per output token (client
and engine view), the engine's CPU seconds (utime+stime from /proc) per request and per output
token, and timing fidelity: modelled step time over the wall time the steps took (1.0 = the
emulator kept the modelled pace; with `--profile fast-test` the model is ~free and the run
measures the engine's own CPU cost).

    .venv/bin/python -m bench.emulator.concurrency --concurrency 100 500 --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from loadgen.cluster import ManagedProcess, wait_healthy
from ownerserve.ports import free_port
from ownerserve.profiles import load_profile

HZ = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / HZ


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class Stats:
    ok: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    tokens: int = 0

    def error(self, why: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(why)


def request_bytes(port: int, body: bytes) -> bytes:
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def one_stream(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, req: bytes, max_tokens: int
) -> tuple[float, float, int]:
    """Send one request on a kept-alive connection; returns (ttft, mean time per token, tokens)."""
    t0 = time.perf_counter()
    writer.write(req)
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"status {status!r}")
    chunked = False
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        if line.lower().startswith(b"transfer-encoding: chunked"):
            chunked = True
    if not chunked:
        raise RuntimeError("response not chunked")
    first = 0.0
    last = 0.0
    content_chunks = 0
    body_tail = b""
    while True:
        size_line = await reader.readline()
        size = int(size_line.strip(), 16)
        if size == 0:
            await reader.readexactly(2)
            break
        chunk = await reader.readexactly(size + 2)
        if b'"delta":{"content"' in chunk:
            now = time.perf_counter()
            if not first:
                first = now
            last = now
            content_chunks += 1
        body_tail = chunk[-400:]
    if not body_tail.rstrip().endswith(b"data: [DONE]"):
        raise RuntimeError("stream did not end with [DONE]")
    at = body_tail.find(b'"completion_tokens":')
    if at < 0:
        raise RuntimeError("no usage chunk")
    digits = body_tail[at + 20 :].split(b",", 1)[0]
    tokens = int(digits)
    if tokens != max_tokens:
        raise RuntimeError(f"completion_tokens {tokens} != {max_tokens}")
    ttft = first - t0
    tpot = (last - first) / (tokens - 1) if tokens > 1 and first else 0.0
    return ttft, tpot, tokens


async def client_loop(
    idx: int, port: int, stop_at: float, stats: Stats, prompt_words: int, max_tokens: int
) -> None:
    system = "You are a coding agent working in a large repository. " * 8
    n = 0
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.perf_counter() < stop_at:
            words = " ".join(f"w{(idx * 7 + k) % 97}" for k in range(prompt_words))
            user = f"task {idx}-{n}: {words}"
            body = orjson.dumps(
                {
                    "model": "ownerserve-tiny",
                    "messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": user}],
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            )  # fmt: skip
            try:
                ttft, tpot, tokens = await one_stream(
                    reader, writer, request_bytes(port, body), max_tokens
                )
            except (RuntimeError, ValueError, OSError, asyncio.IncompleteReadError) as exc:
                stats.error(repr(exc))
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            else:
                stats.ok += 1
                stats.tokens += tokens
                stats.ttft.append(ttft)
                stats.tpot.append(tpot)
            n += 1
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def scrape(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def run_load(
    port: int,
    concurrency: int,
    seconds: float,
    prompt_words: int,
    max_tokens: int,
    first_client: int = 0,
) -> tuple[Stats, float]:
    stats = Stats()
    t0 = time.perf_counter()
    stop_at = t0 + seconds
    await asyncio.gather(
        *(
            client_loop(first_client + i, port, stop_at, stats, prompt_words, max_tokens)
            for i in range(concurrency)
        )
    )
    return stats, time.perf_counter() - t0


def _client_process(
    port: int, concurrency: int, seconds: float, prompt_words: int, max_tokens: int, first: int
) -> tuple[Stats, float]:
    return asyncio.run(run_load(port, concurrency, seconds, prompt_words, max_tokens, first))


def run_clients(
    port: int, concurrency: int, seconds: float, prompt_words: int, max_tokens: int, procs: int
) -> tuple[Stats, float]:
    """The load from `procs` client processes (so the load generator is not the bottleneck)."""
    if procs <= 1:
        return asyncio.run(run_load(port, concurrency, seconds, prompt_words, max_tokens))
    share = [concurrency // procs + (1 if i < concurrency % procs else 0) for i in range(procs)]
    firsts = [sum(share[:i]) for i in range(procs)]
    with ProcessPoolExecutor(procs) as pool:
        futures = [
            pool.submit(_client_process, port, n, seconds, prompt_words, max_tokens, f)
            for n, f in zip(share, firsts, strict=True)
        ]
        parts = [f.result() for f in futures]
    total = Stats()
    for stats, _wall in parts:
        total.ok += stats.ok
        total.errors += stats.errors
        total.error_samples.extend(stats.error_samples[:2])
        total.ttft.extend(stats.ttft)
        total.tpot.extend(stats.tpot)
        total.tokens += stats.tokens
    return total, max(w for _s, w in parts)


def start_engine(
    profile: str, speed: float, max_num_seqs: int, stream_interval: int = 1
) -> tuple[ManagedProcess, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "workers.emulator", "--port", str(port), "--profile", profile,
           "--speed", str(speed), "--max-num-seqs", str(max_num_seqs),
           "--stream-interval", str(stream_interval)]  # fmt: skip
    proc = ManagedProcess("emulated engine", cmd).start()
    try:
        wait_healthy([(proc, f"http://127.0.0.1:{port}")], timeout_s=60)
    except BaseException:
        proc.stop()
        raise
    return proc, port


def run_one(args: argparse.Namespace, concurrency: int) -> dict[str, Any]:
    proc, port = start_engine(args.profile, args.speed, args.max_num_seqs, args.stream_interval)
    try:
        # Warm-up: a few requests so imports and caches are hot.
        asyncio.run(run_load(port, 4, 1.0, args.prompt_words, 8))
        before = scrape(port)
        assert proc.pid is not None
        cpu0 = cpu_seconds(proc.pid)
        stats, wall = run_clients(
            port, concurrency, args.seconds, args.prompt_words, args.max_tokens, args.client_procs
        )
        cpu = cpu_seconds(proc.pid) - cpu0
        after = scrape(port)
        rss = rss_mb(proc.pid)
    finally:
        proc.stop()

    def delta(name: str) -> float:
        return after[name] - before[name]

    o = "ownerserve_emulator_"
    steps = delta(o + "engine_steps_total")
    decode_tokens = delta(o + "decode_tokens_computed_total")
    busy = delta(o + "engine_busy_seconds_total")
    active = delta(o + "engine_active_seconds_total")
    late = delta(o + "engine_late_seconds_total")
    prof = load_profile(args.profile)
    mean_batch = decode_tokens / steps if steps else 0.0
    modelled_step = busy / steps / args.speed if steps else 0.0
    observed_tpot = statistics.mean(stats.tpot) if stats.tpot else 0.0
    itl_n = delta("vllm:inter_token_latency_seconds_count")
    itl_s = delta("vllm:inter_token_latency_seconds_sum")
    n = max(stats.ok, 1)
    return {
        "concurrency": concurrency,
        "seconds": round(wall, 1),
        "requests_ok": stats.ok,
        "errors": stats.errors,
        "error_samples": stats.error_samples,
        "req_per_s": round(stats.ok / wall, 1),
        "tokens_per_s": round(stats.tokens / wall),
        "ttft_p50_ms": round(pct(stats.ttft, 0.5) * 1e3, 1),
        "ttft_p99_ms": round(pct(stats.ttft, 0.99) * 1e3, 1),
        "client_tpot_mean_ms": round(observed_tpot * 1e3, 2),
        "engine_itl_mean_ms": round(itl_s / itl_n * 1e3, 2) if itl_n else 0.0,
        "modelled_step_mean_ms": round(modelled_step * 1e3, 2),
        # Modelled step time / wall time the steps took: 1.0 = the engine kept the modelled GPU
        # pace; below 1, CPU work (its own or the box's) stretched the steps.
        "timing_fidelity": round(busy / args.speed / active, 2) if active else 0.0,
        "engine_active_share": round(active / wall, 2),
        # Share of step wall time lost to sleeps overshooting (timer wake-up, CPU contention).
        "engine_late_share": round(late / active, 2) if active else 0.0,
        "mean_decode_batch": round(mean_batch, 1),
        "engine_cpu_s": round(cpu, 2),
        "engine_cpu_util": round(cpu / wall, 2),
        "engine_cpu_us_per_request": round(cpu * 1e6 / n),
        "engine_cpu_us_per_token": round(cpu * 1e6 / max(stats.tokens, 1), 1),
        "engine_rss_mb": round(rss, 1),
        "profile": prof.name,
        "box_load_avg_1m": round(os.getloadavg()[0], 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[100, 500])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--profile", default="h100-llama3-8b")
    parser.add_argument("--speed", type=float, default=1.0)
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=60)
    parser.add_argument("--stream-interval", type=int, default=1, help="engine tokens per chunk")
    parser.add_argument("--client-procs", type=int, default=1, help="load generator processes")
    parser.add_argument("--out", default=None, help="append JSON lines here")
    args = parser.parse_args(argv)
    results = []
    for c in args.concurrency:
        res = run_one(args, c)
        res.update(
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            machine=f"{platform.machine()} {os.cpu_count()} cores (shared VM)",
            speed=args.speed,
            client_procs=args.client_procs,
            stream_interval=args.stream_interval,
            max_tokens=args.max_tokens,
        )
        results.append(res)
        print(json.dumps(res), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(res) + "\n")
    bad = [r for r in results if r["errors"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
