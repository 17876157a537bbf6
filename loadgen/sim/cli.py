"""`ownerserve sim`: compare routing policies on a simulated cluster; tables, JSON and plots."""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Hashable
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadgen.capacity import RATED_WORKLOADS, sweep_workload
from loadgen.sim.admission import AdmissionConfig, ProgramGate, RouterAdmission, ThunderAgentGate
from loadgen.sim.engine import ClusterSpec, Simulator
from loadgen.sim.from_workload import Rendering, workload_sessions
from loadgen.sim.workload import SimSession, agentic_sessions, kv_working_set, trace_sessions
from loadgen.workloads import GENERATORS, generate
from ownerserve.errors import ConfigError
from ownerserve.kvstate import KVStateSpec, SwaPolicy, load_spec, swa_policy_from_value
from ownerserve.kvstate.retention import Retention
from ownerserve.profiles import TimingProfile, load_profile
from planner.calibration import Calibrator
from planner.cost import CostConfig

# the load generator's named workloads, but for its `agentic`: here that is the simulator's own
LOADGEN_WORKLOADS = tuple(sorted(name for name in GENERATORS if name != "agentic"))
# the load generator's workloads whose arrival rate can be set (`--rate`, `--rates`)
SIM_RATED = tuple(sorted(name for name in RATED_WORKLOADS if name != "agentic"))

