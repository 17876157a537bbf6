"""Peer-model validation: the real sglang-router / vllm-router binaries on the emulated
cluster against the simulator's models of them (`planner.policies.peers`), beside our baselines,
on the same sessions and the same cluster shape.

    .venv/bin/python -m bench.sim.validate_peers [--cases mixed,agentic-long]
        [--targets ownerserve,static-pd,...,"sglang-router cache_aware",...] [--rates 60,240]
        [--sim-only] [--resimulate SAVED.json ...] [--results-md bench/history/sim_validation.md]

Cases: `mixed` (the agentic bench's workload, its 2P/2D/2H cluster at speed ×2, the workload's
time ×1/speed as `ownerserve bench agentic` replays it) and `agentic-long@RATE` (the capacity
sweep's workload at RATE main sessions per minute on its 1P/1D/2H cluster at speed ×1, HBM sized
as `ownerserve bench capacity` sizes it, without the CPU tier: the simulator has none). Per
target the workers restart cold; the simulator runs the same sessions (block for block,
`loadgen.sim.from_workload`) on the shape the binary routes over: an aggregated peer over every
worker (all hybrid), vllm-router's P/D over prefill + half the hybrids and decode + the other
half, sglang-router's P/D over the prefill and decode workers (`peer_command`). Compared per
target: mean session E2E (emulated wall × speed), prefill tokens computed, KV bytes moved; then
the ranking of all targets by E2E (Kendall tau, emulated near-ties as ties).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.sim.validate import (
    NOISE_TIE,
    ROUTER_SCRAPE_S,
    Compared,
    add_run_args,
    cell,
    kendall_tau,
    pct,
    worker_capacity_blocks,
)
from loadgen.bench import (
    OWN_POLICIES,
    MeasureOptions,
    Target,
    TargetUnavailableError,
    machine_line,
    run_target,
)
from loadgen.capacity import default_num_blocks, kv_demand, sweep_workload
from loadgen.cluster import PEER_MODES, ClusterSpec, EmulatedCluster
from loadgen.metrics import snapshot_all
from loadgen.report import RunSummary
from loadgen.sim.engine import ClusterSpec as SimClusterSpec
from loadgen.sim.engine import Simulator
from loadgen.sim.from_workload import step_prompts, workload_sessions
from loadgen.sim.workload import SimSession
from loadgen.workloads import Workload, generate
from ownerserve.profiles import load_profile
from ownerserve.tokenizer import load_chat_template
from planner.policies import get_policy
from planner.policies.peers import (
    CacheAwarePDPolicy,
    CacheAwarePolicy,
    VllmCacheAwarePDPolicy,
    VllmCacheAwarePolicy,
)
from planner.policies.peers.cache_aware import RoutingText
from planner.types import Policy, RequestView

SECTION = "## Peer models against the peer binaries"
BLOCK_TOKENS = 16
E2E_TOLERANCE = 0.20
"""Largest |sim − emulated| / emulated accepted for mean session E2E."""
COUNT_TOLERANCE = 0.15
"""The same for prefill tokens computed and KV bytes moved."""
TAU_MIN = 0.6
"""Kendall tau of the targets' order by mean session E2E that counts as the same ranking."""
METRICS: tuple[tuple[str, str, float], ...] = (
    ("e2e_mean_s", "mean session E2E s", E2E_TOLERANCE),
    ("prefill_tokens", "prefill tokens", COUNT_TOLERANCE),
    ("kv_bytes", "KV bytes moved", COUNT_TOLERANCE),
)
SIM_PEERS: dict[str, str] = {
    "vllm-router cache_aware": "vllm-cache-aware",
    "vllm-router consistent_hash": "vllm-consistent-hash",
    "vllm-router pd cache_aware": "vllm-cache-aware-pd",
    "sglang-router cache_aware": "sglang-cache-aware",
    "sglang-router pd cache_aware": "sglang-cache-aware-pd",
}
"""Each peer binary mode the emulated bench runs, and the simulator's model of it."""
DEFAULT_TARGETS: tuple[str, ...] = (
    "ownerserve",
    "static-pd",
    "colocated",
    "least-loaded",
    *SIM_PEERS,
)


