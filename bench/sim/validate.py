"""Simulator validation: the same agentic workload through the real router on an
emulated cluster and through the cluster simulator, policy by policy, side by side.

    .venv/bin/python -m bench.sim.validate [--speed 1] [--sessions 24] [--rate 1.0]
        [--policies ownerserve,static-pd,...] [--out bench/results/sim-validation]
        [--results-md bench/history/sim_validation.md]

Emulated side: a 2P/2D/2H cluster of `python -m workers.emulator` processes (profile
h100-llama3-8b at `--speed`), restarted cold before each policy, `ownerserve serve` with that
policy in front, the workload replayed with arrivals and tool gaps ×1/speed (so the emulated GPU
time and the gaps keep their proportions); latencies are wall × speed. Simulated side:
`loadgen.sim.Simulator` on `ClusterSpec(2, 2, 2, block_tokens=16, hbm_kv_bytes=<the emulator's
KV capacity>)` with the same profile and the same sessions (`loadgen.sim.from_workload`: the
emulator's block hashes). Compared per policy: mean session E2E, prefill tokens computed, KV
bytes moved (P->D + fetch), HBM duplicate factor, plus the planner's action counts; then the
ranking of policies by each metric (Kendall tau) and the relative error against the tolerance.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadgen.bench import OWN_POLICIES, machine_line, replace_section
from loadgen.client import RunOptions, run_workload
from loadgen.cluster import REPO_ROOT, ClusterSpec, EmulatedCluster, start_ownerserve
from loadgen.metrics import DuplicateSampler, cluster_stats, snapshot_all
from loadgen.report import summarize, write_records
from loadgen.sim.engine import ClusterSpec as SimClusterSpec
from loadgen.sim.engine import Simulator
from loadgen.sim.from_workload import workload_sessions
from loadgen.workloads import AgenticParams, Workload, agentic
from ownerserve.profiles import load_profile
from planner.policies import get_policy

SECTION = "## Simulator validation"
METRICS: tuple[tuple[str, str], ...] = (
    ("e2e_mean_s", "mean session E2E s"),
    ("prefill_tokens", "prefill tokens"),
    ("kv_bytes", "KV bytes moved"),
    ("dup_factor", "dup HBM"),
)
E2E_TOLERANCE = 0.25
"""Largest relative gap |sim − emulated| / emulated accepted for mean session E2E."""
COUNT_TOLERANCE = 0.25
"""The same for prefill tokens, KV bytes moved and the duplicate factor."""
E2E_TAU_MIN = 0.6
"""Kendall tau of the policies' order by mean session E2E that counts as agreeing rankings."""
NOISE_TIE = 0.03
"""Pairs of policies whose emulated means differ by less than this fraction are ties: the
emulated cluster's run-to-run noise on this shared machine is about that large."""


# --- comparison (pure) ------------------------------------------------------------------------


def kendall_tau(a: Sequence[float], b: Sequence[float], tie: float = 0.0) -> float | None:
    """Kendall's tau-b of two paired samples; values within `tie` (relative) count as ties."""
    n = len(a)
    if n != len(b):
        raise ValueError("kendall_tau: samples of different length")

    def sign(x: float, y: float) -> int:
        scale = max(abs(x), abs(y))
        if scale == 0 or abs(x - y) <= tie * scale:
            return 0
        return 1 if x > y else -1

    conc = disc = ties_a = ties_b = 0
    for i in range(n):
        for j in range(i + 1, n):
            sa, sb = sign(a[i], a[j]), sign(b[i], b[j])
            if sa == 0 and sb == 0:
                continue
            if sa == 0:
                ties_a += 1
            elif sb == 0:
                ties_b += 1
            elif sa == sb:
                conc += 1
            else:
                disc += 1
    denom = math.sqrt((conc + disc + ties_a) * (conc + disc + ties_b))
    return (conc - disc) / denom if denom else None


