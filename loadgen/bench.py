"""The agentic benchmark: one emulated xPyD cluster, the same workload through every routing
policy of OwnerServe and through the peer routers, side by side.

For each target the workers are restarted (caches start cold), the router is started in front of
them, the workload is replayed, and the workers' counters give prefill tokens computed, prefix hit
rate, KV bytes moved and the HBM duplicate factor (sampled during the run). The same is done for
the Mooncake trace, scaled to fit the machine. Results: JSON, Markdown tables and plots under
`bench/results/`, and a dated section appended to `bench/history/agentic.md` (the current table in
`bench/RESULTS.md` is updated by hand from it).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from loadgen.client import RunOptions, RunResult, run_workload
from loadgen.cluster import (
    PEER_MODES,
    ClusterSpec,
    EmulatedCluster,
    ProcessFailedError,
    RouterProcess,
    start_ownerserve,
    start_peer,
)
from loadgen.metrics import (
    DuplicateSampler,
    P,
    RouterQueueSampler,
    WorkerSnapshot,
    cluster_stats,
    snapshot_all,
)
from loadgen.peers import peer_binary
from loadgen.report import RunSummary, markdown_tables, summarize, write_records, write_report
from loadgen.workloads import Workload

OWN_POLICIES: tuple[str, ...] = (
    "ownerserve",
    "static-pd",
    "colocated",
    "round-robin",
    "prefix-multi-owner",
    "least-loaded",
)
PEER_LABELS: tuple[str, ...] = tuple(PEER_MODES)


@dataclass(frozen=True, slots=True)
class Target:
    """One thing to benchmark: an own policy or a peer router mode."""

    label: str
    kind: str  # "own" | "peer"


@dataclass
class BenchPlan:
    spec: ClusterSpec
    targets: list[Target]
    workloads: list[tuple[str, Workload]]
    out_dir: Path
    max_inflight: int = 64
    run_limit_s: float = 120.0
    sample_interval_s: float = 2.0
    log_dir: Path | None = None
    """Process logs and per-request records (default: `out_dir/logs`)."""
    planner: dict[str, object] = field(default_factory=dict)
    """Planner settings for the own policies beyond the policy name (e.g. `lambda_hbm`)."""
    log: Callable[[str], None] = field(default=lambda msg: print(msg, file=sys.stderr, flush=True))


@dataclass
class WorkloadOutcome:
    name: str
    summaries: list[RunSummary]
    results: list[RunResult]
    skipped: dict[str, str]


class TargetUnavailableError(RuntimeError):
    """The target's router (or the restarted workers) did not start; the message says why."""


@dataclass(frozen=True, slots=True)
class MeasureOptions:
    """How one run drives its router and samples the cluster."""

    max_inflight: int = 64
    run_limit_s: float = 120.0
    sample_interval_s: float = 2.0


def start_target(
    target: Target, cluster: EmulatedCluster, log_dir: Path, planner: Mapping[str, object]
) -> RouterProcess:
    """The target's router in front of `cluster` (an own policy through `ownerserve serve`)."""
    if target.kind == "own":
        return start_ownerserve(cluster, target.label, log_dir, planner=planner)
    peer = PEER_MODES[target.label][0]
    return start_peer(peer_binary(peer), target.label, cluster, log_dir)


async def measure(
    router: RouterProcess, cluster: EmulatedCluster, workload: Workload, opts: MeasureOptions
) -> tuple[RunResult, RunSummary]:
    """Replay `workload` through `router`; the workers' counters over the run (and the HBM
    duplicate factor and the router's admission queue, sampled while it goes on) go into the
    summary's `cluster`."""
    urls = [w.url for w in cluster.workers]
    before = await snapshot_all(urls, with_hashes=False)
    sampler = DuplicateSampler(urls, opts.sample_interval_s)
    queue = RouterQueueSampler(router.url, opts.sample_interval_s)
    sampler.start()
    queue.start()
    run_opts = RunOptions(
        target=router.url,
        model=cluster.spec.model,
        max_inflight=opts.max_inflight,
        duration_s=opts.run_limit_s,
        request_timeout_s=opts.run_limit_s,
        label=router.label,
    )
    try:
        result = await run_workload(workload, run_opts)
    finally:
        samples = await sampler.stop()
        queue_peak = await queue.stop()
    after = await snapshot_all(urls)
    stats = replace(
        cluster_stats(after, before, samples),
        router_queue_peak=queue_peak,
        engine_late_s=counter_delta(after, before, f"{P}engine_late_seconds_total"),
        engine_active_s=counter_delta(after, before, f"{P}engine_active_seconds_total"),
    )
    return result, summarize(result, cluster=stats, meta={"router": router.label})


