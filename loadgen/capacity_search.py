"""Capacity as operators measure it: the highest session arrival rate at which a target keeps
≥ 90% of its sessions within a latency SLO, found by search (bracket, then bisect) over an
injected "run at rate r" callable. Pure: no I/O, no clock; the emulated bench
(`loadgen.capacity`) and the simulator driver (`loadgen.capacity_sim`) supply the runs.

The SLO is per request and relative, as Splitwise (Patel et al., ISCA'24, §VI) states its SLOs
as a slowdown against the request running alone on an unloaded machine: a request meets it when
its TTFT is within `ttft_factor` × its unloaded TTFT and its TPOT within `tpot_factor` × its
unloaded TPOT. A session meets it when it completes and `request_share` of its requests do; a
rate is sustained when `session_share` of the offered sessions meet it: the attainment target of
90% DistServe (Zhong et al., OSDI'24, §6) uses, with a tight and a loose setting as its "SLO
scale" tightens and loosens the same bounds.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ownerserve.profiles import TimingProfile

# --- the SLO -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SLO:
    """Per-request latency bounds as multiples of the request's unloaded latencies."""

    name: str
    ttft_factor: float
    tpot_factor: float
    request_share: float = 0.9
    """A session meets the SLO when it completes and this share of its requests do."""
    session_share: float = 0.9
    """A rate is sustained when this share of the offered sessions meet the SLO."""

    def __post_init__(self) -> None:
        if self.ttft_factor <= 0 or self.tpot_factor <= 0:
            raise ValueError(f"SLO {self.name!r}: factors must be > 0")
        if not (0 < self.request_share <= 1 and 0 < self.session_share <= 1):
            raise ValueError(f"SLO {self.name!r}: shares must be within (0, 1]")

    def describe(self) -> str:
        return (
            f"{self.name}: TTFT ≤ {self.ttft_factor:g}× and TPOT ≤ {self.tpot_factor:g}× the "
            f"request's unloaded latencies for ≥ {self.request_share:.0%} of a session's "
            f"requests, ≥ {self.session_share:.0%} of sessions"
        )


TIGHT = SLO("tight", ttft_factor=5.0, tpot_factor=1.5)
LOOSE = SLO("loose", ttft_factor=20.0, tpot_factor=3.0)
DEFAULT_SLOS: tuple[SLO, ...] = (TIGHT, LOOSE)
"""The two settings every capacity is reported at (bench/RESULTS.md states why these)."""


def unloaded_ttft_s(profile: TimingProfile, new_tokens: int, cached_tokens: int) -> float:
    """A request alone on an idle worker that holds `cached_tokens` of its prompt (its own
    session's previous prompt, as a session run alone would leave it): its prefill, then the
    first decode step at batch 1 (the emulator's and the simulator's TTFT)."""
    total = new_tokens + cached_tokens
    return profile.prefill_s(new_tokens, cached_tokens) + profile.decode_step_s(1, total)


def unloaded_tpot_s(profile: TimingProfile, context_tokens: int) -> float:
    """One decode step at batch 1 over the request's context."""
    return profile.decode_step_s(1, context_tokens)


# --- what one run at one rate observed ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestSample:
    """One request's latencies (None: it failed, or had no second token) and its references."""

    ttft_s: float | None
    tpot_s: float | None
    ttft_ref_s: float
    tpot_ref_s: float

    def meets(self, slo: SLO) -> bool:
        if self.ttft_s is None or self.ttft_s > slo.ttft_factor * self.ttft_ref_s:
            return False
        return self.tpot_s is None or self.tpot_s <= slo.tpot_factor * self.tpot_ref_s


@dataclass(frozen=True, slots=True)
class SessionSample:
    completed: bool
    requests: tuple[RequestSample, ...]

    def meets(self, slo: SLO) -> bool:
        if not self.completed or not self.requests:
            return False
        good = sum(r.meets(slo) for r in self.requests)
        return good >= slo.request_share * len(self.requests) - 1e-9


@dataclass(frozen=True, slots=True)
class Observation:
    """One run of a target at `rate` (sessions per minute): every offered session."""

    rate: float
    sessions: tuple[SessionSample, ...]
    discarded: str | None = None
    """Why this run says nothing about the target (the host, not the model, was the
    bottleneck); the search treats the rate as out of reach and says so."""
    detail: Any = field(default=None, compare=False)
    """The caller's own record of the run (a `CapacityPoint`, a simulator summary)."""