def rel_gap(sim: float | None, emu: float | None) -> float | None:
    """(sim − emulated) / emulated; 0 when both are 0, None when not comparable."""
    if sim is None or emu is None:
        return None
    if emu == 0:
        return 0.0 if sim == 0 else None
    return (sim - emu) / emu


class Compared:
    """A row of metrics measured twice, on emulated workers and in the simulator (metric name
    to value in `emulated` and `simulated`), and their gaps."""

    __slots__ = ()
    emulated: dict[str, Any]
    simulated: dict[str, Any]

    def gap(self, key: str) -> float | None:
        """`rel_gap` of metric `key`: (simulated − emulated) / emulated."""
        return rel_gap(self.simulated.get(key), self.emulated.get(key))


@dataclass
class PolicyRow(Compared):
    policy: str
    emulated: dict[str, Any]
    simulated: dict[str, Any]


@dataclass
class Verdict:
    taus: dict[str, float | None]
    max_gaps: dict[str, float | None]
    e2e_rank_ok: bool
    e2e_values_ok: bool
    counts_ok: dict[str, bool]
    notes: list[str] = field(default_factory=list)


def judge(rows: Sequence[PolicyRow]) -> Verdict:
    """Rankings (Kendall tau, emulated near-ties as ties) and worst relative gaps per metric."""
    taus: dict[str, float | None] = {}
    gaps: dict[str, float | None] = {}
    for key, _ in METRICS:
        pairs = [
            (r.emulated[key], r.simulated[key])
            for r in rows
            if r.emulated.get(key) is not None and r.simulated.get(key) is not None
        ]
        tie = NOISE_TIE if key == "e2e_mean_s" else 0.0
        taus[key] = (
            kendall_tau([e for e, _ in pairs], [s for _, s in pairs], tie)
            if len(pairs) >= 2
            else None
        )
        gs = [abs(g) for r in rows if (g := r.gap(key)) is not None]
        gaps[key] = max(gs) if gs else None
    tau_e2e = taus["e2e_mean_s"]
    gap_e2e = gaps["e2e_mean_s"]
    counts_ok = {
        key: (g is not None and g <= COUNT_TOLERANCE)
        for key, g in gaps.items()
        if key != "e2e_mean_s"
    }
    return Verdict(
        taus=taus,
        max_gaps=gaps,
        e2e_rank_ok=tau_e2e is not None and tau_e2e >= E2E_TAU_MIN,
        e2e_values_ok=gap_e2e is not None and gap_e2e <= E2E_TOLERANCE,
        counts_ok=counts_ok,
    )


# --- the two sides ----------------------------------------------------------------------------


def make_workload(sessions: int, rate: float, seed: int) -> Workload:
    return agentic(AgenticParams(sessions=sessions, rate_per_s=rate), seed=seed)


ROUTER_SCRAPE_S = 2.0
"""The router's `server.health_interval_s` default: how often it scrapes the workers' load."""


def simulate(
    workload: Workload,
    policies: Sequence[str],
    profile_name: str,
    capacity_blocks: int,
    load_scrape_s: float = ROUTER_SCRAPE_S,
) -> dict[str, dict[str, Any]]:
    """Per policy: the simulator's numbers for `workload` on the 2P/2D/2H cluster."""
    profile = load_profile(profile_name)
    sessions = workload_sessions(workload)
    block_bytes = 16 * profile.kv_bytes_per_token
    spec = SimClusterSpec(
        2,
        2,
        2,
        block_tokens=16,
        hbm_kv_bytes=capacity_blocks * block_bytes,
        load_scrape_s=load_scrape_s,
    )
    out: dict[str, dict[str, Any]] = {}
    for name in policies:
        res = Simulator(spec, profile, get_policy(name)).run(sessions)
        s = res.summary()
        out[name] = {
            "e2e_mean_s": s["e2e_mean_s"],
            "ttft_mean_s": sum(res.ttft_s) / len(res.ttft_s) if res.ttft_s else None,
            "tpot_mean_s": s["tpot_mean_s"],
            "prefill_tokens": res.prefill_tokens,
            "kv_bytes": res.pd_kv_bytes + res.fetch_kv_bytes,
            "dup_factor": res.dup_factor,
            "actions": s["actions"],
            "requests": res.requests,
            "sessions": len(res.session_e2e_s),
            "wall_s": res.wall_s,
        }
    return out


