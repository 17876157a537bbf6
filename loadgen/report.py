"""Summaries of replay runs: percentiles, throughput and error rates, as JSON and Markdown tables.

`summarize(result)` turns one `RunResult` into a `RunSummary` (plain numbers); a benchmark adds the
cluster's counters (`ClusterStats`, from worker metrics) under `cluster`. `markdown_tables` puts
several runs side by side; `write_report` writes `<stem>.json` and `<stem>.md` (showing the
plots `loadgen.plots.plot_runs` drew; this module does not import that one).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadgen.client import RequestRecord, RunResult
from planner.explain import parse_plan_header


def percentile(values: Sequence[float], q: float) -> float | None:
    """The `q`-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * min(max(q, 0.0), 100.0) / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass(frozen=True, slots=True)
class Dist:
    """Mean and tail of one latency, in seconds."""

    n: int
    mean: float | None
    p50: float | None
    p95: float | None
    p99: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Dist:
        return cls(
            len(values),
            mean(values),
            percentile(values, 50),
            percentile(values, 95),
            percentile(values, 99),
        )


@dataclass(frozen=True, slots=True)
class ClusterStats:
    """Counters read from the workers (and the router's admission queue) over a run; None where
    they do not expose them."""

    prompt_tokens: int | None = None
    prefill_tokens_computed: int | None = None
    prefix_hit_rate: float | None = None
    kv_bytes_pd: int | None = None
    kv_bytes_fetch: int | None = None
    duplicate_factor: float | None = None
    duplicate_factor_peak: float | None = None
    held_blocks: int | None = None
    distinct_blocks: int | None = None
    cpu_hit_tokens: int | None = None
    """Prompt tokens served from a worker's CPU KV tier (loaded back into HBM, not computed)."""
    cpu_blocks_held: int | None = None
    """Blocks in the workers' CPU tiers at the end of the run."""
    preemptions: int | None = None
    """Running requests the workers preempted (KV freed, recomputed later;
    `vllm:num_preemptions`)."""
    kv_transfers_expired: int | None = None
    """Prefill results held for a P/D pull that no decode side pulled before the lease ran out
    (the emulated engine's `ownerserve_emulator_kv_transfers_expired_total`)."""
    router_queue_peak: float | None = None
    """Most requests waiting in the router's admission queue at one sample (OwnerServe's
    `ownerserve_admission_*` queue gauges; None for a router without them)."""
    engine_late_s: float | None = None
    """Summed over the emulated workers: how far their step sleeps overshot their end (the
    emulated engine's `engine_late_seconds`; timers and CPU contention, i.e. this machine)."""
    engine_active_s: float | None = None
    """Summed over the emulated workers: wall time spent running steps (`engine_active_seconds`)."""

    @property
    def late_share(self) -> float | None:
        """Step-sleep overshoot over the time spent in steps: the share of the emulated time
        the host, not the timing model, added."""
        if self.engine_late_s is None or not self.engine_active_s:
            return None
        return self.engine_late_s / self.engine_active_s

    @property
    def kv_bytes_moved(self) -> int | None:
        if self.kv_bytes_pd is None and self.kv_bytes_fetch is None:
            return None
        return (self.kv_bytes_pd or 0) + (self.kv_bytes_fetch or 0)


@dataclass(frozen=True, slots=True)
class RunSummary:
    label: str
    workload: str
    target: str
    started_at: str
    wall_s: float
    requests: int
    errors: int
    """Failed requests, 429s included."""
    error_rate: float
    error_kinds: dict[str, int]
    sessions: int
    sessions_completed: int
    ttft: Dist
    tpot: Dist
    itl: Dist
    step_latency: Dist
    session_e2e: Dist
    requests_per_s: float
    output_tokens_per_s: float
    prompt_tokens: int
    cached_tokens: int
    time_limited: bool
    session_idle_mean_s: float | None = None
    rejected_429: int = 0
    """Requests the router turned away with HTTP 429 (admission bound reached)."""
    actions: dict[str, int] = field(default_factory=dict)
    """Planner actions from the `x-ownerserve-plan` headers (OwnerServe targets only)."""
    fallbacks: dict[str, int] = field(default_factory=dict)
    """Requests whose plan was given up before the first byte, by reason (the header's
    `reason`: a KV hand-over, first byte or connect past its bound, or failed)."""
    cluster: ClusterStats | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if self.cluster is not None:
            out["cluster"]["kv_bytes_moved"] = self.cluster.kv_bytes_moved
        return out