def attainment(obs: Observation, slo: SLO) -> float:
    """The share of offered sessions that met `slo`."""
    if not obs.sessions:
        return 0.0
    return sum(s.meets(slo) for s in obs.sessions) / len(obs.sessions)


# --- the search --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SearchSettings:
    start_rate: float
    """The first rate tried (sessions per minute)."""
    max_rate: float
    """The cap: a target that sustains it has capacity ≥ the cap (status `capped`)."""
    min_rate: float
    """Below this the search stops looking down (status `never_met`, capacity 0)."""
    growth: float = 2.0
    """The bracket grows (and shrinks) by this factor per run."""
    rel_tol: float = 0.05
    """Bisect until the failing rate is within this share above the sustained one."""
    max_runs: int = 40

    def __post_init__(self) -> None:
        if not 0 < self.min_rate <= self.start_rate <= self.max_rate:
            raise ValueError("rates: need 0 < min_rate <= start_rate <= max_rate")
        if self.growth <= 1 or self.rel_tol <= 0 or self.max_runs < 1:
            raise ValueError("need growth > 1, rel_tol > 0, max_runs >= 1")


@dataclass(frozen=True, slots=True)
class Trial:
    rate: float
    attainment: float
    meets: bool
    discarded: str | None = None


@dataclass(frozen=True, slots=True)
class CapacityResult:
    capacity_per_min: float
    """The highest rate found sustained (0.0: none down to `min_rate`)."""
    status: str
    """`bracketed` (bisected to `rel_tol`), `capped` (sustained at `max_rate`), `never_met`,
    `machine_bound` (the rate above was discarded: capacity is at least this), or `budget`
    (`max_runs` ran out before the bracket closed)."""
    upper: float | None
    """The lowest rate that failed or was discarded above the capacity (None: capped)."""
    trials: tuple[Trial, ...]
    """In the order they ran (a rate run once, even when asked twice)."""
    monotone: bool
    """False when a higher rate had more sessions meeting the SLO than a lower one: the system
    (or the run) is noisy there, and the capacity is as exact as that noise."""


Runner = Callable[[float], Observation]
"""`rate → Observation`: run the target with the same sessions at `rate` sessions/min."""


def rate_key(rate: float) -> float:
    """Rates rounded to 6 significant digits: one run per rate however it was computed."""
    return float(f"{rate:.6g}")


def search_capacity(
    run: Runner,
    slo: SLO,
    settings: SearchSettings,
    cache: MutableMapping[float, Observation] | None = None,
) -> CapacityResult:
    """Bracket the capacity (grow from `start_rate` by `growth` while the SLO holds, shrink
    while it fails), then bisect until the failing rate is within `rel_tol` of the sustained
    one. `cache` (rate → observation) lets searches at other SLOs reuse the same runs."""
    runs: MutableMapping[float, Observation] = {} if cache is None else cache
    trials: list[Trial] = []
    budget = [settings.max_runs]

    def trial(rate: float) -> Trial:
        key = rate_key(rate)
        obs = runs.get(key)
        if obs is None:
            budget[0] -= 1
            obs = run(key)
            runs[key] = obs
        if obs.discarded is not None:
            t = Trial(key, attainment(obs, slo), False, obs.discarded)
        else:
            a = attainment(obs, slo)
            t = Trial(key, a, a >= slo.session_share - 1e-9)
        if all(x.rate != key for x in trials):
            trials.append(t)
        return t

    def done(capacity: float, status: str, upper: float | None) -> CapacityResult:
        shares = [t.attainment for t in sorted(trials, key=lambda t: t.rate) if not t.discarded]
        monotone = all(b <= a + 1e-9 for a, b in itertools.pairwise(shares))
        return CapacityResult(capacity, status, upper, tuple(trials), monotone)

    r = rate_key(settings.start_rate)
    t = trial(r)
    lo: float | None = None
    hi: float | None = None
    hi_discarded = False
    if t.meets:
        lo = r
        while hi is None:
            if r >= settings.max_rate:
                return done(r, "capped", None)
            if budget[0] <= 0:
                return done(r, "budget", None)
            r = rate_key(min(r * settings.growth, settings.max_rate))
            t = trial(r)
            if t.meets:
                lo = r
            else:
                hi, hi_discarded = r, t.discarded is not None
    else:
        hi, hi_discarded = r, t.discarded is not None
        while lo is None:
            nxt = rate_key(r / settings.growth)
            if nxt < settings.min_rate:
                return done(0.0, "machine_bound" if hi_discarded else "never_met", hi)
            if budget[0] <= 0:
                return done(0.0, "budget", hi)
            r = nxt
            t = trial(r)
            if t.meets:
                lo = r
            else:
                hi, hi_discarded = r, t.discarded is not None
    assert lo is not None and hi is not None
    while hi - lo > settings.rel_tol * lo:
        if budget[0] <= 0:
            return done(lo, "budget", hi)
        mid = rate_key((lo + hi) / 2)
        if mid in (lo, hi):
            break
        t = trial(mid)
        if t.meets:
            lo = mid
        else:
            hi, hi_discarded = mid, t.discarded is not None
    return done(lo, "machine_bound" if hi_discarded else "bracketed", hi)