def counter_delta(
    after: Sequence[WorkerSnapshot], before: Sequence[WorkerSnapshot], name: str
) -> float | None:
    """`name` summed over the workers of `after`, less its value in `before` (by URL); None
    when no worker exposes it."""
    base = {s.url: s.get(name) for s in before}
    vals = [v - (base.get(s.url) or 0.0) for s in after if (v := s.get(name)) is not None]
    return sum(vals) if vals else None


def run_target(
    cluster: EmulatedCluster,
    target: Target,
    workload: Workload,
    log_dir: Path,
    planner: Mapping[str, object],
    opts: MeasureOptions,
) -> tuple[RunResult, RunSummary]:
    """One measured run: restart the workers (cold caches), start the target's router, replay
    `workload` through it, stop the router. `TargetUnavailableError` when nothing could start."""
    try:
        cluster.restart()
        router = start_target(target, cluster, log_dir, planner)
    except (ProcessFailedError, OSError, RuntimeError) as exc:
        reason = str(exc).strip().splitlines()[0][:200] if str(exc) else repr(exc)
        raise TargetUnavailableError(reason) from exc
    try:
        return asyncio.run(measure(router, cluster, workload, opts))
    finally:
        router.stop()


def run_bench(plan: BenchPlan) -> list[WorkloadOutcome]:
    """Every workload through every target, workers restarted before each run."""
    outcomes: list[WorkloadOutcome] = []
    log_dir = plan.log_dir or plan.out_dir / "logs"
    plan.log(f"process logs and request records: {log_dir}")
    opts = MeasureOptions(plan.max_inflight, plan.run_limit_s, plan.sample_interval_s)
    cluster = EmulatedCluster(plan.spec, log_dir)
    try:
        for wname, workload in plan.workloads:
            outcome = WorkloadOutcome(wname, [], [], {})
            for target in plan.targets:
                t0 = time.monotonic()
                try:
                    result, summary = run_target(
                        cluster, target, workload, log_dir, plan.planner, opts
                    )
                except TargetUnavailableError as exc:
                    outcome.skipped[target.label] = str(exc)
                    plan.log(f"[{wname}] {target.label}: skipped ({exc})")
                    continue
                outcome.results.append(result)
                outcome.summaries.append(summary)
                slug = f"{wname}_{target.label}".replace(" ", "_")
                write_records(result, log_dir / f"records_{slug}.jsonl")
                e2e = summary.session_e2e.mean
                plan.log(
                    f"[{wname}] {target.label}: {summary.sessions_completed}/{summary.sessions} "
                    f"sessions, mean session E2E {e2e if e2e is None else round(e2e, 2)} s, "
                    f"errors {summary.errors}, {time.monotonic() - t0:.0f} s"
                )
            outcomes.append(outcome)
    finally:
        cluster.stop()
    return outcomes


# --- goals ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Goal:
    name: str
    measured: float | None
    target: str
    met: bool | None
    detail: str


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def evaluate_goals(summaries: Sequence[RunSummary]) -> list[Goal]:
    """The agentic bench's goals for ownerserve against the others in the same run."""
    by = {s.label: s for s in summaries}
    own = by.get("ownerserve")
    if own is None:
        return []

    def e2e(s: RunSummary) -> float | None:
        return s.session_e2e.mean if s.sessions_completed == s.sessions else None

    peers = [(s.label, v) for s in summaries if s.label in PEER_MODES and (v := e2e(s))]
    bases = [
        (s.label, v)
        for s in summaries
        if s.label in OWN_POLICIES and s.label != "ownerserve" and (v := e2e(s))
    ]
    goals: list[Goal] = []
    mine = e2e(own)
    for name, pool, bound in (
        ("mean session E2E vs best peer", peers, 0.7),
        ("mean session E2E vs best own baseline", bases, 0.8),
    ):
        if pool:
            best_label, best = min(pool, key=lambda x: x[1])
            r = _ratio(mine, best)
            goals.append(
                Goal(name, r, f"≤ {bound}×", None if r is None else r <= bound, best_label)
            )
        else:
            goals.append(Goal(name, None, f"≤ {bound}×", None, "no complete run to compare"))
    spd = by.get("static-pd")
    moved = own.cluster.kv_bytes_moved if own.cluster else None
    ref = spd.cluster.kv_bytes_moved if spd and spd.cluster else None
    r = _ratio(moved, ref) if moved is not None and ref else None
    if moved == 0 and ref:
        r = 0.0
    goals.append(
        Goal("KV bytes moved vs static-pd", r, "≤ 0.5×", None if r is None else r <= 0.5, "")
    )
    dup = own.cluster.duplicate_factor if own.cluster else None
    goals.append(
        Goal("HBM duplicate factor", dup, "≤ 1.1", None if dup is None else dup <= 1.1, "mean")
    )
    return goals