def _error_kind(err: str) -> str:
    return err.split(":", 1)[0][:60]


def summarize(
    result: RunResult, cluster: ClusterStats | None = None, meta: Mapping[str, Any] | None = None
) -> RunSummary:
    reqs = result.requests
    ok = [r for r in reqs if r.ok]
    errors = [r for r in reqs if not r.ok]
    sessions_done = [s for s in result.sessions if s.completed and s.e2e_s is not None]
    plans = [parse_plan_header(r.plan) for r in ok if r.plan]
    wall = max(result.wall_s, 1e-9)
    return RunSummary(
        label=result.label,
        workload=result.workload,
        target=result.target,
        started_at=result.started_at,
        wall_s=result.wall_s,
        requests=len(reqs),
        errors=len(errors),
        error_rate=len(errors) / len(reqs) if reqs else 0.0,
        error_kinds=dict(Counter(_error_kind(r.error or "") for r in errors).most_common(8)),
        sessions=len(result.sessions),
        sessions_completed=len(sessions_done),
        ttft=Dist.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot=Dist.of([t for r in ok if (t := r.tpot_s) is not None]),
        itl=Dist.of([x for r in ok for x in r.itl_s]),
        step_latency=Dist.of([r.e2e_s for r in ok]),
        session_e2e=Dist.of([s.e2e_s for s in sessions_done if s.e2e_s is not None]),
        requests_per_s=len(ok) / wall,
        output_tokens_per_s=sum(r.completion_tokens for r in ok) / wall,
        prompt_tokens=sum(r.prompt_tokens for r in ok),
        cached_tokens=sum(r.cached_tokens for r in ok),
        time_limited=result.time_limited,
        session_idle_mean_s=mean([s.idle_s for s in sessions_done]),
        rejected_429=sum(1 for r in errors if r.status == 429),
        actions=dict(Counter(a for f in plans if (a := f.get("action"))).most_common()),
        fallbacks=dict(
            Counter(
                f"{f['fallback']}:{f.get('reason')}" for f in plans if "fallback" in f
            ).most_common()
        ),
        cluster=cluster,
        meta={**result.meta, **(meta or {})},
    )


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1e3:.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def _s(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def _num(x: float | None, fmt: str = "{:,.0f}") -> str:
    return "–" if x is None else fmt.format(x)


def _bytes(x: int | None) -> str:
    if x is None:
        return "–"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x} B"


def latency_table(summaries: Sequence[RunSummary]) -> str:
    head = (
        "| run | sessions ok | session E2E mean s | of which idle s | p50 s | p99 s "
        "| TTFT p50 ms | p95 ms | p99 ms "
        "| TPOT p50 ms | p99 ms | step p50 ms | p95 ms | p99 ms | req/s | out tok/s | errors |"
    )
    lines = [head, _sep(head)]
    for s in summaries:
        lines.append(
            f"| {s.label} | {s.sessions_completed}/{s.sessions} | {_s(s.session_e2e.mean)} "
            f"| {_s(s.session_idle_mean_s)} | {_s(s.session_e2e.p50)} | {_s(s.session_e2e.p99)} "
            f"| {_ms(s.ttft.p50)} "
            f"| {_ms(s.ttft.p95)} | {_ms(s.ttft.p99)} | {_ms(s.tpot.p50)} | {_ms(s.tpot.p99)} "
            f"| {_ms(s.step_latency.p50)} | {_ms(s.step_latency.p95)} | {_ms(s.step_latency.p99)} "
            f"| {s.requests_per_s:.1f} | {s.output_tokens_per_s:,.0f} "
            f"| {s.errors} ({s.error_rate:.1%}) |"
        )
    return "\n".join(lines)


