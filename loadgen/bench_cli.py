"""`ownerserve bench agentic`: every routing policy and the peer routers on one emulated cluster;
`ownerserve bench capacity`: each target's capacity, the highest session rate at which 90% of
sessions meet a TTFT and TPOT SLO, found by search on emulated workers or `--sim` (with `--rates`
the fixed-rate goodput sweep);
`ownerserve bench chaos`: two router replicas on one Redis directory under load and faults.

ownerserve bench agentic                      # the full run (about 15-20 minutes here)
ownerserve bench agentic --quick              # a smoke run: fewer sessions, two targets
ownerserve bench agentic --policies ownerserve,static-pd --no-peers --no-trace
ownerserve bench capacity                     # capacity search, every target, agentic-long
ownerserve bench capacity --quick --targets colocated
ownerserve bench capacity --sim --workers 64  # the same search in the simulator
ownerserve bench capacity --rates 15,30,60    # the fixed-rate goodput sweep
ownerserve bench chaos --duration 600         # two replicas, one Redis, a fault schedule
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys
import tempfile
import time
from pathlib import Path

import yaml

from loadgen.bench import (
    OWN_POLICIES,
    PEER_LABELS,
    BenchPlan,
    Target,
    machine_line,
    run_bench,
    write_outputs,
)
from loadgen.capacity import (
    MAX_LATE_SHARE,
    RATED_WORKLOADS,
    capacity_plan_from_args,
    kv_demand,
    run_capacity,
    size_plan_blocks,
    sizing_lines,
    write_capacity_outputs,
)
from loadgen.cli import add_generate_arguments
from loadgen.cluster import REPO_ROOT, ClusterSpec, peer_mode_unfit, sigterm_as_interrupt
from loadgen.trace import (
    TraceScaling,
    load_trace,
    prefix_sharing,
    trace_workload,
)
from loadgen.workloads import GENERATORS, Workload, generate
from ownerserve.config import settings_from_dict
from ownerserve.errors import ConfigError
from ownerserve.profiles import load_profile

DEFAULT_TRACE = REPO_ROOT / "data" / "mooncake_synthetic_trace.jsonl"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    p = sub.add_parser("agentic", help="own policies and peer routers on agentic traffic")
    p.add_argument("--policies", default=",".join(OWN_POLICIES), help="own policies (comma list)")
    p.add_argument("--peers", default=",".join(PEER_LABELS), help="peer router modes (comma list)")
    p.add_argument("--no-peers", action="store_true", help="skip the peer routers")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--hybrid", type=int, default=2)
    p.add_argument("--profile", default="h100-llama3-8b", help="emulated workers' timing profile")
    p.add_argument("--speed", type=float, default=2.0, help="emulated time runs N× faster")
    p.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks per worker (default: the profile's)"
    )
    p.add_argument(
        "--cpu-num-blocks",
        type=int,
        default=0,
        help="blocks of each worker's CPU KV tier behind HBM (vLLM-style offloading; 0: none)",
    )
    p.add_argument(
        "--workload",
        default="mixed",
        help=f"generated workload: {'|'.join(sorted(GENERATORS))} (default mixed)",
    )
    add_generate_arguments(p)
    p.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="multiply arrivals and tool gaps (default 1/speed: gaps shrink with the GPU time)",
    )
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format trace")
    p.add_argument("--no-trace", action="store_true", help="skip the trace replay")
    p.add_argument(
        "--trace-start", type=int, default=2993, help="first row (default: the last 1000 rows)"
    )
    p.add_argument("--trace-stride", type=int, default=1, help="replay every Nth row")
    p.add_argument("--trace-limit", type=int, default=1000, help="rows to replay at most")
    p.add_argument("--block-tokens", type=int, default=32, help="tokens per trace hash id")
    p.add_argument("--max-output", type=int, default=24, help="cap trace output lengths")
    p.add_argument(
        "--trace-time-scale",
        type=float,
        default=0.125,
        help="multiply trace timestamps (default 0.125: the last 1000 rows in 30 s, about 33 "
        "requests/s, which keeps this 2-core machine's Python processes below saturation)",
    )
    _add_planner_argument(p)
    p.add_argument("--max-inflight", type=int, default=64)
    p.add_argument("--run-limit", type=float, default=90.0, help="seconds at most per run")
    p.add_argument("--quick", action="store_true", help="smoke run: small workload, 2 targets")
    _add_output_arguments(p, "agentic.md", None)
    p.add_argument(
        "--analysis",
        type=Path,
        default=REPO_ROOT / "bench" / "agentic_analysis.md",
        help="Markdown appended to the section (the written explanation of the numbers)",
    )
    _add_capacity_arguments(sub)
    _add_chaos_arguments(sub)


def _add_planner_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--planner",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="planner setting for the own policies (e.g. lambda_hbm=1e-9); repeatable",
    )


def _add_output_arguments(
    p: argparse.ArgumentParser, history: str, out_dir_help: str | None
) -> None:
    """--out-dir, --results-md (bench/history/`history` by default), --no-results-md and
    --log-dir, as every benchmark command takes them."""
    p.add_argument(
        "--out-dir", type=Path, default=REPO_ROOT / "bench" / "results", help=out_dir_help
    )
    p.add_argument(
        "--results-md",
        type=Path,
        default=REPO_ROOT / "bench" / "history" / history,
        help="Markdown file the run's dated section is appended to (default: %(default)s)",
    )
    p.add_argument("--no-results-md", action="store_true", help="write no Markdown section")
    p.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="process logs and request records (default: a temp dir)",
    )


CAPACITY_TARGETS: tuple[str, ...] = (
    "ownerserve",
    "static-pd",
    "colocated",
    "sglang-router cache_aware",
    "vllm-router cache_aware",
    "vllm-router consistent_hash",
    "vllm-router pd cache_aware",
    "sglang-router pd cache_aware",
)
CAPACITY_RATES: tuple[float, ...] = (15.0, 30.0, 60.0, 120.0, 240.0)
QUICK_RATES: tuple[float, ...] = (60.0, 600.0)


def _add_capacity_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "capacity",
        help="goodput and latency over a sweep of session arrival rates, every target",
        description="Sweep the session arrival rate from light load to overload on an emulated "
        "cluster whose HBM is sized to about a third of the top rate's KV working set (behind "
        "it a CPU tier), "
        "every target at every rate with the same sessions. Writes capacity_latest.json (every "
        "point), a dated copy and PNG curves to --out-dir, appends the table to --results-md and "
        "prints it.",
    )
    p.add_argument(
        "--targets",
        default=",".join(CAPACITY_TARGETS),
        help="own policies and peer router modes, comma list (default: %(default)s; from the "
        "default list a P/D mode the cluster cannot run is skipped: sglang-router's needs "
        "--prefill and --decode workers)",
    )
    p.add_argument(
        "--rates",
        default=None,
        help="run the fixed-rate sweep (goodput at the TTFT SLO) at these session arrival "
        "rates, main sessions per minute of wall time, comma list, instead of the capacity "
        f"search (e.g. {','.join(f'{r:g}' for r in CAPACITY_RATES)})",
    )
    p.add_argument(
        "--workload",
        default="agentic-long",
        help=f"{'|'.join(sorted(RATED_WORKLOADS))} (default agentic-long)",
    )
    p.add_argument(
        "--sessions",
        type=int,
        default=None,
        help="main sessions per point, the same ones at every rate (subagents come on top; "
        "default 12, --quick 3)",
    )
    p.add_argument(
        "--scale",
        type=float,
        default=None,
        help="multiply the workload's token counts (default 0.05: 3-6K-token contexts; "
        "--quick 0.03)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed, the same for every point")
    p.add_argument(
        "--time-scale",
        type=float,
        default=0.005,
        help="multiply the sessions' tool gaps (default 0.005: p50 10 ms, mean about 0.1 s, "
        "a session's gaps about 3 s in all on average)",
    )
    p.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="prefill workers (default 0: every target gets the same four whole engines; a "
        "prefill-only worker holds no session, so the peers' regular modes, which use it as a "
        "whole engine, would get a third more KV than ownerserve and static-pd)",
    )
    p.add_argument("--decode", type=int, default=0, help="decode workers (default 0)")
    p.add_argument("--hybrid", type=int, default=4, help="hybrid workers (default 4)")
    p.add_argument("--profile", default="h100-llama3-8b", help="emulated workers' timing profile")
    p.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="emulated time runs N× faster than wall time (default 1: latencies are emulated "
        "time); the TTFT SLO is checked on wall TTFT × N",
    )
    p.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="HBM KV blocks per worker (default: the working set at the highest rate is 3× the "
        "cluster's HBM, but a worker holds at least the largest session's context)",
    )
    p.add_argument(
        "--cpu-num-blocks",
        type=int,
        default=None,
        help="CPU KV tier per worker, in blocks (vLLM-style offloading; default: as many as "
        "--num-blocks, so HBM plus CPU hold two thirds of the top rate's working set and the "
        "rest must be recomputed)",
    )
    p.add_argument(
        "--slo-ttft-p90-s",
        type=float,
        default=2.0,
        help="a session is good when it completes and the p90 of its steps' TTFT (emulated "
        "seconds) is at most this (default 2)",
    )
    p.add_argument(
        "--duration-s",
        type=float,
        default=None,
        help="seconds each point may run after its last session's planned start; sessions "
        "still running then are cut and count as not completed (default 60: a subagent starts "
        "when its parent sends the turn that spawns it, which a loaded cluster may reach well "
        "after the planned time; --quick 20)",
    )
    p.add_argument("--max-inflight", type=int, default=64, help="client's concurrent requests")
    _add_planner_argument(p)
    p.add_argument(
        "--quick", action="store_true", help="check the wiring: 2 rates, 3 small sessions"
    )
    s = p.add_argument_group(
        "capacity by search (the default; --rates runs the fixed-rate sweep instead)",
        "Capacity: the highest session rate at which >= 90%% of sessions meet the SLO (a "
        "session: >= 90%% of its requests within the TTFT and TPOT bounds, multiples of the "
        "request's unloaded latencies), bracketed from --start-rate by doubling or halving, "
        "then bisected to --rel-tol; every target on the same worker count, the P/D ones and "
        "ownerserve at each P:D split (loadgen/capacity_sim.py splits_for); at two SLOs.",
    )
    s.add_argument(
        "--start-rate",
        type=float,
        default=None,
        help="first rate, sessions/min (default 30; --sim 960)",
    )
    s.add_argument(
        "--max-rate",
        type=float,
        default=None,
        help="cap: capacity at least this when met there (default 1920; --sim 15360)",
    )
    s.add_argument(
        "--min-rate",
        type=float,
        default=None,
        help="floor: capacity 0 when not met down to here (default 3.75; --sim 60)",
    )
    s.add_argument(
        "--rel-tol",
        type=float,
        default=0.05,
        help="bisect until the failing rate is within this share of the met one (default 0.05)",
    )
    s.add_argument(
        "--slo-tight", default=None, metavar="TTFT,TPOT", help="tight SLO factors (default 5,1.5)"
    )
    s.add_argument(
        "--slo-loose", default=None, metavar="TTFT,TPOT", help="loose SLO factors (default 20,3)"
    )
    s.add_argument(
        "--max-late-share",
        type=float,
        default=MAX_LATE_SHARE,
        help="an emulated "
        "run whose workers' step sleeps overshot by more than this share of their "
        "step time measured this machine: discarded and said (default %(default)s)",
    )
    s.add_argument(
        "--sizing-rate",
        type=float,
        default=None,
        help="HBM sized so the working "
        "set at this rate is 3x the cluster's (default 240; --sim 3840)",
    )
    s.add_argument(
        "--sim",
        action="store_true",
        help="run the search in the simulator "
        "(`ownerserve sim`'s engine) instead of on emulated workers",
    )
    s.add_argument("--workers", type=int, default=64, help="--sim: cluster size (default 64)")
    s.add_argument(
        "--block-tokens",
        type=int,
        default=64,
        help="--sim: tokens per KV block (default 64; the emulated engine's are 16)",
    )
    s.add_argument(
        "--kv-spec",
        default=None,
        help="--sim: HeteroCache model spec (configs/models/NAME.yaml, e.g. deepseek-v4, "
        "qwen3-8b-swa) every target's KV is kept by (SGLang's peers without window "
        "checkpoints, as HiCache); HBM sized by its bytes per token; default: dense",
    )
    s.add_argument(
        "--swa-policy",
        default=None,
        help="--sim, with --kv-spec: the SWA checkpoint policy instead of the spec's own "
        "(full, zero, cost, periodic:N)",
    )
    s.add_argument(
        "--retention",
        default=None,
        help="--sim, with a hybrid --kv-spec: which boundaries a worker's HBM keeps the "
        "windows of (full, zero, or N tokens), as `ownerserve sim --retention`",
    )
    s.add_argument(
        "--compare",
        type=Path,
        default=None,
        help="--sim: a capacity JSON of "
        "the emulated search; print the Kendall tau of the two rankings",
    )
    _add_output_arguments(
        p,
        "capacity.md",
        "capacity_latest.json, its dated copy and the PNG curves (default: %(default)s)",
    )


def _add_chaos_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from loadgen.chaos.schedule import FAULT_KINDS

    p = sub.add_parser(
        "chaos",
        help="sustained agentic load through two router replicas on one Redis directory, "
        "while a fault schedule runs",
        description="Run a fixed number of concurrent agent sessions, their turns spread over "
        "two `ownerserve serve` replicas that share one Redis ownership directory, on emulated "
        "workers, for --duration seconds, while a seeded fault schedule kills, stops and "
        "restarts workers, Redis, a replica, a worker's KV sidecar and the Mooncake Store "
        "master. Writes chaos_latest.json, a dated copy and "
        "chaos_latest.md to --out-dir: requests by outcome (hung must be 0), sessions lost "
        "(0), each dead worker's time until the directory names it as no owner (bound: one "
        "lease), stale directory entries (0), KV and leases still held once idle (none), the "
        "replicas' memory and sockets. Exits 1 when a check fails.",
    )
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--sessions", type=int, default=6, help="concurrent agent sessions (default 6)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sessions and the faults")
    p.add_argument(
        "--faults",
        default=",".join(FAULT_KINDS),
        help="faults, comma list (default: all). sidecar_kill SIGKILLs a worker's KV sidecar "
        "mid-fetch and needs --kv-sidecars tcp or store; store_master_kill SIGKILLs the "
        "Mooncake Store master and needs --kv-sidecars store (skipped otherwise, and said)",
    )
    p.add_argument(
        "--kv-sidecars",
        choices=("auto", "off", "tcp", "store"),
        default="auto",
        help="give each emulated worker its own KV sidecar process (ownerserve worker "
        "sidecar), which its KV is saved to, loaded from and fetched through, its replicas "
        "published to the Redis directory: tcp (sidecars move KV over TCP), store (their "
        "artifacts on one mooncake_master) or off (the workers serve their KV API in-process). "
        "auto (default): store with store_master_kill among --faults, tcp with sidecar_kill, "
        "else off",
    )
    p.add_argument("--repeats", type=int, default=2, help="times each fault runs (default 2)")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--hybrid", type=int, default=4)
    p.add_argument("--profile", default="h100-llama3-8b", help="emulated workers' timing profile")
    p.add_argument("--speed", type=float, default=4.0, help="emulated time runs N× faster")
    p.add_argument(
        "--lease-s", type=float, default=10.0, help="the directory's lease TTL (default 10)"
    )
    p.add_argument(
        "--replica-ttl-s",
        type=float,
        default=30.0,
        help="with KV sidecars: their --replica-ttl-s (default 30, the sidecar's): what they "
        "publish is renewed every third of it; the bound on a dead sidecar's replicas and a "
        "restarted store master's lost objects in the directory",
    )
    p.add_argument(
        "--stop-s",
        type=float,
        default=8.0,
        help="seconds a SIGSTOPped worker stays stopped (default 8: long enough for the "
        "replicas to hold it dead, shorter than their stream-gap bound of 10)",
    )
    p.add_argument(
        "--hang-s",
        type=float,
        default=45.0,
        help="a request unanswered this long is hung (default 45; past the replicas' "
        "request_timeout_s of 30)",
    )
    p.add_argument(
        "--recover-s",
        type=float,
        default=30.0,
        help="a turn that keeps failing this long loses its session (default 30)",
    )
    p.add_argument(
        "--settle-s",
        type=float,
        default=60.0,
        help="after the load, seconds at most for every worker and router gauge to get back "
        "to idle (default 60)",
    )
    p.add_argument(
        "--stream-share", type=float, default=0.5, help="share of streamed turns (default 0.5)"
    )
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply the sessions' tool gaps")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument(
        "--out-dir",
        type=Path,
        default=REPO_ROOT / "bench" / "results",
        help="where the report goes (default: %(default)s)",
    )
    p.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="process logs, configs and the Redis data directory (default: a temp dir)",
    )


def run_chaos_command(args: argparse.Namespace) -> int:
    """`ownerserve bench chaos`: run, write the report, print its Markdown."""
    from loadgen.chaos.report import markdown
    from loadgen.chaos.run import ChaosPlan, run_chaos
    from loadgen.chaos.schedule import FAULT_KINDS

    faults = tuple(_split(args.faults, FAULT_KINDS, "faults"))
    if args.speed <= 0 or min(args.prefill, args.decode, args.hybrid) < 0:
        raise ConfigError("--speed must be > 0 and worker counts >= 0")
    if not 0.0 <= args.stream_share <= 1.0:
        raise ConfigError("--stream-share must be within [0, 1]")
    if min(args.lease_s, args.replica_ttl_s, args.stop_s, args.settle_s, args.time_scale) <= 0:
        raise ConfigError(
            "--lease-s, --replica-ttl-s, --stop-s, --settle-s and --time-scale must be > 0"
        )
    plan = ChaosPlan(
        out_dir=args.out_dir,
        log_dir=args.log_dir or Path(tempfile.mkdtemp(prefix="ownerserve-chaos-")),
        duration_s=args.duration,
        sessions=args.sessions,
        seed=args.seed,
        prefill=args.prefill,
        decode=args.decode,
        hybrid=args.hybrid,
        profile=args.profile,
        speed=args.speed,
        lease_s=args.lease_s,
        faults=faults,
        repeats=args.repeats,
        stop_s=args.stop_s,
        hang_s=args.hang_s,
        recover_s=args.recover_s,
        settle_s=args.settle_s,
        stream_share=args.stream_share,
        time_scale=args.time_scale,
        progress=not args.quiet,
        kv_sidecars=args.kv_sidecars,
        replica_ttl_s=args.replica_ttl_s,
    )
    try:
        plan.check()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not args.quiet:
        print(f"process logs: {plan.log_dir}", file=sys.stderr)
    command = "ownerserve " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    with sigterm_as_interrupt():
        report = run_chaos(plan, command)
    print(markdown(report))
    return 0 if report["pass"] else 1


def _split(value: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [x.strip() for x in value.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad:
        raise ConfigError(f"--{what}: unknown {bad}; choose from {', '.join(allowed)}")
    return items


def _planner_settings(items: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--planner {item!r}: expected KEY=VALUE")
        out[key.strip()] = yaml.safe_load(value)
    if out:
        try:
            settings_from_dict({"planner": out}, source="--planner")
        except ConfigError as exc:
            raise ConfigError(str(exc)) from None
    return out


def _workloads(args: argparse.Namespace) -> tuple[list[tuple[str, Workload]], list[str]]:
    notes: list[str] = []
    time_scale = args.time_scale if args.time_scale is not None else 1.0 / args.speed
    scale = 0.25 if args.quick else args.scale
    try:
        w = generate(args.workload, args.seed, scale).scaled(time_scale)
    except ValueError as exc:
        raise ConfigError(f"--workload: {exc}") from None
    out = [(args.workload, w)]
    notes.append(
        f"Workload `{args.workload}` (seed {args.seed}, scale {scale:g}): {len(w.sessions)} "
        f"sessions, {w.n_requests} requests; arrivals and tool gaps ×{time_scale:g}."
    )
    if not args.no_trace:
        limit = 100 if args.quick else args.trace_limit
        try:
            rows = load_trace(
                args.trace, start=args.trace_start, limit=limit, stride=args.trace_stride
            )
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--trace: {exc}") from None
        trace_scale = args.trace_time_scale
        scaling = TraceScaling(
            block_tokens=args.block_tokens, max_output=args.max_output, time_scale=trace_scale
        )
        out.append(("mooncake-trace", trace_workload(rows, scaling, seed=args.seed)))
        span = (rows[-1].timestamp_ms - rows[0].timestamp_ms) / 1000 if rows else 0.0
        notes.append(
            f"Trace `{args.trace.name}`: rows from {args.trace_start} every {args.trace_stride} "
            f"({len(rows)} requests over {span:.0f} s, replayed ×{trace_scale:g}), "
            f"{args.block_tokens} tokens per hash id (512 recorded), outputs capped at "
            f"{args.max_output}; ideal prefix sharing of this subset "
            f"{prefix_sharing(rows, scaling):.1%}."
        )
    return out, notes


def run(args: argparse.Namespace) -> int:
    command = getattr(args, "bench_command", None)
    if command == "capacity":
        return run_capacity_command(args)
    if command == "chaos":
        return run_chaos_command(args)
    if command != "agentic":
        print(
            "usage: ownerserve bench agentic|capacity|chaos [options] (see --help)",
            file=sys.stderr,
        )
        return 2
    if args.speed <= 0 or min(args.prefill, args.decode, args.hybrid) < 0:
        raise ConfigError("--speed must be > 0 and worker counts >= 0")
    policies = _split(args.policies, OWN_POLICIES, "policies")
    peers = [] if args.no_peers else _split(args.peers, PEER_LABELS, "peers")
    spec_roles = ClusterSpec(args.prefill, args.decode, args.hybrid)
    peers = _runnable(peers, spec_roles, args.peers != ",".join(PEER_LABELS))
    if args.quick:
        policies = [p for p in policies if p in ("ownerserve", "static-pd")] or policies[:1]
        peers = peers[:1]
    targets = [Target(p, "own") for p in policies] + [Target(p, "peer") for p in peers]
    workloads, notes = _workloads(args)
    extra: tuple[str, ...] = ("--num-blocks", str(args.num_blocks)) if args.num_blocks else ()
    if args.cpu_num_blocks:
        extra += ("--cpu-num-blocks", str(args.cpu_num_blocks))
    spec = ClusterSpec(
        args.prefill, args.decode, args.hybrid, args.profile, args.speed, extra_args=extra
    )
    plan = BenchPlan(
        spec=spec,
        targets=targets,
        workloads=workloads,
        out_dir=args.out_dir,
        max_inflight=args.max_inflight,
        run_limit_s=args.run_limit,
        log_dir=args.log_dir or Path(tempfile.mkdtemp(prefix="ownerserve-bench-")),
        planner=_planner_settings(args.planner),
    )
    if args.analysis is not None and args.analysis.exists():
        notes.append("\n" + args.analysis.read_text().strip())
    command = "ownerserve " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    started = dt.datetime.now(dt.UTC)
    t0 = time.monotonic()
    # SIGTERM stops the workers and routers as Ctrl-C does (the main CLI turns it into exit 130)
    with sigterm_as_interrupt():
        outcomes = run_bench(plan)
    section = write_outputs(
        outcomes,
        plan,
        command,
        started,
        time.monotonic() - t0,
        notes,
        results_md=None if args.no_results_md else args.results_md,
    )
    print(section)
    return 0 if all(o.summaries for o in outcomes) else 1


def _runnable(labels: list[str], spec: ClusterSpec, asked: bool) -> list[str]:
    """`labels` without the peer modes that cannot run on `spec`'s cluster: named by the user
    (`asked`), such a mode is a ConfigError; from the default list it is skipped, and said."""
    kept = []
    for label in labels:
        why = peer_mode_unfit(label, spec) if label in PEER_LABELS else None
        if why is None:
            kept.append(label)
        elif asked:
            raise ConfigError(why)
        else:
            print(f"skipping {label}: {why}", file=sys.stderr)
    return kept


def _rates(value: str | None, quick: bool) -> list[float]:
    if value is None:
        return list(QUICK_RATES if quick else CAPACITY_RATES)
    try:
        rates = sorted({float(x) for x in value.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--rates {value!r}: expected numbers, e.g. 6,12,24") from None
    if not rates or rates[0] <= 0:
        raise ConfigError("--rates: give at least one rate, every one > 0")
    return rates


def run_capacity_command(args: argparse.Namespace) -> int:
    """`ownerserve bench capacity`: the capacity search (emulated or `--sim`), or with `--rates`
    the fixed-rate sweep."""
    if args.rates is None:
        from loadgen.capacity_cli import run_search_command

        return run_search_command(args)
    return run_sweep_command(args)


def run_sweep_command(args: argparse.Namespace) -> int:
    """`ownerserve bench capacity --rates ...`: size the cluster, sweep, write and print."""
    if args.speed <= 0 or args.time_scale <= 0 or min(args.prefill, args.decode, args.hybrid) < 0:
        raise ConfigError("--speed and --time-scale must be > 0 and worker counts >= 0")
    labels = _split(args.targets, OWN_POLICIES + PEER_LABELS, "targets")
    spec_roles = ClusterSpec(args.prefill, args.decode, args.hybrid)
    labels = _runnable(labels, spec_roles, args.targets != ",".join(CAPACITY_TARGETS))
    targets = [Target(t, "own" if t in OWN_POLICIES else "peer") for t in labels]
    rates = _rates(args.rates, args.quick)
    sessions = args.sessions or (3 if args.quick else 12)
    scale = args.scale or (0.03 if args.quick else 0.05)
    if args.workload not in RATED_WORKLOADS:
        raise ConfigError(f"--workload: choose from {', '.join(sorted(RATED_WORKLOADS))}")
    try:
        profile = load_profile(args.profile)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--profile: {exc}") from None
    plan = capacity_plan_from_args(
        args, targets, rates, _planner_settings(args.planner), sessions=sessions, scale=scale
    )
    spec = plan.spec
    demands = {r: kv_demand(plan.workload_at(r), profile, spec.speed, spec.model) for r in rates}
    num_blocks, cpu_blocks = size_plan_blocks(plan, demands[rates[-1]], args)
    sizing = sizing_lines(plan, demands, num_blocks, cpu_blocks)
    plan.log("\n".join(sizing))
    plan.log(f"process logs and request records: {plan.log_dir}")
    started = dt.datetime.now(dt.UTC)
    t0 = time.monotonic()
    with sigterm_as_interrupt():
        outcome = run_capacity(plan, demands)
    wall_min = (time.monotonic() - t0) / 60
    n = len(plan.workload_at(rates[0]).sessions)
    header = [
        f"Command: `ownerserve {' '.join(shlex.quote(a) for a in sys.argv[1:])}`  ",
        f"Date: {started.isoformat(timespec='seconds')}, wall time {wall_min:.1f} min  ",
        f"Machine: {machine_line()}  ",
        f"Cluster: {spec.prefill} prefill + {spec.decode} decode + {spec.hybrid} hybrid emulated "
        f"workers, profile `{spec.profile}`, speed ×{spec.speed:g}.  ",
        f"Workload: `{args.workload}` seed {args.seed}, scale {scale:g}, {sessions} main sessions "
        f"({n} with subagents) at every rate, tool gaps ×{args.time_scale:g}; each point may run "
        f"{plan.duration_s:g} s past its last planned session start.  ",
        f"SLO: a session is good when it completes and the p90 of its steps' TTFT is at most "
        f"{args.slo_ttft_p90_s:g} s of emulated time; goodput = offered rate × share of offered "
        "sessions that were good. Errors exclude 429s.",
        "",
        *sizing,
    ]
    section = write_capacity_outputs(
        outcome, plan, header, started, None if args.no_results_md else args.results_md
    )
    print(section)
    return 0 if outcome.points else 1
