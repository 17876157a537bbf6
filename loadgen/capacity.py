"""The capacity benchmark: the session arrival rate swept from light load to overload on one
emulated cluster, every target at every rate with the same sessions (same seed).

Per point (target, rate): goodput at a TTFT SLO, session E2E, step TTFT and TPOT, prefill tokens
computed against what an unbounded prefix cache would compute, CPU-tier hits, KV moved, the HBM
duplicate factor, the router's admission queue, 429s and errors. The cluster's HBM is sized from
the workload's KV working set (`kv_demand`), so that memory pressure, not the host's CPU, is what
turns light load into overload.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from loadgen.bench import (
    MeasureOptions,
    Target,
    TargetUnavailableError,
    replace_section,
    run_target,
)
from loadgen.capacity_search import (
    SLO,
    Observation,
    RequestSample,
    Runner,
    SearchSettings,
    SessionSample,
    TargetCapacity,
    attainment,
    search_target,
    unloaded_tpot_s,
    unloaded_ttft_s,
)
from loadgen.client import RunResult
from loadgen.cluster import ClusterSpec, EmulatedCluster
from loadgen.report import ClusterStats, RunSummary, percentile, write_records
from loadgen.workloads import (
    AgenticLongParams,
    AgenticParams,
    Workload,
    agentic,
    agentic_long,
)
from ownerserve.hashing import ChainHasher, chain_root
from ownerserve.profiles import TimingProfile
from ownerserve.tokenizer import ByteTokenizer, ChatTemplate

BLOCK_TOKENS = 16
"""Tokens per KV block: the emulated engine's and the router's default block size."""

RatedGenerator = Callable[[int, float, int, float], Workload]
"""`(seed, scale, sessions, rate_per_s) -> Workload`; the rate changes arrival times only."""

RATED_WORKLOADS: dict[str, RatedGenerator] = {
    "agentic-long": lambda seed, scale, n, rate: agentic_long(
        replace(AgenticLongParams().scaled(scale), sessions=n, rate_per_s=rate), seed
    ),
    "agentic": lambda seed, scale, n, rate: agentic(
        AgenticParams(sessions=n, rate_per_s=rate), seed
    ),
}
"""Workloads whose session arrival rate can be set. Their generators draw one random number per
arrival whatever the rate, so every rate replays the same sessions, only closer together."""


def sweep_workload(
    name: str, seed: int, scale: float, sessions: int, rate_per_min: float, time_scale: float
) -> Workload:
    """`sessions` main sessions (subagents come on top) arriving at `rate_per_min` per minute of
    wall time, their tool gaps multiplied by `time_scale`."""
    try:
        gen = RATED_WORKLOADS[name]
    except KeyError:
        known = sorted(RATED_WORKLOADS)
        raise ValueError(f"unknown workload {name!r}; choose from {known}") from None
    # `scaled` multiplies start times too: generate at the rate it brings to `rate_per_min`
    return gen(seed, scale, sessions, rate_per_min / 60.0 * time_scale).scaled(time_scale)


def arrival_span_s(workload: Workload) -> float:
    return max((s.start_s for s in workload.sessions), default=0.0)


# --- the workload's KV demand -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KVDemand:
    """What a workload asks of the cluster's KV, from its prompts alone (no server)."""

    working_set_blocks: int
    """Peak, over the sessions' start times, of the distinct blocks of the sessions active then,
    each at its largest context (last prompt plus output). A session is active from its start
    for its tool gaps plus its steps' uncontended service time (the profile's prefill of the
    uncached tokens and decode, scaled by the emulator's speed): a lower bound, since queueing
    keeps sessions alive longer."""
    total_blocks: int
    """Distinct blocks over the whole workload."""
    largest_session_blocks: int
    """The largest session's context at its end (last prompt plus output)."""
    ideal_new_tokens: Mapping[tuple[str, int], int]
    """Per `(session id, step)`: the prompt tokens an unbounded prefix cache shared by the whole
    cluster would compute (the rest of the prompt is a prefix some earlier step already had),
    steps taken in planned send order. Prompts are rendered as the workers render them (built-in
    chat template, byte tokenizer)."""
    alone_new_tokens: Mapping[tuple[str, int], int] = field(default_factory=dict)
    """Per `(session id, step)`: the prompt tokens the step computes when its session runs
    alone on an idle worker (only the session's own previous prompt is cached): the capacity
    SLO's unloaded reference (`loadgen.capacity_search`)."""