def _sep(head: str) -> str:
    return "|" + "---|" * (head.count("|") - 1)


def cluster_table(summaries: Sequence[RunSummary]) -> str:
    """Worker-side totals. `computed / prompt` is the share of the clients' prompt tokens that
    some worker computed (1 - reuse); the worker hit rate is vLLM's metric summed over workers
    (in P/D both sides count the prompt, so it is not comparable across modes)."""
    head = (
        "| run | prompt tokens (client) | prefill tokens computed | computed / prompt "
        "| worker prefix hit rate | KV moved P→D | KV moved by fetch | KV moved total "
        "| HBM duplicate factor (mean) | peak |"
    )
    lines = [head, _sep(head)]
    for s in summaries:
        c = s.cluster or ClusterStats()
        prompt = s.prompt_tokens or None
        computed = c.prefill_tokens_computed
        share = computed / prompt if computed is not None and prompt else None
        lines.append(
            f"| {s.label} | {_num(prompt)} | {_num(computed)} | {_num(share, '{:.1%}')} "
            f"| {_num(c.prefix_hit_rate, '{:.1%}')} | {_bytes(c.kv_bytes_pd)} "
            f"| {_bytes(c.kv_bytes_fetch)} | {_bytes(c.kv_bytes_moved)} "
            f"| {_num(c.duplicate_factor, '{:.2f}')} | {_num(c.duplicate_factor_peak, '{:.2f}')} |"
        )
    return "\n".join(lines)


def actions_lines(summaries: Sequence[RunSummary]) -> str:
    """Per run with plan headers: how often the planner chose each action."""
    lines = []
    for s in summaries:
        if s.actions:
            total = sum(s.actions.values())
            parts = ", ".join(f"{a} {n} ({n / total:.0%})" for a, n in s.actions.items())
            lines.append(f"- {s.label} actions: {parts}")
    return "\n".join(lines)


def pressure_lines(summaries: Sequence[RunSummary]) -> str:
    """Per run: what KV pressure did (preemptions, P/D results never pulled, fallbacks)."""
    lines = []
    for s in summaries:
        c = s.cluster or ClusterStats()
        fb = ", ".join(f"{k} {n}" for k, n in s.fallbacks.items()) or "0"
        lines.append(
            f"- {s.label}: preempted {_num(c.preemptions)}, P/D transfers expired "
            f"{_num(c.kv_transfers_expired)}, fallbacks {fb}, 429s {s.rejected_429}"
        )
    return "\n".join(lines)


def markdown_tables(summaries: Sequence[RunSummary]) -> str:
    parts = [latency_table(summaries)]
    if any(s.cluster is not None for s in summaries):
        parts.append(cluster_table(summaries))
        parts.append(pressure_lines(summaries))
    if any(s.actions for s in summaries):
        parts.append(actions_lines(summaries))
    return "\n\n".join(parts)


def write_records(result: RunResult, path: Path) -> None:
    """Every request as one JSON line (for offline analysis)."""
    with path.open("w") as f:
        for r in result.requests:
            f.write(json.dumps(_record_json(r)) + "\n")


def _record_json(r: RequestRecord) -> dict[str, Any]:
    out = asdict(r)
    out["itl_s"] = [round(x, 6) for x in r.itl_s]
    return out


def write_report(
    summaries: Sequence[RunSummary],
    out_dir: Path,
    stem: str,
    *,
    header: str = "",
    images: Mapping[str, Path] | None = None,
) -> dict[str, Path]:
    """Write `<stem>.json` and `<stem>.md` (showing `images`, e.g. what
    `loadgen.plots.plot_runs` drew); return their paths and the images'."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    js = out_dir / f"{stem}.json"
    js.write_text(json.dumps([s.to_json() for s in summaries], indent=1, default=str) + "\n")
    paths["json"] = js
    paths.update(images or {})
    md = out_dir / f"{stem}.md"
    body = [header] if header else []
    body.append(markdown_tables(summaries))
    for key, p in paths.items():
        if p.suffix == ".png":
            body.append(f"![{key}]({p.name})")
    md.write_text("\n\n".join(body) + "\n")
    paths["md"] = md
    return paths