def _counter(snaps: Sequence[Any], name: str) -> float:
    return sum(v for s in snaps if (v := s.get(name)) is not None)


async def _emulate_one(
    router_url: str,
    urls: list[str],
    workload: Workload,
    speed: float,
    label: str,
    records: Path | None = None,
) -> dict[str, Any]:
    before = await snapshot_all(urls, with_hashes=False)
    sampler = DuplicateSampler(urls, 1.0)
    sampler.start()
    opts = RunOptions(
        target=router_url,
        model="ownerserve-tiny",
        max_inflight=64,
        duration_s=300.0,
        request_timeout_s=300.0,
        label=label,
        progress=False,
    )
    try:
        result = await run_workload(workload.scaled(1.0 / speed), opts)
    finally:
        samples = await sampler.stop()
    after = await snapshot_all(urls)
    if records is not None:
        write_records(result, records)
    stats = cluster_stats(after, before, samples)
    summary = summarize(result, cluster=stats)
    p = "ownerserve_emulator_"
    busy = _counter(after, f"{p}engine_busy_seconds_total") - _counter(
        before, f"{p}engine_busy_seconds_total"
    )
    active = _counter(after, f"{p}engine_active_seconds_total") - _counter(
        before, f"{p}engine_active_seconds_total"
    )
    late = _counter(after, f"{p}engine_late_seconds_total") - _counter(
        before, f"{p}engine_late_seconds_total"
    )
    e2e = summary.session_e2e.mean
    ttft = summary.ttft.mean
    tpot = summary.tpot.mean
    return {
        "e2e_mean_s": None if e2e is None else e2e * speed,
        "ttft_mean_s": None if ttft is None else ttft * speed,
        "tpot_mean_s": None if tpot is None else tpot * speed,
        "prefill_tokens": stats.prefill_tokens_computed,
        "kv_bytes": stats.kv_bytes_moved,
        "dup_factor": stats.duplicate_factor,
        "actions": summary.actions,
        "requests": summary.requests,
        "errors": summary.errors,
        "sessions": summary.sessions_completed,
        "wall_s": result.wall_s,
        # modelled engine time / (wall time stepping × speed): 1.0 = the emulator kept time
        "timing_fidelity": busy / (active * speed) if active else None,
        "late_s": late,
    }


def emulate(
    workload: Workload,
    policies: Sequence[str],
    profile: str,
    speed: float,
    log_dir: Path,
    log: Callable[[str], None],
) -> tuple[dict[str, dict[str, Any]], int]:
    """Per policy: the emulated cluster's numbers; also the workers' KV capacity in blocks."""
    spec = ClusterSpec(2, 2, 2, profile=profile, speed=speed)
    cluster = EmulatedCluster(spec, log_dir)
    out: dict[str, dict[str, Any]] = {}
    capacity = 0
    try:
        for name in policies:
            t0 = time.monotonic()
            cluster.restart()
            router = start_ownerserve(cluster, name, log_dir)
            try:
                urls = [w.url for w in cluster.workers]
                records = log_dir / f"records_{name}.jsonl"
                row = asyncio.run(_emulate_one(router.url, urls, workload, speed, name, records))
                if not capacity:
                    capacity = asyncio.run(worker_capacity_blocks(urls[0]))
            finally:
                router.stop()
            out[name] = row
            log(
                f"  emulated {name:<20} E2E {row['e2e_mean_s']:.2f} s, "
                f"{row['sessions']} sessions, {row['errors']} errors, "
                f"fidelity {row['timing_fidelity'] or 0:.2f}, {time.monotonic() - t0:.0f} s"
            )
    finally:
        cluster.stop()
    return out, capacity