@dataclass(frozen=True, slots=True)
class _PlannedStep:
    session_id: str
    step: int
    send_s: float
    tokens: int
    max_tokens: int
    hashes: tuple[int, ...]


def kv_demand(
    workload: Workload, profile: TimingProfile, speed: float, model: str, block: int = BLOCK_TOKENS
) -> KVDemand:
    """The working set and the ideal prefill of `workload` (see `KVDemand`)."""
    tpl, tok = ChatTemplate(), ByteTokenizer()
    root = chain_root(model)
    steps: list[_PlannedStep] = []
    peak: dict[str, tuple[frozenset[int], int]] = {}
    alone: dict[tuple[str, int], int] = {}
    for s in workload.sessions:
        hasher = ChainHasher(block, root)
        messages: list[dict[str, Any]] = []
        t = s.start_s
        prev: tuple[int, ...] = ()
        for k, step in enumerate(s.steps):
            if k:
                t += step.gap_s
            messages.extend(m.as_dict() for m in step.new_messages)
            ids = tok.encode(tpl.render(messages))
            hashes = tuple(hasher.update(ids))
            alone[(s.session_id, k)] = len(ids) - _common_prefix(hashes, prev) * block
            prev = hashes
            steps.append(_PlannedStep(s.session_id, k, t, len(ids), step.max_tokens, hashes))
            reply = step.reply_message()
            if reply is not None:
                messages.append(reply)
        last = s.steps[-1].max_tokens if s.steps else 0
        peak[s.session_id] = (frozenset(hasher.hashes), math.ceil(last / block))
    steps.sort(key=lambda p: p.send_s)
    seen: set[int] = set()
    ideal: dict[tuple[str, int], int] = {}
    busy: dict[str, float] = dict.fromkeys(peak, 0.0)
    for p in steps:
        hit = 0
        while hit < len(p.hashes) and p.hashes[hit] in seen:
            hit += 1
        new = p.tokens - hit * block
        ideal[(p.session_id, p.step)] = new
        seen.update(p.hashes)
        decode = p.max_tokens * profile.decode_step_s(1, p.tokens)
        busy[p.session_id] += (profile.prefill_s(new, p.tokens - new) + decode) / speed
    spans = [
        (s.start_s, s.start_s + s.idle_s + busy[s.session_id], s.session_id)
        for s in workload.sessions
    ]
    working = 0
    for t0, _, _ in spans:
        active = [sid for start, end, sid in spans if start <= t0 < end]
        blocks = frozenset().union(*(peak[sid][0] for sid in active)) if active else frozenset()
        working = max(working, len(blocks) + sum(peak[sid][1] for sid in active))
    return KVDemand(
        working_set_blocks=working,
        total_blocks=len(seen),
        largest_session_blocks=max((len(h) + o for h, o in peak.values()), default=0),
        ideal_new_tokens=ideal,
        alone_new_tokens=alone,
    )


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


MIN_SESSIONS_PER_WORKER = 1.0
"""A worker's HBM holds at least this many of the largest session's context: with less, the
longest prompts would not fit any worker at all and fail instead of queueing or recomputing."""


def default_num_blocks(demand: KVDemand, workers: int, pressure: float = 3.0) -> int:
    """KV blocks per worker so that `demand`'s working set is `pressure` times the cluster's
    HBM, but no fewer than `MIN_SESSIONS_PER_WORKER` largest sessions."""
    by_pressure = math.ceil(demand.working_set_blocks / (pressure * max(1, workers)))
    return max(by_pressure, math.ceil(MIN_SESSIONS_PER_WORKER * demand.largest_session_blocks))