def goals_table(goals: Sequence[Goal]) -> str:
    lines = ["| goal (ownerserve) | measured | target | met | reference |", "|---|---|---|---|---|"]
    for g in goals:
        val = "–" if g.measured is None else f"{g.measured:.2f}"
        met = "–" if g.met is None else ("yes" if g.met else "**no**")
        lines.append(f"| {g.name} | {val} | {g.target} | {met} | {g.detail} |")
    return "\n".join(lines)


def machine_line() -> str:
    import os

    cores = os.cpu_count() or 0
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        mem_s = f", {mem:.0f} GiB"
    except (ValueError, OSError):
        mem_s = ""
    return (
        f"{platform.system()} {platform.machine()}, {cores} cores{mem_s}, "
        f"Python {platform.python_version()} (shared VM, noisy)"
    )


def write_outputs(
    outcomes: Sequence[WorkloadOutcome],
    plan: BenchPlan,
    command: str,
    started: dt.datetime,
    wall_s: float,
    notes: Sequence[str] = (),
    results_md: Path | None = None,
) -> str:
    """Write per-workload reports to `plan.out_dir` and return the Markdown section."""
    from loadgen.plots import plot_runs  # matplotlib: only when writing

    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    spec = plan.spec
    heading = f"## Agentic benchmark, {started.isoformat(timespec='seconds')}"
    head = [
        heading,
        "",
        f"Command: `{command}`  ",
        f"Date: {started.isoformat(timespec='seconds')}, wall time {wall_s / 60:.1f} min  ",
        f"Machine: {machine_line()}  ",
        f"Cluster: {spec.prefill} prefill + {spec.decode} decode + {spec.hybrid} hybrid emulated "
        f"workers, profile `{spec.profile}`, speed ×{spec.speed:g} (emulated GPU time runs "
        f"{spec.speed:g}× faster than real time; latencies below are wall-clock).",
    ]
    body: list[str] = []
    for o in outcomes:
        stem = f"agentic_{o.name}_{stamp}"
        header = f"# {o.name}\n\n`{command}`, {started.isoformat(timespec='seconds')}"
        images = plot_runs(o.summaries, o.results, plan.out_dir, stem)
        paths = write_report(o.summaries, plan.out_dir, stem, header=header, images=images)
        # image and raw-data links relative to the Markdown file they are written into
        rel = Path(os.path.relpath(plan.out_dir, results_md.parent)) if results_md else plan.out_dir
        body += ["", f"### {o.name}", "", markdown_tables(o.summaries), ""]
        goals = evaluate_goals(o.summaries)
        if goals:
            body += [goals_table(goals), ""]
        if o.skipped:
            body.append("Not run: " + "; ".join(f"{k} ({v})" for k, v in o.skipped.items()) + "  ")
        for key in ("cdf", "bars"):
            if key in paths:
                body.append(f"![{o.name} {key}]({rel / paths[key].name})")
        body.append(f"\nRaw: `{rel / paths['json'].name}`")
    section = "\n".join(head + body + (["", *notes] if notes else [])) + "\n"
    if results_md is not None:
        replace_section(results_md, heading, section)  # a new heading: appended
    return section


def replace_section(path: Path, heading: str, section: str) -> None:
    """Replace the `heading` section of a Markdown file (up to the next `## `), or append it."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.rstrip() == heading), None)
    if start is None:
        new = text.rstrip("\n") + "\n\n" + section
    else:
        end = next(
            (j for j in range(start + 1, len(lines)) if lines[j].startswith("## ")), len(lines)
        )
        new = (
            "".join(lines[:start])
            + section
            + ("\n" + "".join(lines[end:]) if end < len(lines) else "")
        )
    path.write_text(new)
