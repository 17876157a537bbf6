"""`ownerserve bench capacity` (without `--rates`): each target's capacity found by search, on
emulated workers or (`--sim`) in the simulator, written as `capacity_latest.json` (emulated) or
`capacity_sim_<workload>_w<N>_latest.json`, a dated copy, the PNG curves and a Markdown section.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadgen.bench import OWN_POLICIES, PEER_LABELS, Target, machine_line, replace_section
from loadgen.capacity import (
    CapacityPoint,
    SearchPlan,
    capacity_plan_from_args,
    kv_demand,
    run_capacity_search,
    size_plan_blocks,
)
from loadgen.capacity_report import (
    capacity_table,
    ranking_tau,
    rows,
    runs_table,
    write_json,
    write_plot,
)
from loadgen.capacity_search import (
    LOOSE,
    SLO,
    TIGHT,
    Observation,
    SearchSettings,
    TargetCapacity,
    search_target,
)
from loadgen.cluster import ClusterSpec, peer_mode_unfit, sigterm_as_interrupt
from ownerserve.errors import ConfigError
from ownerserve.profiles import load_profile


def _slo(value: str | None, default: SLO) -> SLO:
    if value is None:
        return default
    try:
        ttft, tpot = (float(x) for x in value.split(","))
        return replace(default, ttft_factor=ttft, tpot_factor=tpot)
    except ValueError:
        raise ConfigError(f"--slo-{default.name} {value!r}: TTFT,TPOT factors > 0") from None


def _settings(args: argparse.Namespace) -> SearchSettings:
    sim = args.sim
    try:
        return SearchSettings(
            start_rate=args.start_rate or (960.0 if sim else 30.0),
            max_rate=args.max_rate or (15_360.0 if sim else 1_920.0),
            min_rate=args.min_rate or (60.0 if sim else 3.75),
            rel_tol=args.rel_tol,
        )
    except ValueError as exc:
        raise ConfigError(f"capacity search: {exc}") from None


def _emulated_row(obs: Observation) -> dict[str, Any]:
    point = obs.detail
    return point.to_json() if isinstance(point, CapacityPoint) else {}


def _sim_row(obs: Observation) -> dict[str, Any]:
    from loadgen.capacity_sim import sim_point

    return sim_point(obs, str((obs.detail or {}).get("policy")), {})


def run_search_command(args: argparse.Namespace) -> int:
    from loadgen.bench_cli import _planner_settings, _runnable, _split

    if args.speed <= 0 or args.time_scale <= 0 or min(args.prefill, args.decode, args.hybrid) < 0:
        raise ConfigError("--speed and --time-scale must be > 0 and worker counts >= 0")
    from loadgen.bench_cli import CAPACITY_TARGETS

    labels = _split(args.targets, OWN_POLICIES + PEER_LABELS, "targets")
    slos = (_slo(args.slo_tight, TIGHT), _slo(args.slo_loose, LOOSE))
    settings = _settings(args)
    try:
        profile = load_profile(args.profile)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--profile: {exc}") from None
    started = dt.datetime.now(dt.UTC)
    t0 = time.monotonic()
    command = f"ownerserve {' '.join(shlex.quote(a) for a in sys.argv[1:])}"
    if args.sim:
        targets, header, stem = _run_sim(args, labels, slos, settings, profile)
        point_row = _sim_row
    else:
        spec_roles = ClusterSpec(args.prefill, args.decode, args.hybrid)
        labels = _runnable(labels, spec_roles, args.targets != ",".join(CAPACITY_TARGETS))
        targets, header, skipped = _run_emulated(
            args, labels, slos, settings, profile, _planner_settings(args.planner)
        )
        if skipped:
            header.append("Not run: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()))
        stem = "capacity"
        point_row = _emulated_row
    wall_min = (time.monotonic() - t0) / 60
    data = rows(targets, slos, point_row)
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    out: Path = args.out_dir
    dated = write_json(out / f"{stem}_{stamp}.json", data)
    shutil.copyfile(dated, out / f"{stem}_latest.json")
    png = write_plot(targets, slos, out / f"{stem}_{stamp}.png")
    shutil.copyfile(png, out / f"{stem}_latest.png")
    peers = [t for t in labels if t in PEER_LABELS]
    body = [
        f"## Capacity search{' (simulator)' if args.sim else ''}, "
        f"{started.isoformat(timespec='seconds')}",
        "",
        f"Command: `{command}`  ",
        f"Date: {started.isoformat(timespec='seconds')}, wall time {wall_min:.1f} min  ",
        f"Machine: {machine_line()}  ",
        *header,
        "SLOs: " + "; ".join(s.describe() for s in slos) + ".  ",
        f"Search: from {settings.start_rate:g}/min, ×{settings.growth:g} up to "
        f"{settings.max_rate:g} or down to {settings.min_rate:g}, bisected to "
        f"{settings.rel_tol:.0%}.",
        "",
        capacity_table(targets, slos, peers, point_row),
    ]
    if args.sim and args.compare is not None:
        try:
            other = json.loads(args.compare.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--compare: {exc}") from None
        for s in slos:
            tau, n = ranking_tau(targets, other, s.name)
            tau_s = "–" if tau is None else f"{tau:.2f}"
            body.append(f"\nKendall tau vs `{args.compare}` at {s.name}: {tau_s} ({n} targets)")
    rel = out if args.no_results_md else Path(os.path.relpath(out, args.results_md.parent))
    body += [
        "",
        runs_table(targets, slos),
        "",
        f"![attainment]({rel / png.name})  ",
        f"Raw: `{rel / dated.name}`",
    ]
    section = "\n".join(body) + "\n"
    if not args.no_results_md:
        replace_section(args.results_md, body[0], section)
    print(section)
    return 0 if targets else 1


def _run_sim(
    args: argparse.Namespace,
    labels: list[str],
    slos: tuple[SLO, ...],
    settings: SearchSettings,
    profile: Any,
) -> tuple[list[TargetCapacity], list[str], str]:
    from loadgen.capacity_sim import SIM_POLICY, sim_case, sim_observation, splits_for
    from loadgen.sim.cli import kv_spec_of, retention_of

    if args.workers < 2 or args.block_tokens < 1:
        raise ConfigError("--workers must be >= 2 and --block-tokens >= 1")
    if args.workload not in ("agentic-long", "agentic"):
        raise ConfigError("--workload: agentic-long or agentic")
    sessions = args.sessions or (8 if args.quick else 60)
    scale = args.scale or (0.03 if args.quick else 0.05)
    sizing = args.sizing_rate or 3840.0
    kv_spec, typed = kv_spec_of(args)
    if not typed:
        raise ConfigError("--swa-policy lru: not a capacity target (no typed KV state)")
    case = sim_case(
        args.workload,
        args.workers,
        profile,
        sessions=sessions,
        scale=scale,
        time_scale=args.time_scale,
        seed=args.seed,
        sizing_rate=sizing,
        block_tokens=args.block_tokens,
        kv_spec=kv_spec,
        retention=retention_of(args),
    )
    log = _log
    log(
        f"sim case: {len(case.sessions)} sessions, {args.workers} workers, HBM "
        f"{case.hbm_kv_bytes / 1e9:.2f} GB + {case.cpu_blocks} CPU blocks per worker"
    )
    out = []
    for label in labels:

        def runner(split: str, label: str = label) -> Any:
            def run(rate: float) -> Observation:
                t0 = time.perf_counter()
                obs = sim_observation(case, label, split, rate, profile, seed=args.seed)
                from loadgen.capacity_search import attainment

                met = ", ".join(f"{s.name} {attainment(obs, s):.0%}" for s in slos)
                log(f"[{label} {split} @ {rate:g}/min] {met} ({time.perf_counter() - t0:.1f} s)")
                return obs

            return run

        out.append(search_target(label, splits_for(label), runner, slos, settings))
    names = ", ".join(f"{k} → `{v}`" for k, v in SIM_POLICY.items() if k in labels)
    header = [
        f"Cluster: {args.workers} simulated workers, profile `{args.profile}`, KV blocks of "
        f"{args.block_tokens} tokens, HBM {case.hbm_kv_bytes / 1e9:.2f} GB + CPU tier "
        f"{case.cpu_blocks} blocks per worker (the working set at {sizing:g}/min is 3× the "
        "cluster's HBM).  ",
        f"Workload: `{args.workload}` seed {args.seed}"
        f"{f', scale {scale:g}' if args.workload == 'agentic-long' else ''}, {sessions} main "
        f"sessions ({len(case.sessions)} with subagents) at every rate, tool gaps "
        f"×{args.time_scale:g}.  ",
        f"Peer models: {names}.  " if names else "",
    ]
    if kv_spec is not None:
        header.append(
            f"KV: HeteroCache spec `{args.kv_spec}` (SWA policy "
            f"{kv_spec.swa_policy.caching.value}, "
            f"retention {getattr(args, 'retention', None) or 'full'}; SGLang's peers keep no "
            "window checkpoints, as HiCache).  "
        )
    stem = f"capacity_sim_{args.workload}_w{args.workers}"
    if kv_spec is not None:
        stem += f"_{args.kv_spec}"
    return out, [h for h in header if h], stem


def _run_emulated(
    args: argparse.Namespace,
    labels: list[str],
    slos: tuple[SLO, ...],
    settings: SearchSettings,
    profile: Any,
    planner: dict[str, object],
) -> tuple[list[TargetCapacity], list[str], dict[str, str]]:
    from loadgen.capacity_sim import splits_for

    sessions = args.sessions or (3 if args.quick else 12)
    scale = args.scale or (0.03 if args.quick else 0.05)
    targets = [Target(t, "own" if t in OWN_POLICIES else "peer") for t in labels]
    base = capacity_plan_from_args(args, targets, [], planner, sessions=sessions, scale=scale)
    spec = base.spec
    sizing = args.sizing_rate or 240.0
    demand = kv_demand(base.workload_at(sizing), profile, spec.speed, spec.model)
    num_blocks, cpu_blocks = size_plan_blocks(base, demand, args)
    workers = spec.prefill + spec.decode + spec.hybrid
    plan = SearchPlan(
        base=base,
        profile=profile,
        settings=settings,
        slos=slos,
        splits={t: splits_for(t) for t in labels},
        max_late_share=args.max_late_share,
    )
    base.log(f"process logs and request records: {base.log_dir}")

    def unfit(label: str, s: ClusterSpec) -> str | None:
        if label in PEER_LABELS:
            return peer_mode_unfit(label, s)
        if label == "static-pd" and (s.prefill == 0 or s.decode == 0):
            return "static-pd needs prefill and decode workers"
        return None

    with sigterm_as_interrupt():
        out, skipped = run_capacity_search(plan, unfit)
    header = [
        f"Cluster: {workers} emulated workers (each target in its shapes), profile "
        f"`{spec.profile}`, speed ×{spec.speed:g}, {num_blocks:,} HBM + {cpu_blocks:,} CPU "
        f"blocks per worker (the working set at {sizing:g}/min: "
        f"{demand.working_set_blocks / (workers * num_blocks):.1f}× the cluster's HBM).  ",
        f"Workload: `{args.workload}` seed {args.seed}, scale {scale:g}, {sessions} main "
        f"sessions at every rate, tool gaps ×{args.time_scale:g}; each run may last "
        f"{base.duration_s:g} s past its last planned session start; runs whose workers' late "
        f"share exceeds {args.max_late_share:.0%} are discarded.  ",
    ]
    return out, header, skipped


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