# --- one point of the sweep ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CapacityPoint:
    """One target at one arrival rate. Latencies are wall-clock seconds; the SLO is checked on
    emulated time (wall × the cluster's speed)."""

    target: str
    rate: float
    """Offered session arrival rate, main sessions per minute of wall time."""
    sessions: int
    sessions_completed: int
    sessions_good: int
    """Completed sessions whose steps met the SLO (p90 of the session's step TTFTs)."""
    goodput_per_min: float
    """Good sessions per minute: the offered rate × the share of offered sessions that were good
    (at steady state, the good completions per minute; free of the run's start and drain)."""
    e2e_mean_s: float | None
    e2e_p90_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    prompt_tokens: int
    """Prompt tokens of the answered requests (client-side usage)."""
    prefill_tokens_computed: int | None
    """Prompt tokens the workers computed (summed over workers; P/D counts the prefill side)."""
    prefill_tokens_ideal: int
    """What an unbounded cluster-wide prefix cache would compute for the same answered requests."""
    cpu_hit_tokens: int | None
    kv_bytes_moved: int | None
    duplicate_factor: float | None
    router_queue_peak: float | None
    requests: int
    rejected_429: int
    errors: int
    """Failed requests other than 429s (HTTP errors, transport errors, cut by the time limit)."""
    time_limited: bool
    wall_s: float
    slo_ttft_p90_s: float

    @property
    def recompute_ratio(self) -> float | None:
        """Prefill tokens computed over the ideal (1.0: nothing computed twice)."""
        if self.prefill_tokens_computed is None or not self.prefill_tokens_ideal:
            return None
        return self.prefill_tokens_computed / self.prefill_tokens_ideal

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "recompute_ratio": self.recompute_ratio}


def session_good(result: RunResult, speed: float, slo_ttft_p90_s: float) -> set[str]:
    """Completed sessions whose step TTFTs (emulated time) have their p90 within the SLO."""
    ttfts: dict[str, list[float]] = {}
    for r in result.requests:
        if r.ok and r.ttft_s is not None:
            ttfts.setdefault(r.session_id, []).append(r.ttft_s * speed)
    good = set()
    for s in result.sessions:
        p90 = percentile(ttfts.get(s.session_id, []), 90)
        if s.completed and p90 is not None and p90 <= slo_ttft_p90_s:
            good.add(s.session_id)
    return good


def capacity_point(
    target: str,
    rate: float,
    result: RunResult,
    summary: RunSummary,
    demand: KVDemand,
    speed: float,
    slo_ttft_p90_s: float,
) -> CapacityPoint:
    """The point's numbers from one measured run."""
    c = summary.cluster or ClusterStats()
    good = session_good(result, speed, slo_ttft_p90_s)
    done = [s.e2e_s for s in result.sessions if s.completed and s.e2e_s is not None]
    ok = [r for r in result.requests if r.ok]
    ideal = demand.ideal_new_tokens
    offered = len(result.sessions)
    return CapacityPoint(
        target=target,
        rate=rate,
        sessions=offered,
        sessions_completed=summary.sessions_completed,
        sessions_good=len(good),
        goodput_per_min=rate * len(good) / offered if offered else 0.0,
        e2e_mean_s=summary.session_e2e.mean,
        e2e_p90_s=percentile(done, 90),
        ttft_p50_s=summary.ttft.p50,
        ttft_p99_s=summary.ttft.p99,
        tpot_p50_s=summary.tpot.p50,
        tpot_p99_s=summary.tpot.p99,
        prompt_tokens=summary.prompt_tokens,
        prefill_tokens_computed=c.prefill_tokens_computed,
        prefill_tokens_ideal=sum(ideal.get((r.session_id, r.step), 0) for r in ok),
        cpu_hit_tokens=c.cpu_hit_tokens,
        kv_bytes_moved=c.kv_bytes_moved,
        duplicate_factor=c.duplicate_factor,
        router_queue_peak=c.router_queue_peak,
        requests=summary.requests,
        rejected_429=summary.rejected_429,
        errors=summary.errors - summary.rejected_429,
        time_limited=summary.time_limited,
        wall_s=summary.wall_s,
        slo_ttft_p90_s=slo_ttft_p90_s,
    )