TABLE_COLUMNS = (
    ("policy", "policy", "{}"),
    ("rate_per_min", "rate /min", "{:.0f}"),
    ("goodput_per_min", "goodput /min", "{:.1f}"),
    ("e2e_mean_s", "E2E mean s", "{:.2f}"),
    ("e2e_p95_s", "E2E p95 s", "{:.2f}"),
    ("e2e_p99_s", "E2E p99 s", "{:.2f}"),
    ("ttft_p50_s", "TTFT p50 s", "{:.3f}"),
    ("ttft_p99_s", "TTFT p99 s", "{:.3f}"),
    ("tpot_mean_s", "TPOT ms", "{:.1f}"),
    ("dup_factor", "dup HBM", "{:.2f}"),
    ("network_kv_gb", "net KV GB", "{:.1f}"),
    ("pd_kv_gb", "P→D GB", "{:.1f}"),
    ("prefill_tokens", "prefill Mtok", "{:.1f}"),
    ("decode_interference_s", "interf. s", "{:.0f}"),
    ("owner_hit_rate", "owner hit", "{:.2f}"),
    ("max_concurrent_sessions", "max sessions", "{:.0f}"),
    ("cpu_hit_tokens", "CPU hit Mtok", "{:.1f}"),
    ("queued", "queued", "{}"),
    ("queue_wait_p99_s", "wait p99 s", "{:.2f}"),
    ("rejected", "rejected", "{}"),
    ("rejected_429", "429", "{}"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workers", type=int, default=64, help="cluster size (every worker hybrid: --split)"
    )
    parser.add_argument("--sessions", type=int, default=2000, help="agent sessions to simulate")
    parser.add_argument(
        "--workload",
        default="agentic",
        help="'agentic' (generated coding-agent sessions), 'trace:FILE' (Mooncake JSONL) or a "
        f"load-generator workload ({'|'.join(LOADGEN_WORKLOADS)}), block for block as the "
        "emulated cluster sees it (--sessions keeps the first N)",
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="load-generator workloads: generate's scale"
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="session arrivals per second ('agentic', and the rated load-generator workloads "
        f"{'|'.join(sorted(SIM_RATED))}: main sessions; --sessions then counts those)",
    )
    parser.add_argument(
        "--rates",
        default=None,
        help="sweep: main-session arrival rates per minute, comma list (rated workloads); the "
        "same sessions at every rate, HBM sized once from the highest (--hbm-pressure)",
    )
    parser.add_argument(
        "--trace-repeat", type=int, default=1, help="tile the trace N times (disjoint ids)"
    )
    parser.add_argument(
        "--trace-overlay",
        action="store_true",
        help="the --trace-repeat copies start together (N× the trace's rate) instead of one "
        "after another",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="time multiplier of traces and load-generator workloads",
    )
    parser.add_argument(
        "--policies",
        default="ownerserve,static-pd,colocated,round-robin,prefix-multi-owner,least-loaded,oracle",
        help="comma-separated policies ('oracle' = ownerserve with future knowledge); the peer "
        "routers' models: sglang-cache-aware[-pd], vllm-cache-aware[-pd], vllm-consistent-hash, "
        "vllm-power-of-two, dynamo-kv[-disagg], llm-d[-pd], mooncake-conductor, thunderagent "
        "(Dynamo KV routing under ThunderAgent's program scheduler)",
    )
    parser.add_argument(
        "--split",
        default="0:0:1",
        help="the own policies' cluster: prefill:decode:hybrid shares of --workers (default "
        "0:0:1: every worker hybrid, the aggregated peers' shape, the planner splitting P/D "
        "per request where it pays; 1:1:1 = a third of each role)",
    )
    parser.add_argument(
        "--peer-cluster",
        choices=("native", "same"),
        default="native",
        help="the cluster the peers run on: 'native' = the same worker count in the peer's own "
        "deployment shape (aggregated peers: every worker hybrid; P/D peers: half prefill, half "
        "decode), 'same' = OwnerServe's P:D:H split",
    )
    parser.add_argument(
        "--thunderagent-programs",
        choices=("session", "tree"),
        default="session",
        help="the program ids ThunderAgent's model gets: one per session, a subagent's its own "
        "('session', the default), or one per agent tree, a subagent's its root session's "
        "('tree': it then runs while that program is active)",
    )
    parser.add_argument(
        "--full-view",
        action="store_true",
        help="a check: ownerserve weighs every worker (default: above 64 workers it plans over "
        "its exact candidate subset, planner.candidates, which chooses the same and is faster)",
    )
    parser.add_argument("--profile", default="h100-llama3-8b", help="timing profile")
    parser.add_argument("--hbm-gb", type=float, default=None, help="KV HBM per worker, GB")
    parser.add_argument(
        "--hbm-pressure",
        type=float,
        default=None,
        help="size KV HBM per worker so the workload's working set (at the highest rate) is "
        "this many times the cluster's HBM, but a worker holds the largest session "
        "(`ownerserve bench capacity` uses 3)",
    )
    parser.add_argument(
        "--cpu-blocks",
        type=int,
        default=0,
        help="CPU KV tier per worker, blocks (the emulator's --cpu-num-blocks; 0 = none; "
        "-1 = as many as HBM, the capacity bench's default)",
    )
    parser.add_argument(
        "--block-tokens",
        type=int,
        default=512,
        help="tokens per KV block (the emulated engine's is 16)",
    )
    parser.add_argument(
        "--admission",
        choices=("own", "off"),
        default="own",
        help="the router's admission queue (router/admission.py, its defaults) in front of "
        "the own policies ('own', as the router runs them), or none ('off')",
    )
    parser.add_argument(
        "--lambda-hbm",
        type=float,
        default=None,
        help="the own policies' λ, seconds per duplicated HBM byte (planner.lambda_hbm; "
        "default the planner's)",
    )
    parser.add_argument(
        "--copy-reuse-floor",
        type=float,
        default=None,
        help="the own policies' least reuse rate a copy's X_dup is divided by "
        "(planner.copy_reuse_floor; 1: copies priced as if always reused; default the "
        "planner's)",
    )
    parser.add_argument(
        "--calibration",
        choices=("on", "off"),
        default="on",
        help="the own policies learn per-worker scales and hand-over overheads from each "
        "plan's observed TTFT, TPOT and transfer (planner/calibration.py, as the router's "
        "aftermath feeds it), or plan on the profile alone ('off'); the peers never do",
    )
    parser.add_argument(
        "--admission-max-queued",
        type=int,
        default=AdmissionConfig().max_queued,
        help="the admission queue's bound on new sessions' requests (admission.max_queued; "
        "default %(default)s)",
    )
    parser.add_argument(
        "--admission-max-wait-s",
        type=float,
        default=AdmissionConfig().max_queue_wait_s,
        help="how long a new session's request may wait before its 429 "
        "(admission.max_queue_wait_s; default %(default)s; ThunderAgent's model waits up to "
        "its resume timeout, 1800 s)",
    )
    parser.add_argument(
        "--slo-ttft-p90-s",
        type=float,
        default=2.0,
        help="goodput: a session is good when it completes and the p90 of its steps' TTFT is "
        "at most this (loadgen.capacity's definition)",
    )
    parser.add_argument(
        "--load-scrape-s",
        type=float,
        default=0.0,
        help="age of the workers' kv_usage the policies see: the router scrapes /metrics "
        "every server.health_interval_s (2 s by default); 0 = always current",
    )
    parser.add_argument(
        "--kv-spec",
        default=None,
        help="HeteroCache model spec (configs/models/NAME.yaml, e.g. deepseek-v4, "
        "qwen3-8b-swa): blocks, transfers and restores sized by its parts, the planner sees "
        "it; default: dense, the profile's kv_bytes_per_token",
    )
    parser.add_argument(
        "--swa-policy",
        default=None,
        help="with --kv-spec: the SWA checkpoint policy instead of the spec's own: full, zero, "
        "cost, periodic:N, or lru (no typed parts: every token's window entries cached and "
        "offloaded with its block)",
    )
    parser.add_argument(
        "--retention",
        default=None,
        help="with a hybrid --kv-spec: which boundaries a worker's HBM keeps the windows of "
        "(vLLM's prefix-cache retention interval): full (default, every cached boundary), "
        "zero (each computed prompt's last), or N (every N tokens too); a hit resumes where "
        "they are or rebuilds them (ownerserve.kvstate.resume)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="directory for JSON and plots")


def peer_kv_spec(name: str, spec: KVStateSpec | None) -> KVStateSpec | None:
    """The spec a policy's deployment keeps its KV by. SGLang HiCache offloads only the
    compressed KV (c4, indexer, c128) and re-prefills the SWA tail after a load-back: its
    peers' windows are never checkpointed (zero). The others keep the spec's own policy
    (Dynamo's KV router credits a hybrid prefix per block and tier, as a dense one: its model
    is unchanged, what a restore then costs is the simulator's)."""
    if spec is not None and name.startswith("sglang"):
        return replace(spec, swa_policy=SwaPolicy.zero())
    return spec


def retention_of(args: argparse.Namespace) -> Retention | None:
    """The `--retention` asked for (None: full)."""
    value = getattr(args, "retention", None)
    if value is None:
        return None
    if getattr(args, "kv_spec", None) is None:
        raise SystemExit("ownerserve sim: --retention needs --kv-spec")
    try:
        return Retention.parse(value)
    except ConfigError as exc:
        raise SystemExit(f"ownerserve sim: --retention: {exc}") from None


def kv_spec_of(args: argparse.Namespace) -> tuple[KVStateSpec | None, bool]:
    """(spec, typed state) that `--kv-spec` and `--swa-policy` ask for."""
    name = getattr(args, "kv_spec", None)
    policy = getattr(args, "swa_policy", None)
    if name is None:
        if policy is not None:
            raise SystemExit("ownerserve sim: --swa-policy needs --kv-spec")
        return None, True
    try:
        spec = load_spec(name)
    except ConfigError as exc:
        raise SystemExit(f"ownerserve sim: --kv-spec: {exc}") from None
    if policy is None:
        return spec, True
    if policy == "lru":
        return spec, False
    value: object = policy
    if policy.startswith("periodic:"):
        try:
            value = {"periodic": int(policy.split(":", 1)[1])}
        except ValueError:
            value = policy
    try:
        return replace(spec, swa_policy=swa_policy_from_value(value, "--swa-policy")), True
    except ConfigError as exc:
        raise SystemExit(f"ownerserve sim: {exc}") from None


def _workload(args: argparse.Namespace, rate_per_min: float | None = None) -> list[SimSession]:
    if args.workload in SIM_RATED and rate_per_min:
        w = sweep_workload(
            args.workload, args.seed, args.scale, args.sessions, rate_per_min, args.time_scale
        )
        return workload_sessions(w, Rendering(block_size=args.block_tokens))
    if args.workload.startswith("trace:"):
        return trace_sessions(
            args.workload[6:],
            time_scale=args.time_scale,
            repeat=args.trace_repeat,
            overlay=args.trace_overlay,
        )[: args.sessions]
    if args.workload in LOADGEN_WORKLOADS:
        w = generate(args.workload, args.seed, args.scale).scaled(args.time_scale)
        return workload_sessions(w, Rendering(block_size=args.block_tokens))[: args.sessions]
    if args.workload != "agentic":
        raise SystemExit(f"ownerserve sim: unknown workload {args.workload!r}")
    rate = args.rate if args.rate is not None else max(0.01, args.workers * 0.01)
    return agentic_sessions(args.sessions, rate, seed=args.seed)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    head = "| " + " | ".join(title for _, title, _ in TABLE_COLUMNS) + " |"
    sep = "|" + "---|" * len(TABLE_COLUMNS)
    lines = [head, sep]
    for r in rows:
        cells = []
        for key, _, fmt in TABLE_COLUMNS:
            val = r[key]
            if key == "tpot_mean_s":
                val = val * 1e3
            if key in ("prefill_tokens", "cpu_hit_tokens"):
                val = val / 1e6
            cells.append(fmt.format(val))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def peer_spec(spec: ClusterSpec, name: str) -> ClusterSpec:
    """The peer's own deployment shape with `spec`'s worker count: aggregated peers on hybrid
    workers only, P/D peers on half prefill and half decode workers."""
    from planner.policies.peers import DISAGGREGATED

    n = spec.total
    if name in DISAGGREGATED:
        return replace(spec, prefill=n // 2, decode=n - n // 2, hybrid=0)
    return replace(spec, prefill=0, decode=0, hybrid=n)


def cluster_spec(
    args: argparse.Namespace, profile: TimingProfile, sizing: list[SimSession] | None = None
) -> ClusterSpec:
    """The cluster `args` ask for; with `--hbm-pressure`, its HBM sized from `sizing`'s
    working set (`kv_working_set`) as `ownerserve bench capacity` sizes the emulated one."""
    if args.load_scrape_s < 0:
        raise SystemExit("ownerserve sim: --load-scrape-s must be >= 0")
    bt = args.block_tokens
    block_bytes = profile.kv_bytes_per_token * bt
    hbm = int(args.hbm_gb * 1e9) if args.hbm_gb else None
    if args.hbm_pressure:
        if args.hbm_pressure <= 0:
            raise SystemExit("ownerserve sim: --hbm-pressure must be > 0")
        peak, largest = kv_working_set(sizing or [], profile, bt)
        blocks = max(math.ceil(peak / (args.hbm_pressure * args.workers)), largest, 1)
        hbm = blocks * block_bytes
    hbm_blocks = (hbm if hbm is not None else profile.hbm_kv_bytes) // block_bytes
    cpu = hbm_blocks if args.cpu_blocks == -1 else args.cpu_blocks
    if cpu < 0:
        raise SystemExit("ownerserve sim: --cpu-blocks must be >= 0 (or -1: as many as HBM)")
    spec = ClusterSpec.of_size(args.workers, block_tokens=bt, hbm_kv_bytes=hbm, cpu_blocks=cpu)
    roles = split_roles(args.split, args.workers)
    return replace(
        spec,
        prefill=roles["prefill"],
        decode=roles["decode"],
        hybrid=roles["hybrid"],
        load_scrape_s=args.load_scrape_s,
    )


def split_roles(split: str, n: int) -> dict[str, int]:
    """`n` workers by `split`'s prefill:decode:hybrid shares (the remainder to hybrid, or to
    the last non-zero role)."""
    try:
        shares = [float(x) for x in split.split(":")]
    except ValueError:
        shares = []
    if len(shares) != 3 or min(shares) < 0 or sum(shares) <= 0:
        raise SystemExit(f"ownerserve sim: --split {split!r}: three shares P:D:H, e.g. 1:1:1")
    total = sum(shares)
    counts = [int(n * x / total) for x in shares]
    last = max(i for i, x in enumerate(shares) if x > 0)
    counts[last] += n - sum(counts)
    return dict(zip(("prefill", "decode", "hybrid"), counts, strict=True))


def gate_for(
    name: str,
    policy: Any,
    sim: Simulator,
    admission: str,
    config: AdmissionConfig | None = None,
    thunderagent_programs: str = "session",
) -> ProgramGate | None:
    """The program-level gate in front of policy `name` on `sim`'s cluster: ThunderAgent's
    program scheduler for its model (`thunderagent_programs` 'tree': a subagent is part of
    its root session's program), the router's admission queue for the own policies
    (`admission` 'own'), none for the other peers."""
    from planner.policies.peers import PEERS, ThunderAgentPolicy

    decoders = [w for w in sim.workers if w.role.value != "prefill"] or sim.workers
    bt = sim.spec.block_tokens
    if isinstance(policy, ThunderAgentPolicy):
        # its retention budget: HBM plus the host tier (Dynamo's port counts SGLang HiCache's)
        cpu = sim.spec.cpu_blocks
        return ThunderAgentGate(
            policy.scheduler({w.wid: (w.capacity + cpu) * bt for w in decoders}),
            tree=thunderagent_programs == "tree",
        )
    if name in PEERS or admission == "off":
        return None
    by_id = sim.by_id

    def usage(wid: str) -> float:
        w = by_id[wid]
        return w.decode_ctx / (w.capacity * bt)

    ws = sim.ws

    def programs(wid: str, now: float) -> float:
        return ws.tokens(wid, now) / ((by_id[wid].capacity + sim.spec.cpu_blocks) * bt)

    def sessions(wid: str, now: float) -> int:
        return ws.sessions(wid, now)

    def home(session: Hashable, now: float) -> str | None:
        return ws.home(str(session), now)[0]

    def release(session: Hashable, now: float) -> None:
        ws.release(str(session), now)

    gate = RouterAdmission(
        [w.wid for w in decoders],
        usage,
        config or AdmissionConfig(),
        programs=programs,
        sessions=sessions,
        home=home,
        release=release,
    )
    sim.closed_to_programs = gate.closed_to_programs
    return gate


def run_policies(
    args: argparse.Namespace,
    sessions: list[SimSession],
    spec: ClusterSpec | None = None,
    rate_per_min: float | None = None,
) -> list[dict[str, Any]]:
    from planner.policies import get_policy
    from planner.policies.peers import PEERS

    profile = load_profile(args.profile)
    spec = spec or cluster_spec(args, profile, sessions)
    kv_spec, typed = kv_spec_of(args)
    retention = retention_of(args)
    rows = []
    for name in [p.strip() for p in args.policies.split(",") if p.strip()]:
        oracle = name == "oracle"
        own = name not in PEERS
        tuned = None
        if own and (args.lambda_hbm is not None or args.copy_reuse_floor is not None):
            dflt = CostConfig()
            tuned = replace(
                dflt,
                lam=dflt.lam if args.lambda_hbm is None else args.lambda_hbm,
                copy_reuse_floor=dflt.copy_reuse_floor
                if args.copy_reuse_floor is None
                else args.copy_reuse_floor,
            )
        policy = get_policy("ownerserve" if oracle else name, tuned)
        peer = name in PEERS
        # a peer's binary weighs every worker it routes to: its model sees them all
        sim = Simulator(
            peer_spec(spec, name) if peer and args.peer_cluster == "native" else spec,
            profile,
            policy,
            seed=args.seed,
            oracle=oracle,
            full_view=peer or args.full_view,
            slo_ttft_p90_s=args.slo_ttft_p90_s,
            rate_per_min=rate_per_min,
            working_set_views=not peer,  # the peers do not read them
            calibrator=Calibrator() if not peer and args.calibration == "on" else None,
            kv_spec=peer_kv_spec(name, kv_spec),
            typed_state=typed,
            retention=retention,
        )
        sim.gate = gate_for(
            name,
            policy,
            sim,
            args.admission,
            AdmissionConfig(
                max_queued=args.admission_max_queued, max_queue_wait_s=args.admission_max_wait_s
            ),
            args.thunderagent_programs,
        )
        summary = sim.run(sessions).summary()
        summary["policy"] = name
        rows.append(summary)
        print(
            f"  {name:<20} {summary['requests']:>8} req  {summary['events']:>9} events  "
            f"{summary['wall_s']:6.1f}s wall  {summary['events_per_s']:>9.0f} ev/s  "
            f"goodput {summary['goodput_per_min']:.1f}/min  E2E {summary['e2e_mean_s']:.2f}s",
            flush=True,
        )
    return rows


def main_rows(argv: list[str]) -> list[dict[str, Any]]:
    """Run `ownerserve sim` with `argv` and return the summary rows (for scripts and tests)."""
    parser = argparse.ArgumentParser(prog="ownerserve sim")
    add_arguments(parser)
    return _run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    _run(args)
    return 0


def _rates(args: argparse.Namespace) -> list[float | None]:
    """The sweep's rates (main sessions per minute), or [--rate × 60], or [None]."""
    if args.rates:
        try:
            rates = sorted({float(x) for x in args.rates.split(",") if x.strip()})
        except ValueError:
            raise SystemExit(
                f"ownerserve sim: --rates {args.rates!r}: numbers, comma list"
            ) from None
        if not rates or rates[0] <= 0 or args.workload not in SIM_RATED:
            raise SystemExit(
                "ownerserve sim: --rates takes rates > 0 and a rated workload "
                f"({'|'.join(sorted(SIM_RATED))})"
            )
        return list(rates)
    return [args.rate * 60.0 if args.rate is not None else None]


def _run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rates = _rates(args)
    profile = load_profile(args.profile)
    # the same sessions at every rate; the cluster sized once, from the highest rate
    t0 = time.perf_counter()
    top = _workload(args, rates[-1])
    top_s = time.perf_counter() - t0
    spec = cluster_spec(args, profile, top)
    rows = []
    for rate in rates:
        t0 = time.perf_counter()
        sessions = top if rate == rates[-1] else _workload(args, rate)
        built_s = top_s if rate == rates[-1] else time.perf_counter() - t0
        print(
            f"ownerserve sim: {len(sessions)} sessions, {args.workers} workers, workload "
            f"{args.workload}{f' at {rate:g}/min' if rate else ''}, HBM "
            f"{(spec.hbm_kv_bytes or profile.hbm_kv_bytes) / 1e9:.2f} GB + CPU "
            f"{spec.cpu_blocks} blocks per worker (built in {built_s:.1f}s)",
            flush=True,
        )
        rows.extend(run_policies(args, sessions, spec, rate))
    print()
    print(markdown_table(rows))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sim.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
        from loadgen.sim.plots import plot_rates, plot_rows

        plot_rows(rows, out)
        plot_rates(rows, out)
        print(f"\nwrote {out}/sim.json and plots")
    return rows