# --- cases: workload, cluster --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Shape:
    """Workers per role."""

    prefill: int
    decode: int
    hybrid: int

    @property
    def total(self) -> int:
        return self.prefill + self.decode + self.hybrid


def sim_shape(target: str, shape: Shape) -> Shape:
    """The cluster the simulator runs `target` on: our policies on `shape` itself; a peer on
    the workers its binary routes over (`loadgen.cluster.peer_command`), each in the role it
    plays there."""
    if target not in PEER_MODES:
        return shape
    peer, _, pd = PEER_MODES[target]
    if not pd:
        return Shape(0, 0, shape.total)
    if peer == "vllm-router":
        return Shape(shape.prefill + (shape.hybrid + 1) // 2, shape.decode + shape.hybrid // 2, 0)
    return Shape(shape.prefill, shape.decode, 0)


@dataclass(frozen=True, slots=True)
class Case:
    """One validation workload on one cluster. `workload` is in emulated time: the emulated side
    replays it ×1/speed and multiplies its latencies by speed."""

    name: str
    workload: Workload
    shape: Shape
    speed: float
    num_blocks: int | None
    """HBM KV blocks per worker (None: the emulator's default, read back from a worker)."""
    run_limit_s: float
    """Wall seconds the emulated run may take."""
    settings: dict[str, Any]
    """How the workload was made, for the record."""


def mixed_case(seed: int = 0, scale: float = 1.0, speed: float = 2.0) -> Case:
    """`ownerserve bench agentic`'s `mixed` on its default 2P/2D/2H cluster."""
    w = generate("mixed", seed, scale)
    settings = {"workload": "mixed", "seed": seed, "scale": scale}
    return Case("mixed", w, Shape(2, 2, 2), speed, None, 120.0, settings)


def agentic_long_cases(
    rates: Sequence[float],
    sweep_top: float = 240.0,
    sessions: int = 6,
    scale: float = 0.05,
    time_scale: float = 0.005,
    seed: int = 0,
    duration_s: float = 150.0,
    profile: str = "h100-llama3-8b",
) -> list[Case]:
    """`ownerserve bench capacity`'s `agentic-long` at `rates` (main sessions per minute) on its
    1P/1D/2H cluster, speed ×1, HBM sized from the working set at `sweep_top` as the sweep
    sizes it (`default_num_blocks`). Unlike the sweep (30 s past the last start, then cut), a
    run may go on `duration_s` so that every session completes: the means compare whole
    sessions."""
    shape = Shape(1, 1, 2)
    prof = load_profile(profile)
    model = ClusterSpec().model
    top = sweep_workload("agentic-long", seed, scale, sessions, sweep_top, time_scale)
    blocks = default_num_blocks(kv_demand(top, prof, 1.0, model), shape.total)
    out = []
    for rate in rates:
        w = sweep_workload("agentic-long", seed, scale, sessions, rate, time_scale)
        span = max((s.start_s for s in w.sessions), default=0.0)
        settings = {
            "workload": "agentic-long",
            "rate_per_min": rate,
            "sweep_top_per_min": sweep_top,
            "sessions": sessions,
            "scale": scale,
            "time_scale": time_scale,
            "seed": seed,
            "cpu_num_blocks": 0,
            "duration_s": duration_s,
        }
        out.append(
            Case(f"agentic-long@{rate:g}", w, shape, 1.0, blocks, span + duration_s, settings)
        )
    return out


# --- the two sides -------------------------------------------------------------------------------


def _sim_name(target: str) -> str:
    return SIM_PEERS.get(target, target)


CACHE_AWARE = {
    cls.name: cls
    for cls in (CacheAwarePolicy, CacheAwarePDPolicy, VllmCacheAwarePolicy, VllmCacheAwarePDPolicy)
}


@dataclass(frozen=True, slots=True)
class ReplayedText:
    """The `RoutingText` of a replayed workload: what the routers read from each request body
    the replay client sends, keyed by the simulator's session id and the prompt's length."""

    tools: frozenset[tuple[str, int]]
    """The requests whose messages hold a tool result or an assistant `tool_calls` turn."""
    content: dict[tuple[str, int], tuple[tuple[int, ...], int]]
    """Per request, `RoutingText.content_bytes`."""

    def carries_tools(self, request: RequestView) -> bool:
        return (request.session_id, request.prompt_tokens) in self.tools

    def content_bytes(self, request: RequestView) -> tuple[Sequence[int], int] | None:
        return self.content.get((request.session_id or "", request.prompt_tokens))


def replayed_text(
    workload: Workload, sessions: Sequence[SimSession], block: int = BLOCK_TOKENS
) -> ReplayedText:
    """`ReplayedText` of `workload` (`sessions` its simulator sessions). The emulated engine
    tokenizes the rendered prompt byte for byte (`ByteTokenizer`), so the prompt's k-th block
    is bytes 16k… of the rendering; a byte counts for the routing text when it lies in a
    message's content (the routers join the contents; the template and the tool-call JSON are
    not in it)."""
    template = load_chat_template(None)
    tools: set[tuple[str, int]] = set()
    content: dict[tuple[str, int], tuple[tuple[int, ...], int]] = {}
    for session, prompts in zip(sessions, step_prompts(workload), strict=True):
        for turn, messages in zip(session.turns, prompts, strict=True):
            key = (str(session.session_id), turn.input_tokens)
            if any(m.get("role") == "tool" or m.get("tool_calls") for m in messages):
                tools.add(key)
            rendered = template.render(messages).encode()
            inside = bytearray(len(rendered))
            at = 0
            for m in messages:
                text = m.get("content")
                if not isinstance(text, str) or not text:
                    continue
                raw = text.encode()
                start = rendered.find(raw, at)
                if start >= 0:
                    inside[start : start + len(raw)] = b"\x01" * len(raw)
                    at = start + len(raw)
            by_block = [0]
            for k in range(len(turn.chain)):
                by_block.append(by_block[-1] + sum(inside[k * block : (k + 1) * block]))
            content[key] = (tuple(by_block), sum(inside))
    return ReplayedText(frozenset(tools), content)


def sim_policy(name: str, text: RoutingText) -> Policy:
    """The simulator's policy `name`; the cache-aware models told what the request bodies
    say (`RoutingText`)."""
    cls = CACHE_AWARE.get(name)
    return cls(text=text) if cls is not None else get_policy(name)


def simulate(
    case: Case, targets: Sequence[str], capacity_blocks: int, profile_name: str
) -> dict[str, dict[str, Any]]:
    """Per target: the simulator's numbers for `case` (its model on the binary's shape)."""
    profile = load_profile(profile_name)
    sessions = workload_sessions(case.workload)
    text = replayed_text(case.workload, sessions)
    block_bytes = BLOCK_TOKENS * profile.kv_bytes_per_token
    out: dict[str, dict[str, Any]] = {}
    for target in targets:
        s = sim_shape(target, case.shape)
        spec = SimClusterSpec(
            s.prefill,
            s.decode,
            s.hybrid,
            block_tokens=BLOCK_TOKENS,
            hbm_kv_bytes=capacity_blocks * block_bytes,
            load_scrape_s=ROUTER_SCRAPE_S,
        )
        peer = target in SIM_PEERS
        sim = Simulator(spec, profile, sim_policy(_sim_name(target), text), full_view=peer)
        res = sim.run(sessions)
        summ = res.summary()
        out[target] = {
            "model": _sim_name(target),
            "shape": [s.prefill, s.decode, s.hybrid],
            "e2e_mean_s": summ["e2e_mean_s"] if res.session_e2e_s else None,
            "ttft_mean_s": sum(res.ttft_s) / len(res.ttft_s) if res.ttft_s else None,
            "prefill_tokens": res.prefill_tokens,
            "kv_bytes": res.pd_kv_bytes + res.fetch_kv_bytes,
            "dup_factor": res.dup_factor,
            "sessions": len(sessions),
            "sessions_completed": len(res.session_e2e_s),
            "requests": res.requests,
            "rejected": res.rejected,
            "actions": summ["actions"],
        }
    return out


def emulated_row(summary: RunSummary, speed: float) -> dict[str, Any]:
    """One emulated run's numbers, latencies in emulated time (wall × speed)."""
    c = summary.cluster

    def t(x: float | None) -> float | None:
        return None if x is None else x * speed

    return {
        "e2e_mean_s": t(summary.session_e2e.mean),
        "ttft_mean_s": t(summary.ttft.mean),
        "prefill_tokens": None if c is None else c.prefill_tokens_computed,
        "kv_bytes": None if c is None else c.kv_bytes_moved,
        "dup_factor": None if c is None else c.duplicate_factor,
        "preemptions": None if c is None else c.preemptions,
        "sessions": summary.sessions,
        "sessions_completed": summary.sessions_completed,
        "requests": summary.requests,
        "errors": summary.errors,
        "time_limited": summary.time_limited,
        "actions": dict(summary.actions),
    }


def timing_fidelity(snaps: Sequence[Any], speed: float) -> float | None:
    """Modelled engine time / (wall time stepping × speed) over the workers' counters: 1.0 =
    the emulators kept time; below it the host's CPUs were too busy (other processes)."""
    p = "ownerserve_emulator_engine_"
    busy = sum(v for s in snaps if (v := s.get(f"{p}busy_seconds_total")) is not None)
    active = sum(v for s in snaps if (v := s.get(f"{p}active_seconds_total")) is not None)
    return busy / (active * speed) if active else None


def emulate(
    case: Case,
    targets: Sequence[str],
    profile: str,
    log_dir: Path,
    log: Callable[[str], None],
) -> tuple[dict[str, dict[str, Any]], int, dict[str, str]]:
    """Per target: the emulated cluster's numbers; the workers' KV capacity in blocks; the
    targets that could not start, with why."""
    extra = ("--num-blocks", str(case.num_blocks)) if case.num_blocks else ()
    spec = ClusterSpec(*(case.shape.prefill, case.shape.decode, case.shape.hybrid), profile=profile,
                       speed=case.speed, extra_args=extra)  # fmt: skip
    cluster = EmulatedCluster(spec, log_dir)
    opts = MeasureOptions(max_inflight=64, run_limit_s=case.run_limit_s, sample_interval_s=1.0)
    workload = case.workload.scaled(1.0 / case.speed)
    out: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    capacity = case.num_blocks or 0
    try:
        for target in targets:
            t0 = time.monotonic()
            kind = "peer" if target in PEER_MODES else "own"
            try:
                _, summary = run_target(cluster, Target(target, kind), workload, log_dir, {}, opts)
            except TargetUnavailableError as exc:
                skipped[target] = str(exc)
                log(f"  [{case.name}] {target}: skipped ({exc})")
                continue
            urls = [w.url for w in cluster.workers]
            if not capacity:
                capacity = asyncio.run(worker_capacity_blocks(urls[0]))
            row = out[target] = emulated_row(summary, case.speed)
            # the workers restarted before the run: their counters cover it alone
            row["timing_fidelity"] = timing_fidelity(
                asyncio.run(snapshot_all(urls, with_hashes=False)), case.speed
            )
            log(
                f"  [{case.name}] {target:<30} E2E {cell('e2e_mean_s', row['e2e_mean_s'])} s, "
                f"{row['sessions_completed']}/{row['sessions']} sessions, {row['errors']} errors, "
                f"{time.monotonic() - t0:.0f} s"
            )
    finally:
        cluster.stop()
    return out, capacity, skipped


# --- comparison (pure) ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TargetRow(Compared):
    target: str
    emulated: dict[str, Any]
    simulated: dict[str, Any]

    def within(self, key: str, tolerance: float) -> bool | None:
        """Whether the gap of `key` is within `tolerance` (None: not comparable)."""
        g = self.gap(key)
        return None if g is None else abs(g) <= tolerance


@dataclass(frozen=True, slots=True)
class Verdict:
    tau_e2e: float | None
    """Kendall tau of all targets' order by mean session E2E (emulated near-ties as ties)."""
    tau_ok: bool
    misses: dict[str, list[str]]
    """Per metric, the targets outside its tolerance (or not comparable)."""

    @property
    def met(self) -> bool:
        return self.tau_ok and not any(self.misses.values())


def judge(rows: Sequence[TargetRow], tie: float = NOISE_TIE) -> Verdict:
    """Every target's gaps against the tolerances, and the E2E ranking's Kendall tau."""
    misses: dict[str, list[str]] = {}
    for key, _, tol in METRICS:
        misses[key] = [r.target for r in rows if not r.within(key, tol)]
    pairs = [
        (e, s)
        for r in rows
        if (e := r.emulated.get("e2e_mean_s")) is not None
        and (s := r.simulated.get("e2e_mean_s")) is not None
    ]
    tau = (
        kendall_tau([e for e, _ in pairs], [s for _, s in pairs], tie) if len(pairs) >= 2 else None
    )
    return Verdict(tau, tau is not None and tau >= TAU_MIN, misses)


# --- report --------------------------------------------------------------------------------------


def markdown(rows: Sequence[TargetRow], verdict: Verdict) -> str:
    """The side-by-side table (misses in bold) and the verdict line; the emulated
    preemptions where the run recorded them."""
    preempt = any(r.emulated.get("preemptions") is not None for r in rows)
    head = (
        "| target | simulator model (shape P/D/H) | "
        + " | ".join(f"{title} emu / sim (gap, ±{tol:.0%})" for _, title, tol in METRICS)
        + " | sessions done emu / sim | emulator timing fidelity |"
        + (" preemptions emu |" if preempt else "")
    )
    lines = [head, "|---|---|" + "---|" * (len(METRICS) + 2 + preempt)]
    for r in rows:
        cells = []
        for key, _, tol in METRICS:
            ok = r.within(key, tol)
            gap = pct(r.gap(key))
            cells.append(
                f"{cell(key, r.emulated.get(key))} / {cell(key, r.simulated.get(key))} "
                + (f"({gap})" if ok else f"(**{gap}**)")
            )
        shape = "/".join(str(x) for x in r.simulated.get("shape", []))
        done = (
            f"{r.emulated.get('sessions_completed', '–')}/{r.emulated.get('sessions', '–')} / "
            f"{r.simulated.get('sessions_completed', '–')}/{r.simulated.get('sessions', '–')}"
        )
        model = r.simulated.get("model", r.target)
        fid = cell("", r.emulated.get("timing_fidelity"))
        n = r.emulated.get("preemptions")
        tail = (" – |" if n is None else f" {n} |") if preempt else ""
        lines.append(
            f"| {r.target} | {model} ({shape}) | "
            + " | ".join(cells)
            + f" | {done} | {fid} |"
            + tail
        )
    tau = "–" if verdict.tau_e2e is None else f"{verdict.tau_e2e:.2f}"
    miss = "; ".join(
        f"{title}: {', '.join(verdict.misses[key])}"
        for key, title, _ in METRICS
        if verdict.misses[key]
    )
    others = [r for r in rows if r.target != "ownerserve"]
    alone = ""
    if len(others) < len(rows) and len(others) >= 2:
        v = judge(others)
        t = "–" if v.tau_e2e is None else f"{v.tau_e2e:.2f}"
        alone = (
            f" Peers and baselines without ownerserve: "
            f"**{t}** ({'met' if v.tau_ok else 'not met'})."
        )
    lines += [
        "",
        f"Kendall tau of the E2E ranking (all {len(rows)} targets, emulated means within "
        f"{NOISE_TIE:.0%} tied): **{tau}** (≥ {TAU_MIN}: {'met' if verdict.tau_ok else 'not met'})."
        + alone
        + (f" Outside tolerance — {miss}." if miss else " Every gap within tolerance."),
    ]
    return "\n".join(lines)


def case_section(run: dict[str, Any]) -> str:
    """One case's subsection from its saved JSON."""
    meta = run["meta"]
    rows = [TargetRow(r["target"], r["emulated"], r["simulated"]) for r in run["rows"]]
    shape = meta["shape"]
    out = [
        f"### {meta['case']} (emulated {meta['date']})",
        "",
        f"Command: `{meta['command']}`  ",
        f"Date: {meta['date']}, emulated wall time {meta['wall_s'] / 60:.1f} min  ",
        f"Machine: {meta['machine']}  ",
        f"Cluster: {shape[0]} prefill + {shape[1]} decode + {shape[2]} hybrid emulated workers, "
        f"{meta['capacity_blocks']:,} HBM blocks of {BLOCK_TOKENS} tokens each, speed "
        f"×{meta['speed']:g}; workload {json.dumps(meta['settings'])}, "
        f"{meta['requests']} requests.",
    ]
    if "simulated_at" in meta:
        how = meta.get("simulated_command") or "--resimulate"
        out.append(f"Simulated side recomputed {meta['simulated_at']}: `{how}`  ")
    if meta.get("skipped"):
        out.append("Not run: " + "; ".join(f"{k} ({v})" for k, v in meta["skipped"].items()))
    out += ["", markdown(rows, judge(rows)), ""]
    return "\n".join(out)


def insert_section(path: Path, section: str) -> None:
    """Put `section` at the top of `path`, after its title line (replacing an earlier section
    with the same heading)."""
    text = path.read_text() if path.exists() else "# Simulator validation\n"
    lines = text.splitlines(keepends=True)
    heading = section.splitlines()[0].rstrip()
    start = next((i for i, ln in enumerate(lines) if ln.rstrip() == heading), None)
    if start is not None:
        end = next(
            (j for j in range(start + 1, len(lines)) if lines[j].startswith("## ")), len(lines)
        )
        del lines[start:end]
    title = lines[:1]
    rest = "".join(lines[1:]).lstrip("\n")
    path.write_text("".join(title) + "\n" + section.rstrip("\n") + "\n\n" + rest)


def _save(
    out_dir: Path, stem: str, data: dict[str, Any], rows: Sequence[TargetRow]
) -> tuple[Path, str]:
    v = judge(rows)
    data["verdict"] = {"tau_e2e": v.tau_e2e, "tau_ok": v.tau_ok, "misses": v.misses}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path, case_section(data)


def resimulate(
    path: Path, out_dir: Path, profile: str, command: str = ""
) -> tuple[Path, dict[str, Any]]:
    """A saved run with its simulated side recomputed by the current models (same sessions,
    same emulated side); written next to it as `<stem>_resim.json`."""
    data = json.loads(path.read_text())
    meta = data["meta"]
    case = _case_from_settings(meta["case"], meta["settings"], meta["speed"])
    targets = [r["target"] for r in data["rows"]]
    sim = simulate(case, targets, meta["capacity_blocks"], profile)
    for r in data["rows"]:
        r["simulated"] = sim[r["target"]]
    meta["simulated_at"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    meta["simulated_command"] = command
    rows = [TargetRow(r["target"], r["emulated"], r["simulated"]) for r in data["rows"]]
    stem = path.stem.removesuffix("_resim") + "_resim"
    target, _ = _save(out_dir, stem, data, rows)
    return target, data


def _case_from_settings(name: str, settings: dict[str, Any], speed: float) -> Case:
    if settings["workload"] == "mixed":
        return mixed_case(settings["seed"], settings["scale"], speed)
    (case,) = agentic_long_cases(
        [settings["rate_per_min"]],
        settings["sweep_top_per_min"],
        settings["sessions"],
        settings["scale"],
        settings["time_scale"],
        settings["seed"],
    )
    return case


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cases", default="mixed,agentic-long", help="mixed and/or agentic-long")
    ap.add_argument("--targets", default=",".join(DEFAULT_TARGETS), help="comma list")
    ap.add_argument("--rates", default="60,240", help="agentic-long rates, sessions per minute")
    ap.add_argument("--sessions", type=int, default=6, help="agentic-long main sessions")
    ap.add_argument(
        "--duration-s",
        type=float,
        default=150.0,
        help="agentic-long: seconds a run may go on past its last session's start",
    )
    ap.add_argument("--mixed-scale", type=float, default=1.0)
    add_run_args(ap, notes="validation_peers_notes.md", results_md_help="insert the section here")
    ap.add_argument(
        "--resimulate", type=Path, nargs="+", default=None, help="saved runs (JSON) to re-simulate"
    )
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    sections: list[str] = []
    command = "python -m bench.sim.validate_peers " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    if args.resimulate:
        for path in args.resimulate:
            target, data = resimulate(path, args.out, args.profile, command)
            log(f"wrote {target}")
            text = case_section(data)
            print(text, flush=True)
            sections.append(text)
    else:
        targets = [t.strip() for t in args.targets.split(",") if t.strip()]
        unknown = [t for t in targets if t not in OWN_POLICIES and t not in SIM_PEERS]
        if unknown:
            ap.error(f"unknown targets {unknown}")
        cases: list[Case] = []
        for name in (c.strip() for c in args.cases.split(",") if c.strip()):
            if name == "mixed":
                cases.append(mixed_case(scale=args.mixed_scale))
            elif name == "agentic-long":
                rates = [float(r) for r in args.rates.split(",") if r.strip()]
                cases += agentic_long_cases(
                    rates, sessions=args.sessions, duration_s=args.duration_s, profile=args.profile
                )
            else:
                ap.error(f"unknown case {name!r}")
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="ownerserve-peerval-"))
        for case in cases:
            started = dt.datetime.now(dt.UTC)
            t0 = time.monotonic()
            emulated: dict[str, dict[str, Any]] = {}
            skipped: dict[str, str] = {}
            capacity = case.num_blocks or 0
            if not args.sim_only:
                log(f"[{case.name}] process logs: {log_dir}")
                emulated, capacity, skipped = emulate(case, targets, args.profile, log_dir, log)
            if not capacity:
                prof = load_profile(args.profile)
                capacity = int(prof.hbm_kv_bytes // (BLOCK_TOKENS * prof.kv_bytes_per_token))
            ran = [t for t in targets if t not in skipped]
            simulated = simulate(case, ran, capacity, args.profile)
            rows = [TargetRow(t, emulated.get(t, {}), simulated[t]) for t in ran]
            s = case.shape
            data = {
                "meta": {
                    "case": case.name,
                    "command": command,
                    "date": started.isoformat(timespec="seconds"),
                    "machine": machine_line(),
                    "wall_s": time.monotonic() - t0,
                    "speed": case.speed,
                    "profile": args.profile,
                    "shape": [s.prefill, s.decode, s.hybrid],
                    "capacity_blocks": capacity,
                    "settings": case.settings,
                    "requests": case.workload.n_requests,
                    "skipped": skipped,
                    "sim_only": args.sim_only,
                },
                "rows": [
                    {"target": r.target, "emulated": r.emulated, "simulated": r.simulated}
                    for r in rows
                ],
            }
            slug = case.name.replace("@", "_at_")
            stem = f"peers_{slug}_{started.strftime('%Y%m%dT%H%M%SZ')}"
            path, text = _save(args.out, stem, data, rows)
            log(f"wrote {path}")
            print(text, flush=True)
            sections.append(text)
    if args.results_md is not None and sections:
        notes = [args.notes.read_text().strip(), ""] if args.notes.exists() else []
        insert_section(args.results_md, "\n".join([SECTION, "", *sections, *notes]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