# --- the sweep ----------------------------------------------------------------------------------


@dataclass
class CapacityPlan:
    spec: ClusterSpec
    targets: list[Target]
    rates: list[float]
    """Session arrival rates, main sessions per minute of wall time, ascending."""
    workload: str
    seed: int
    scale: float
    sessions: int
    time_scale: float
    slo_ttft_p90_s: float
    duration_s: float
    """Seconds each point may run after its last planned session start; sessions still running
    then are cut (counted as not completed)."""
    out_dir: Path
    log_dir: Path
    max_inflight: int = 64
    sample_interval_s: float = 2.0
    planner: dict[str, object] = field(default_factory=dict)
    log: Callable[[str], None] = field(default=lambda msg: print(msg, file=sys.stderr, flush=True))

    def workload_at(self, rate: float) -> Workload:
        return sweep_workload(
            self.workload, self.seed, self.scale, self.sessions, rate, self.time_scale
        )


def capacity_plan_from_args(
    args: Any,
    targets: list[Target],
    rates: list[float],
    planner: dict[str, object],
    *,
    sessions: int,
    scale: float,
) -> CapacityPlan:
    """The `CapacityPlan` of `ownerserve bench capacity`'s arguments (the sweep's and the
    search's alike; the search passes no rates)."""
    return CapacityPlan(
        spec=ClusterSpec(args.prefill, args.decode, args.hybrid, args.profile, args.speed),
        targets=targets,
        rates=rates,
        workload=args.workload,
        seed=args.seed,
        scale=scale,
        sessions=sessions,
        time_scale=args.time_scale,
        slo_ttft_p90_s=args.slo_ttft_p90_s,
        duration_s=args.duration_s or (20.0 if args.quick else 60.0),
        out_dir=args.out_dir,
        log_dir=args.log_dir or Path(tempfile.mkdtemp(prefix="ownerserve-capacity-")),
        max_inflight=args.max_inflight,
        planner=planner,
    )


def size_plan_blocks(plan: CapacityPlan, demand: KVDemand, args: Any) -> tuple[int, int]:
    """Give `plan`'s workers their KV pools: `--num-blocks` (or `default_num_blocks` of
    `demand`) GPU blocks and `--cpu-num-blocks` (default: as many) CPU blocks per worker, set
    as the emulators' arguments. Returns (GPU blocks, CPU blocks)."""
    spec = plan.spec
    workers = spec.prefill + spec.decode + spec.hybrid
    num_blocks = args.num_blocks or default_num_blocks(demand, workers)
    cpu_blocks = num_blocks if args.cpu_num_blocks is None else args.cpu_num_blocks
    extra: tuple[str, ...] = ("--num-blocks", str(num_blocks))
    if cpu_blocks:
        extra += ("--cpu-num-blocks", str(cpu_blocks))
    plan.spec = replace(spec, extra_args=extra)
    return num_blocks, cpu_blocks


@dataclass
class CapacityOutcome:
    points: list[CapacityPoint]
    skipped: dict[str, str]
    """Targets that could not start, and why."""


