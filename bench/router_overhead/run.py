"""Router overhead, side by side in one run: the OwnerServe proxy (ownerserve policy, and
round-robin to separate planning from proxying) vs direct to the backends vs vllm-router
vs sglang-router (`--peer-policy`, round_robin by default), all in front of the same two
near-zero-cost backends (`bench.router_overhead.backend`), driven by
`bench.router_overhead.load`.

Per target and scenario: router CPU µs per request (utime+stime of the router's process tree
from /proc over the measured window, divided by requests), throughput, latency p50/p99, the
latency each router adds over going direct, and the answers that were not 200. Scenarios
(`--scenarios`, comma-separated labels or `short`/`long`/`all`): `short`, ~2 KB prompts
non-streaming and streaming at 1 and 16 connections and 8-turn sessions; `long`, agent
sessions whose prompt grows to 8K, 32K or 128K characters (tool calls and their outputs,
`load.AgentSession`), non-streaming and streaming, at 1 and 8 connections. `--tokenizer bpe`
gives OwnerServe a byte-level BPE tokenizer trained here on the load's words (no model hub),
instead of the byte tokenizer; the peers route on text either way.

    .venv/bin/python -m bench.router_overhead.run [--secs 8] [--out FILE.json]
    .venv/bin/python -m bench.router_overhead.run --scenarios long --peer-policy cache_aware \
        --targets ownerserve,vllm-router,sglang-router [--tokenizer bpe]

Peers come from `bench/peers/setup_peers.sh` (their own venvs); a peer that cannot be
installed is reported as missing, not faked.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from ownerserve.ports import free_port

REPO = Path(__file__).resolve().parents[2]
HZ = os.sysconf("SC_CLK_TCK")
MODEL = "bench-model"
LONG_TURNS = 16
"""Turns of a long agent session (a session then starts over with a new id)."""


@dataclass(frozen=True, slots=True)
class Scenario:
    label: str
    stream: bool
    conns: int
    turns: int = 0
    """Turns per agent session (0: every prompt new)."""
    grow_to: int = 0
    """Characters a long agent session's prompt grows to (0: the short ~2 KB prompts)."""

    def load_args(self) -> list[str]:
        """The load generator's arguments for this scenario."""
        out = ["-c", str(self.conns)] + (["--stream"] if self.stream else [])
        if self.grow_to:
            return [*out, "--grow-to", str(self.grow_to), "--turns", str(self.turns)]
        return out + (["--session-turns", str(self.turns)] if self.turns else [])


SHORT: tuple[Scenario, ...] = (
    Scenario("non-stream c=1", False, 1),
    Scenario("non-stream c=16", False, 16),
    Scenario("stream c=1", True, 1),
    Scenario("stream c=16", True, 16),
    Scenario("agent sessions stream c=16", True, 16, 8),
)
LONG: tuple[Scenario, ...] = tuple(
    Scenario(
        f"agent {k}K {'stream' if stream else 'non-stream'} c={c}", stream, c, LONG_TURNS, k * 1024
    )
    for k in (8, 32, 128)
    for stream in (False, True)
    for c in (1, 8)
)
SCENARIOS: dict[str, Scenario] = {s.label: s for s in SHORT + LONG}


def pick_scenarios(spec: str) -> list[Scenario]:
    """`short`, `long`, `all` or comma-separated labels (`SCENARIOS`)."""
    groups = {"short": list(SHORT), "long": list(LONG), "all": list(SHORT + LONG)}
    out: list[Scenario] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if part in groups:
            out += groups[part]
        elif part in SCENARIOS:
            out.append(SCENARIOS[part])
        else:
            raise SystemExit(f"unknown scenario {part!r}; one of {sorted(SCENARIOS)}")
    return out


def proc_tree(pid: int) -> list[int]:
    out = [pid]
    try:
        rows = subprocess.run(["ps", "-eo", "pid,ppid"], capture_output=True, text=True).stdout
    except OSError:
        return out
    pairs = [tuple(map(int, r.split())) for r in rows.splitlines()[1:] if r.strip()]
    changed = True
    while changed:
        changed = False
        for p, pp in pairs:
            if pp in out and p not in out:
                out.append(p)
                changed = True
    return out


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / HZ
    return total


def wait_http(
    url: str, timeout_s: float = 60.0, proc: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready in {timeout_s}s")


@dataclass
class Target:
    name: str
    port: int | None  # None: direct to the backends
    proc: subprocess.Popen[bytes] | None = None


@contextlib.contextmanager
def started(
    cmd: list[str], env: dict[str, str] | None = None, cwd: Path = REPO
) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})}, start_new_session=True,
    )  # fmt: skip
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def ownerserve_config(
    path: Path, port: int, backends: list[int], policy: str, tokenizer: str = "byte"
) -> None:
    workers = "\n".join(
        f'  - {{id: b{i}, url: "http://127.0.0.1:{p}", role: hybrid, kind: vllm, '
        f"models: [{MODEL}]}}"
        for i, p in enumerate(backends)
    )
    path.write_text(
        f"server: {{host: 127.0.0.1, port: {port}, health_interval_s: 2.0}}\n"
        f"planner: {{policy: {policy}, profile: fast-test}}\n"
        f"models: [{{name: {MODEL}, tokenizer: {json.dumps(tokenizer)}, block_size: 16}}]\n"
        f"workers:\n{workers}\n"
    )