# --- comparing rankings ------------------------------------------------------------------------


def kendall_tau(xs: Sequence[float], ys: Sequence[float], tie: float = 0.0) -> float | None:
    """Kendall tau-b of two paired sequences; values within `tie` (relative) of each other are
    ties. None when fewer than two pairs, or when one side is all ties."""
    if len(xs) != len(ys):
        raise ValueError("kendall_tau: sequences of different lengths")
    n = len(xs)
    if n < 2:
        return None

    def sign(a: float, b: float) -> int:
        scale = max(abs(a), abs(b))
        if abs(a - b) <= tie * scale:
            return 0
        return 1 if a > b else -1

    concordant = discordant = ties_x = ties_y = 0
    for i in range(n):
        for j in range(i + 1, n):
            sx, sy = sign(xs[i], xs[j]), sign(ys[i], ys[j])
            if sx == 0 and sy == 0:
                continue
            if sx == 0:
                ties_x += 1
            elif sy == 0:
                ties_y += 1
            elif sx == sy:
                concordant += 1
            else:
                discordant += 1
    denom = math.sqrt((concordant + discordant + ties_x) * (concordant + discordant + ties_y))
    return (concordant - discordant) / denom if denom else None


def capacity_ranking_tau(
    a: Mapping[str, float], b: Mapping[str, float], tie: float = 0.05
) -> float | None:
    """Kendall tau of the targets both maps rank by capacity (ties within `tie`, the search's
    own resolution)."""
    keys = sorted(k for k in a if k in b)
    return kendall_tau([a[k] for k in keys], [b[k] for k in keys], tie)


# --- a target over its shapes ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShapeSearch:
    """One target on one cluster shape: its capacity at each SLO and every run it took."""

    split: str
    results: Mapping[str, CapacityResult]
    """By SLO name."""
    runs: Mapping[float, Observation]
    """By rate, shared by the SLOs' searches."""


@dataclass(frozen=True, slots=True)
class TargetCapacity:
    target: str
    shapes: tuple[ShapeSearch, ...]

    def best(self, slo: str) -> ShapeSearch:
        """The shape with the highest capacity at `slo` (the first of equals)."""
        return max(self.shapes, key=lambda s: s.results[slo].capacity_per_min)

    def capacity(self, slo: str) -> float:
        return self.best(slo).results[slo].capacity_per_min


def search_target(
    target: str,
    splits: Sequence[str],
    runner_for: Callable[[str], Runner],
    slos: Sequence[SLO],
    settings: SearchSettings,
) -> TargetCapacity:
    """`target`'s capacity on each shape in `splits` (`runner_for(split)` runs it there), at
    each SLO; the SLOs' searches on one shape share its runs."""
    shapes = []
    for split in splits:
        run = runner_for(split)
        cache: dict[float, Observation] = {}
        results = {slo.name: search_capacity(run, slo, settings, cache) for slo in slos}
        shapes.append(ShapeSearch(split, results, dict(sorted(cache.items()))))
    return TargetCapacity(target, tuple(shapes))