def run_capacity(plan: CapacityPlan, demands: Mapping[float, KVDemand]) -> CapacityOutcome:
    """Every rate (with its `KVDemand` in `demands`) through every target, the workers restarted
    (cold caches) before each run."""
    points: list[CapacityPoint] = []
    skipped: dict[str, str] = {}
    cluster = EmulatedCluster(plan.spec, plan.log_dir)
    try:
        for rate in plan.rates:
            workload = plan.workload_at(rate)
            limit_s = arrival_span_s(workload) + plan.duration_s
            opts = MeasureOptions(plan.max_inflight, limit_s, plan.sample_interval_s)
            for target in plan.targets:
                if target.label in skipped:
                    continue
                t0 = time.monotonic()
                try:
                    result, summary = run_target(
                        cluster, target, workload, plan.log_dir, plan.planner, opts
                    )
                except TargetUnavailableError as exc:
                    skipped[target.label] = str(exc)
                    plan.log(f"{target.label}: skipped ({exc})")
                    continue
                slug = f"{target.label}_{rate:g}".replace(" ", "_")
                write_records(result, plan.log_dir / f"records_capacity_{slug}.jsonl")
                point = capacity_point(
                    target.label,
                    rate,
                    result,
                    summary,
                    demands[rate],
                    plan.spec.speed,
                    plan.slo_ttft_p90_s,
                )
                points.append(point)
                plan.log(
                    f"[{rate:g}/min] {target.label}: good {point.sessions_good}/{point.sessions}, "
                    f"goodput {point.goodput_per_min:.1f}/min, E2E mean {_f(point.e2e_mean_s)} s, "
                    f"recompute ×{_f(point.recompute_ratio)}, 429 {point.rejected_429}, "
                    f"errors {point.errors}, {time.monotonic() - t0:.0f} s"
                )
    finally:
        cluster.stop()
    return CapacityOutcome(points, skipped)


# --- tables and files ---------------------------------------------------------------------------


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1e3:.0f}"


def _mb(x: int | None) -> str:
    return "–" if x is None else f"{x / 1e6:,.0f}"