async def worker_capacity_blocks(url: str) -> int:
    """An emulated worker's HBM KV capacity in blocks (its `/kv_blocks`)."""
    import httpx

    async with httpx.AsyncClient(timeout=10.0) as client:
        data = (await client.get(url + "/kv_blocks")).json()
    return int(data["capacity_blocks"])


# --- report -----------------------------------------------------------------------------------


def cell(key: str, v: Any) -> str:
    """A metric's value for the tables (GB, k tokens, or two decimals; – when missing)."""
    if v is None:
        return "–"
    if key == "kv_bytes":
        return f"{v / 1e9:.2f} GB"
    if key == "prefill_tokens":
        return f"{v / 1e3:.0f} k"
    return f"{v:.2f}"


def pct(g: float | None) -> str:
    """A relative gap as a signed percentage (– when missing)."""
    return "–" if g is None else f"{g:+.0%}"


def markdown(rows: Sequence[PolicyRow], verdict: Verdict) -> str:
    """The side-by-side table, the diagnostics and the verdict (also for the baselines alone:
    every own policy but `ownerserve`, whose router-side decisions differ, see the notes)."""
    head = (
        "| policy | "
        + " | ".join(f"{title} emu / sim (gap)" for _, title in METRICS)
        + " | actions emulated | actions simulated |"
    )
    lines = [head, "|---|" + "---|" * (len(METRICS) + 2)]
    for r in rows:
        cells = [
            f"{cell(k, r.emulated.get(k))} / {cell(k, r.simulated.get(k))} ({pct(r.gap(k))})"
            for k, _ in METRICS
        ]
        acts = [
            ", ".join(f"{a} {n}" for a, n in sorted(d.get("actions", {}).items()))
            for d in (r.emulated, r.simulated)
        ]
        lines.append(f"| {r.policy} | " + " | ".join(cells + acts) + " |")
    lines += [
        "",
        "| policy | TTFT mean s emu / sim | TPOT mean ms emu / sim | emulator timing fidelity |",
        "|---|---|---|---|",
    ]
    for r in rows:
        e, m = r.emulated, r.simulated

        def ms(v: Any) -> str:
            return "–" if v is None else f"{v * 1e3:.1f}"

        lines.append(
            f"| {r.policy} | {cell('', e.get('ttft_mean_s'))} / {cell('', m.get('ttft_mean_s'))}"
            f" | {ms(e.get('tpot_mean_s'))} / {ms(m.get('tpot_mean_s'))}"
            f" | {cell('', e.get('timing_fidelity'))} |"
        )
    lines += ["", "| metric | Kendall tau (emu vs sim order) | worst gap | tolerance | met |"]
    lines.append("|---|---|---|---|---|")
    for key, title in METRICS:
        tau = verdict.taus.get(key)
        gap = verdict.max_gaps.get(key)
        if key == "e2e_mean_s":
            tol = f"tau ≥ {E2E_TAU_MIN} (ties < {NOISE_TIE:.0%}), gap ≤ {E2E_TOLERANCE:.0%}"
            met = verdict.e2e_rank_ok and verdict.e2e_values_ok
        else:
            tol = f"gap ≤ {COUNT_TOLERANCE:.0%}"
            met = verdict.counts_ok.get(key, False)
        tau_s = "–" if tau is None else f"{tau:.2f}"
        lines.append(f"| {title} | {tau_s} | {pct(gap)} | {tol} | {'yes' if met else '**no**'} |")
    base = [r for r in rows if r.policy != "ownerserve"]
    if len(base) < len(rows) and len(base) >= 2:
        vb = judge(base)
        tau = vb.taus.get("e2e_mean_s")
        met = vb.e2e_rank_ok and vb.e2e_values_ok
        lines.append(
            f"| mean session E2E s, baselines only | {'–' if tau is None else f'{tau:.2f}'} | "
            f"{pct(vb.max_gaps.get('e2e_mean_s'))} | the same | {'yes' if met else '**no**'} |"
        )
    return "\n".join(lines)