def peer(name: str) -> Path | None:
    sys.path.insert(0, str(REPO))
    from loadgen.peers import PeerUnavailableError, peer_binary

    try:
        return peer_binary(name)
    except PeerUnavailableError as exc:
        print(f"# {name} unavailable: {exc}", file=sys.stderr)
        return None


def bpe_tokenizer(out_dir: Path) -> Path:
    """A byte-level BPE tokenizer trained on the load's own words (a stand-in for a model's:
    no model hub is reachable), saved as `tokenizer.json`. Its vocabulary (324) stops short of
    the words' last merges: ~4.05 characters a token on the load's text, as a model's BPE on
    English and code (~4)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from bench.router_overhead.load import WORDS

    rnd = random.Random(0)
    corpus = [" ".join(rnd.choice(WORDS) for _ in range(40)) for _ in range(2000)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=324, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(corpus, trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tokenizer.json"
    tok.save(str(path))
    return path


def measure(target: Target, backends: list[int], scenario: Scenario, secs: float) -> dict[str, Any]:
    if target.port is None:
        dest = ",".join(f"127.0.0.1:{p}" for p in backends)
    else:
        dest = f"127.0.0.1:{target.port}"
    pids = proc_tree(target.proc.pid) if target.proc is not None else []
    cmd = [sys.executable, "-m", "bench.router_overhead.load", "--targets", dest,
           "--secs", str(secs), "--warmup", "1.0", "--model", MODEL,
           *scenario.load_args()]  # fmt: skip
    # CPU is read around the measured window only: the load runs `warmup` seconds first
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)
    c0 = cpu_seconds(pids)
    t0 = time.monotonic()
    out, _ = proc.communicate(timeout=secs + 60)
    c1 = cpu_seconds(pids)
    elapsed = time.monotonic() - t0
    res: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    n = max(1, res["requests"])
    # scale the CPU window to the measured seconds (communicate returns a bit after `stop`)
    cpu = (c1 - c0) * min(1.0, secs / elapsed) if pids else None
    res["router_cpu_us_per_req"] = None if cpu is None else round(cpu * 1e6 / n, 1)
    return res


def run(
    secs: float,
    targets_wanted: list[str],
    scenarios: list[Scenario],
    peer_policy: str = "round_robin",
    tokenizer: str = "byte",
    baseline: Path | None = None,
) -> dict[str, Any]:
    """Every target started at once, then each scenario measured on each target in turn
    (targets alternate within a scenario, so a noisy stretch of the machine hits them alike).
    With `baseline` (another checkout), every OwnerServe target runs from it too, as
    "NAME @COMMIT"."""
    backends = [free_port(), free_port()]
    results: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        for p in backends:
            proc = stack.enter_context(started(
                [sys.executable, "-m", "bench.router_overhead.backend", "--port", str(p),
                 "--model", MODEL]))  # fmt: skip
            wait_http(f"http://127.0.0.1:{p}/health", proc=proc)
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        tok_spec = str(bpe_tokenizer(tmp / "bpe")) if tokenizer == "bpe" else "byte"
        urls = [f"http://127.0.0.1:{p}" for p in backends]
        wanted: list[tuple[str, Path]] = []
        for name in targets_wanted:
            wanted.append((name, REPO))
            if baseline is not None and name.startswith("ownerserve"):
                rev = subprocess.run(["git", "-C", str(baseline), "rev-parse", "--short", "HEAD"],
                                     capture_output=True, text=True).stdout.strip()  # fmt: skip
                wanted.append((f"{name} @{rev or baseline.name}", baseline))
        targets: list[Target] = []
        for name, repo in wanted:
            port = free_port()
            cmd: list[str] | None = None
            if name == "direct":
                targets.append(Target(name, None))
                continue
            if name.startswith("ownerserve"):
                policy = "round-robin" if "round-robin" in name else "ownerserve"
                cfg = tmp / f"{len(targets)}-{policy}.yaml"
                ownerserve_config(cfg, port, backends, policy, tok_spec)
                cmd = [sys.executable, "-m", "ownerserve", "serve", "--config", str(cfg)]
            elif name == "vllm-router":
                binary = peer("vllm-router")
                if binary is not None:
                    cmd = [str(binary), "--host", "127.0.0.1", "--port", str(port),
                           "--worker-urls", *urls, "--policy", peer_policy,
                           "--prometheus-host", "127.0.0.1", "--prometheus-port",
                           str(free_port()), "--log-level", "error"]  # fmt: skip
            elif name == "sglang-router":
                binary = peer("sglang-router")
                if binary is not None:
                    cmd = [str(binary), "launch", "--host", "127.0.0.1", "--port", str(port),
                           "--worker-urls", *urls, "--policy", peer_policy,
                           "--prometheus-host", "127.0.0.1", "--prometheus-port",
                           str(free_port()), "--log-level", "error"]  # fmt: skip
            if cmd is None:
                results[name] = {"missing": True}
                continue
            env = {"PYTHONPATH": str(repo)} if repo != REPO else None
            proc = stack.enter_context(started(cmd, env, cwd=repo))
            wait_http(f"http://127.0.0.1:{port}/v1/models", proc=proc)
            targets.append(Target(name, port, proc))
        time.sleep(1.0)  # first health checks
        for target in targets:
            results[target.name] = {}
        for sc in scenarios:
            for target in targets:
                r = measure(target, backends, sc, secs)
                results[target.name][sc.label] = r
                print(f"# {target.name:26s} {sc.label:16s} {json.dumps(r)}", file=sys.stderr)
    return results


def table(results: dict[str, Any]) -> str:
    direct = results.get("direct", {})
    lines = [
        "| target | scenario | router CPU µs/req | req/s | vs direct | p50 ms | p99 ms | "
        "added p50 ms | added p99 ms | mean KB | non-200 | errors |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, per in results.items():
        if per.get("missing"):
            lines.append(f"| {name} | (not installed) | | | | | | | | | | |")
            continue
        for label, r in per.items():
            d = direct.get(label)
            ratio = f"{r['rps'] / d['rps']:.2f}" if d else ""
            add50 = f"{r['p50_ms'] - d['p50_ms']:.3f}" if d and name != "direct" else ""
            add99 = f"{r['p99_ms'] - d['p99_ms']:.3f}" if d and name != "direct" else ""
            cpu = r.get("router_cpu_us_per_req")
            lines.append(
                f"| {name} | {label} | {'' if cpu is None else cpu} | {r['rps']:.0f} | {ratio} "
                f"| {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {add50} | {add99} "
                f"| {r.get('mean_request_bytes', 0) / 1024:.1f} | {r['non200']} | {r['errors']} |"
            )
    return "\n".join(lines)


def compare(results: dict[str, Any], of: str = "ownerserve") -> str:
    """`of`'s router CPU per request against the best peer's, scenario by scenario."""
    peers = [n for n in ("vllm-router", "sglang-router") if not results.get(n, {}).get("missing")]
    mine = results.get(of, {})
    if not peers or not mine or mine.get("missing"):
        return ""
    lines = [f"| scenario | {of} µs/req | " + " | ".join(f"{p} µs/req" for p in peers)
             + f" | {of} / best |", "| --- | ---: |" + " ---: |" * (len(peers) + 1)]  # fmt: skip
    for label, r in mine.items():
        cpus = [results[p].get(label, {}).get("router_cpu_us_per_req") for p in peers]
        known = [c for c in cpus if c]
        best = min(known) if known else None
        ratio = f"{r['router_cpu_us_per_req'] / best:.2f}×" if best else ""
        cells = " | ".join("" if c is None else f"{c:.0f}" for c in cpus)
        lines.append(f"| {label} | {r['router_cpu_us_per_req']:.0f} | {cells} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--secs", type=float, default=8.0, help="measured seconds per scenario")
    ap.add_argument(
        "--targets",
        default="direct,ownerserve,ownerserve round-robin,vllm-router,sglang-router",
        help="comma-separated subset",
    )
    ap.add_argument(
        "--scenarios", default="short", help="short, long, all or comma-separated labels"
    )
    ap.add_argument(
        "--peer-policy", default="round_robin", help="the peers' policy (e.g. cache_aware)"
    )
    ap.add_argument("--tokenizer", choices=("byte", "bpe"), default="byte")
    ap.add_argument(
        "--baseline", type=Path, default=None,
        help="another checkout: its OwnerServe runs beside this one's, alternating",
    )  # fmt: skip
    ap.add_argument("--out", default=None, help="write the raw results as JSON here")
    args = ap.parse_args(argv)
    results = run(
        args.secs,
        [t.strip() for t in args.targets.split(",") if t.strip()],
        pick_scenarios(args.scenarios),
        args.peer_policy,
        args.tokenizer,
        args.baseline,
    )
    meta = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": (
            f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
        ),
        "secs": args.secs,
        "peer_policy": args.peer_policy,
        "tokenizer": args.tokenizer,
    }
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(
        f"date {meta['date']}; {meta['machine']}; {args.secs:g} s per scenario; peers "
        f"{args.peer_policy}; OwnerServe tokenizer {args.tokenizer}\n"
    )
    print(table(results))
    for name in results:
        summary = compare(results, name) if name.startswith("ownerserve") else ""
        if summary:
            print("\n" + summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