def goodput_table(points: Sequence[CapacityPoint]) -> str:
    """Goodput per target (rows) and rate (columns)."""
    rates = sorted({p.rate for p in points})
    targets = list(dict.fromkeys(p.target for p in points))
    by = {(p.target, p.rate): p for p in points}
    head = "| goodput (sessions/min) | " + " | ".join(f"{r:g}/min" for r in rates) + " |"
    lines = [head, "|---|" + "---:|" * len(rates)]
    for t in targets:
        cells = [_f(by[(t, r)].goodput_per_min, "{:.1f}") if (t, r) in by else "–" for r in rates]
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def points_table(points: Sequence[CapacityPoint]) -> str:
    """Every point, by rate then target."""
    head = (
        "| rate /min | target | good / done / offered | goodput /min | E2E mean s | E2E p90 s "
        "| TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | prefill computed / ideal "
        "| CPU-tier hit tokens | KV moved MB | HBM dup | router queue peak | 429 | errors |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for p in sorted(points, key=lambda p: p.rate):
        lines.append(
            f"| {p.rate:g} | {p.target} | {p.sessions_good} / {p.sessions_completed} / "
            f"{p.sessions} | {p.goodput_per_min:.1f} | {_f(p.e2e_mean_s)} | {_f(p.e2e_p90_s)} "
            f"| {_ms(p.ttft_p50_s)} | {_ms(p.ttft_p99_s)} | {_ms(p.tpot_p50_s)} "
            f"| {_ms(p.tpot_p99_s)} | {_f(p.prefill_tokens_computed, '{:,.0f}')} / "
            f"{p.prefill_tokens_ideal:,} (×{_f(p.recompute_ratio)}) "
            f"| {_f(p.cpu_hit_tokens, '{:,.0f}')} | {_mb(p.kv_bytes_moved)} "
            f"| {_f(p.duplicate_factor)} | {_f(p.router_queue_peak, '{:.0f}')} "
            f"| {p.rejected_429} | {p.errors} |"
        )
    return "\n".join(lines)


def sizing_lines(
    plan: CapacityPlan, demands: Mapping[float, KVDemand], num_blocks: int, cpu_blocks: int
) -> list[str]:
    """The working set against the cluster's HBM, per rate."""
    workers = plan.spec.prefill + plan.spec.decode + plan.spec.hybrid
    hbm = workers * num_blocks
    out = [
        f"KV sizing: {workers} workers × {num_blocks:,} HBM blocks ({BLOCK_TOKENS} tokens each) = "
        f"{hbm:,} blocks; CPU tier {cpu_blocks:,} blocks per worker. Working set (distinct blocks "
        "of the sessions active at once, each at its largest context, on the planned timeline "
        "without queueing) against the cluster's HBM:"
    ]
    for rate in plan.rates:
        d = demands[rate]
        out.append(
            f"- {rate:g} sessions/min: working set {d.working_set_blocks:,} blocks = "
            f"{d.working_set_blocks / hbm:.1f}× HBM (whole workload {d.total_blocks:,} blocks)"
        )
    return out


def write_capacity_outputs(
    outcome: CapacityOutcome,
    plan: CapacityPlan,
    header: Sequence[str],
    started: dt.datetime,
    history_md: Path | None,
) -> str:
    """`capacity_latest.json` and a dated copy, the PNG curves, and the Markdown section
    (appended to `history_md`); returns the section."""
    from loadgen.plots import plot_capacity  # matplotlib: only when writing

    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    dated = plan.out_dir / f"capacity_{stamp}.json"
    dated.write_text(json.dumps([p.to_json() for p in outcome.points], indent=1) + "\n")
    shutil.copyfile(dated, plan.out_dir / "capacity_latest.json")
    png = plot_capacity(outcome.points, plan.out_dir / f"capacity_{stamp}.png")
    shutil.copyfile(png, plan.out_dir / "capacity_latest.png")
    heading = f"## Capacity sweep, {started.isoformat(timespec='seconds')}"
    body = [heading, "", *header, "", goodput_table(outcome.points)]
    body += ["", points_table(outcome.points)]
    if outcome.skipped:
        body += ["", "Not run: " + "; ".join(f"{k} ({v})" for k, v in outcome.skipped.items())]
    rel = plan.out_dir
    if history_md is not None:
        rel = Path(os.path.relpath(plan.out_dir, history_md.parent))
    body += ["", f"![capacity curves]({rel / png.name})", "", f"Raw: `{rel / dated.name}`"]
    section = "\n".join(body) + "\n"
    if history_md is not None:
        replace_section(history_md, heading, section)
    return section


# --- capacity by search (loadgen.capacity_search) ----------------------------------------------

MAX_LATE_SHARE = 0.10
"""A run whose emulated workers' step sleeps overshot by more than this share of their step
time (`ClusterStats.late_share`) measured this machine, not the timing model: discarded."""


def observation(
    point: CapacityPoint,
    result: RunResult,
    summary: RunSummary,
    demand: KVDemand,
    profile: TimingProfile,
    speed: float,
    max_late_share: float = MAX_LATE_SHARE,
) -> Observation:
    """One emulated run as the search sees it: per request its TTFT and TPOT in emulated time
    (wall × `speed`) against its unloaded latencies (`unloaded_ttft_s` with its session's own
    previous prompt cached, `demand.alone_new_tokens`); discarded when the workers' late share
    is above `max_late_share`."""
    by_session: dict[str, list[RequestSample]] = {}
    for r in result.requests:
        key = (r.session_id, r.step)
        new = demand.alone_new_tokens.get(key, demand.ideal_new_tokens.get(key))
        prompt = r.prompt_tokens
        if new is None or prompt <= 0:
            # a failed request reports no usage: its reference is the whole prompt computed
            new, prompt = max(new or 0, 1), max(prompt, new or 1)
        new = min(new, prompt)
        ttft_ref = unloaded_ttft_s(profile, new, prompt - new)
        tpot_ref = unloaded_tpot_s(profile, prompt + max(r.completion_tokens, 1))
        ttft = r.ttft_s * speed if r.ok and r.ttft_s is not None else None
        tpot = r.tpot_s * speed if r.ok and r.tpot_s is not None else None
        by_session.setdefault(r.session_id, []).append(
            RequestSample(ttft, tpot, ttft_ref, tpot_ref)
        )
    sessions = tuple(
        SessionSample(s.completed, tuple(by_session.get(s.session_id, ()))) for s in result.sessions
    )
    late = summary.cluster.late_share if summary.cluster else None
    why = None
    if late is not None and late > max_late_share:
        why = f"workers' late share {late:.0%} > {max_late_share:.0%}: this machine was the limit"
    return Observation(point.rate, sessions, discarded=why, detail=point)


@dataclass
class SearchPlan:
    """The emulated capacity search: every target on the same worker count, each shape its
    own cluster, each rate a fresh run (workers restarted)."""

    base: CapacityPlan
    """Targets, workload, sessions, durations and the cluster's timing; its `spec`'s worker
    count and extra arguments (HBM sizing) are kept, its roles replaced by each shape's."""
    profile: TimingProfile
    settings: SearchSettings
    slos: tuple[SLO, ...]
    splits: Mapping[str, tuple[str, ...]]
    """Per target label, the P:D:H shapes searched."""
    max_late_share: float = MAX_LATE_SHARE


def shape_spec(spec: ClusterSpec, split: str) -> ClusterSpec:
    """`spec`'s worker count in the P:D:H shape `split` (shares; the remainder to the last
    non-zero role)."""
    n = spec.prefill + spec.decode + spec.hybrid
    try:
        shares = [float(x) for x in split.split(":")]
    except ValueError:
        shares = []
    if len(shares) != 3 or min(shares) < 0 or sum(shares) <= 0:
        raise ValueError(f"split {split!r}: three shares P:D:H, e.g. 1:1:0")
    counts = [int(n * x / sum(shares)) for x in shares]
    counts[max(i for i, x in enumerate(shares) if x > 0)] += n - sum(counts)
    return replace(spec, prefill=counts[0], decode=counts[1], hybrid=counts[2])


def run_capacity_search(
    plan: SearchPlan, unfit: Callable[[str, ClusterSpec], str | None]
) -> tuple[list[TargetCapacity], dict[str, str]]:
    """Each target's capacity on each of its shapes (`unfit(label, spec)`: why a target cannot
    run on a shape, or None); the targets that could not run anywhere, and why."""
    base = plan.base
    out: list[TargetCapacity] = []
    skipped: dict[str, str] = {}
    for target in base.targets:
        splits = []
        for split in plan.splits.get(target.label, ("0:0:1",)):
            why = unfit(target.label, shape_spec(base.spec, split))
            if why is None:
                splits.append(split)
            else:
                base.log(f"{target.label} on {split}: skipped ({why})")
        if not splits:
            skipped[target.label] = "no shape it can run on"
            continue

        def runner_for(split: str, t: Target = target) -> Runner:
            return _emulated_runner(plan, t, split)

        try:
            out.append(search_target(target.label, splits, runner_for, plan.slos, plan.settings))
        except TargetUnavailableError as exc:
            skipped[target.label] = str(exc)
            base.log(f"{target.label}: skipped ({exc})")
    return out, skipped


def _emulated_runner(plan: SearchPlan, target: Target, split: str) -> Runner:
    base = plan.base
    spec = shape_spec(base.spec, split)

    def run(rate: float) -> Observation:
        workload = base.workload_at(rate)
        demand = kv_demand(workload, plan.profile, spec.speed, spec.model)
        limit_s = arrival_span_s(workload) + base.duration_s
        opts = MeasureOptions(base.max_inflight, limit_s, base.sample_interval_s)
        cluster = EmulatedCluster(spec, base.log_dir)
        t0 = time.monotonic()
        try:
            result, summary = run_target(
                cluster, target, workload, base.log_dir, base.planner, opts
            )
        finally:
            cluster.stop()
        slug = f"{target.label}_{split}_{rate:g}".replace(" ", "_").replace(":", "-")
        write_records(result, base.log_dir / f"records_capacity_{slug}.jsonl")
        point = capacity_point(
            target.label, rate, result, summary, demand, spec.speed, base.slo_ttft_p90_s
        )
        obs = observation(
            point, result, summary, demand, plan.profile, spec.speed, plan.max_late_share
        )
        shares = ", ".join(f"{s.name} {attainment(obs, s):.0%}" for s in plan.slos)
        base.log(
            f"[{target.label} {split} @ {rate:g}/min] sessions meeting the SLO: {shares}; "
            f"late share {_f(summary.cluster.late_share if summary.cluster else None)}"
            f"{' (discarded)' if obs.discarded else ''}, {time.monotonic() - t0:.0f} s"
        )
        return obs

    return run