def section(runs: Sequence[dict[str, Any]], notes: str = "") -> str:
    """The `bench/RESULTS.md` section for saved runs (the JSON this script writes)."""
    out = [
        SECTION,
        "",
        "The same agentic workload through the real router (`ownerserve serve`, one policy at a "
        "time) on 2 prefill + 2 decode + 2 hybrid emulated workers (profile h100-llama3-8b), "
        "and through the simulator (`ClusterSpec(2, 2, 2, block_tokens=16, hbm_kv_bytes=<the "
        "emulator's 19,073 blocks>, load_scrape_s=2)`, same profile, sessions converted block "
        "for block by `loadgen.sim.from_workload`). Emulated latencies are wall × speed; the "
        "workers restart cold before each policy. Gap = (sim − emulated) / emulated.",
        "",
    ]
    for run in runs:
        meta = run["meta"]
        wl = meta["workload"]
        rows = [PolicyRow(r["policy"], r["emulated"], r["simulated"]) for r in run["rows"]]
        fid = meta.get("timing_fidelity")
        out += [
            f"### {wl['sessions']} agent sessions at {wl['rate_per_s']:g}/s "
            f"({wl['requests']} requests, seed {wl['seed']})",
            "",
            f"Command: `{meta['command']}`  ",
            f"Date: {meta['date']}, wall time {meta['wall_s'] / 60:.1f} min, speed "
            f"×{meta['speed']:g}, emulator timing fidelity "
            + (f"{fid[0]:.3f}–{fid[1]:.3f}" if fid else "–")
            + "  ",
            f"Machine: {meta['machine']}"
            + (
                f"  \nSimulated side recomputed {meta['simulated_at']} with the current "
                f"simulator (`--resimulate`, load_scrape_s={meta['load_scrape_s']:g})"
                if "simulated_at" in meta
                else ""
            ),
            "",
            markdown(rows, judge(rows)),
            "",
        ]
    if notes:
        out += [notes.strip(), ""]
    return "\n".join(out)


def resimulate(path: Path, out_dir: Path, load_scrape_s: float) -> Path:
    """A saved run with its simulated side recomputed (same workload, same emulated side);
    written next to it as `<stem>_resim.json`."""
    data = json.loads(path.read_text())
    meta = data["meta"]
    wl = meta["workload"]
    workload = make_workload(wl["sessions"], wl["rate_per_s"], wl["seed"])
    policies = [r["policy"] for r in data["rows"]]
    sim = simulate(workload, policies, meta["profile"], meta["capacity_blocks"], load_scrape_s)
    for r in data["rows"]:
        r["simulated"] = sim[r["policy"]]
    rows = [PolicyRow(r["policy"], r["emulated"], r["simulated"]) for r in data["rows"]]
    v = judge(rows)
    data["verdict"] = {
        "taus": v.taus,
        "max_gaps": v.max_gaps,
        "e2e_rank_ok": v.e2e_rank_ok,
        "e2e_values_ok": v.e2e_values_ok,
        "counts_ok": v.counts_ok,
    }
    meta["simulated_at"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    meta["load_scrape_s"] = load_scrape_s
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{path.stem}_resim.json"
    target.write_text(json.dumps(data, indent=2))
    print(f"wrote {target}")
    return target


def add_run_args(ap: argparse.ArgumentParser, *, notes: str, results_md_help: str) -> None:
    """The options a validation run shares with `bench.sim.validate_peers`: the profile, the
    simulator-only switch, where results, logs and the RESULTS.md section go, and the notes file
    (`notes`, beside this module) appended to the section."""
    ap.add_argument("--profile", default="h100-llama3-8b")
    ap.add_argument("--sim-only", action="store_true", help="only the simulator side")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "sim-validation")
    ap.add_argument("--results-md", type=Path, default=None, help=results_md_help)
    ap.add_argument("--log-dir", type=Path, default=None)
    ap.add_argument(
        "--notes",
        type=Path,
        default=Path(__file__).with_name(notes),
        help="Markdown appended to the section (the findings behind the numbers)",
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--policies", default=",".join(OWN_POLICIES))
    ap.add_argument("--speed", type=float, default=1.0, help="emulated time runs N× faster")
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--rate", type=float, default=1.0, help="session arrivals per (GPU) second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--capacity-blocks", type=int, default=None, help="with --sim-only")
    add_run_args(ap, notes="validation_notes.md", results_md_help="write the RESULTS.md section")
    ap.add_argument(
        "--section",
        type=Path,
        nargs="+",
        default=None,
        help="only write the RESULTS.md section from these saved runs (JSON)",
    )
    ap.add_argument(
        "--load-scrape-s",
        type=float,
        default=ROUTER_SCRAPE_S,
        help="how stale the simulated policies' kv_usage is (the router's scrape interval)",
    )
    ap.add_argument(
        "--resimulate",
        type=Path,
        nargs="+",
        default=None,
        help="recompute the simulated side of saved runs (JSON) with the current simulator",
    )
    args = ap.parse_args(argv)
    if args.resimulate:
        for path in args.resimulate:
            resimulate(path, args.out, args.load_scrape_s)
        return 0
    if args.section:
        runs = [json.loads(p.read_text()) for p in args.section]
        notes = args.notes.read_text() if args.notes.exists() else ""
        text = section(runs, notes)
        if args.results_md is not None:
            replace_section(args.results_md, SECTION, text)
        print(text)
        return 0
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    workload = make_workload(args.sessions, args.rate, args.seed)
    started = dt.datetime.now(dt.UTC)
    t0 = time.monotonic()
    emulated: dict[str, dict[str, Any]] = {}
    capacity = args.capacity_blocks or 0
    if not args.sim_only:
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="ownerserve-simval-"))
        log(f"process logs: {log_dir}")
        emulated, capacity = emulate(workload, policies, args.profile, args.speed, log_dir, log)
    if not capacity:
        prof = load_profile(args.profile)
        capacity = int(prof.hbm_kv_bytes // (16 * prof.kv_bytes_per_token))
    simulated = simulate(workload, policies, args.profile, capacity, args.load_scrape_s)
    rows = [PolicyRow(p, emulated.get(p, {}), simulated[p]) for p in policies]
    verdict = judge(rows)
    table = markdown(rows, verdict)
    wall = time.monotonic() - t0
    fid = [r.emulated["timing_fidelity"] for r in rows if r.emulated.get("timing_fidelity")]
    command = "python -m bench.sim.validate " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    meta = {
        "command": command,
        "date": started.isoformat(timespec="seconds"),
        "machine": machine_line(),
        "wall_s": wall,
        "speed": args.speed,
        "profile": args.profile,
        "workload": {
            "generator": "agentic",
            "sessions": args.sessions,
            "rate_per_s": args.rate,
            "seed": args.seed,
            "requests": workload.n_requests,
        },
        "capacity_blocks": capacity,
        "load_scrape_s": args.load_scrape_s,
        "timing_fidelity": [min(fid), max(fid)] if fid else None,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    data = {
        "meta": meta,
        "rows": [
            {"policy": r.policy, "emulated": r.emulated, "simulated": r.simulated} for r in rows
        ],
        "verdict": {
            "taus": verdict.taus,
            "max_gaps": verdict.max_gaps,
            "e2e_rank_ok": verdict.e2e_rank_ok,
            "e2e_values_ok": verdict.e2e_values_ok,
            "counts_ok": verdict.counts_ok,
        },
    }
    (args.out / f"validation_{stamp}.json").write_text(json.dumps(data, indent=2))
    (args.out / f"validation_{stamp}.md").write_text(table + "\n")
    print(table)
    print(f"\nwall {wall:.0f} s; timing fidelity {meta['timing_fidelity']}")
    if args.results_md is not None:
        notes = args.notes.read_text() if args.notes.exists() else ""
        replace_section(args.results_md, SECTION, section([data], notes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
