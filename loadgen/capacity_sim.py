"""Capacity in the simulator, by the definition the emulated bench uses (`loadgen.capacity_search`):
each target on the same worker count in its best shape (aggregated peers and colocated
policies on hybrids only, P/D peers and OwnerServe at every P:D split given, each searched), the
same sessions at every rate, per-request TTFT and TPOT against the request's unloaded latencies.

The simulator is run through its public parts (`Simulator`, `loadgen.sim.cli.gate_for`,
`split_roles`, `workload_sessions`); per-request samples come from a gate that wraps the policy's
own (the `ProgramGate` protocol): the engine tells it when each request arrives, starts and
ends, in the order it appends each request's TTFT and first decode step to its result.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from loadgen.capacity import sweep_workload
from loadgen.capacity_search import (
    Observation,
    RequestSample,
    SessionSample,
    unloaded_tpot_s,
    unloaded_ttft_s,
)
from loadgen.sim.admission import ProgramGate
from loadgen.sim.cli import gate_for, peer_kv_spec, split_roles
from loadgen.sim.engine import ClusterSpec, Simulator
from loadgen.sim.from_workload import Rendering, workload_sessions
from loadgen.sim.workload import SimSession, kv_working_set
from ownerserve.kvstate import KVStateSpec
from ownerserve.kvstate.retention import Retention
from ownerserve.profiles import TimingProfile

SIM_POLICY: dict[str, str] = {
    "vllm-router cache_aware": "vllm-cache-aware",
    "vllm-router consistent_hash": "vllm-consistent-hash",
    "vllm-router pd cache_aware": "vllm-cache-aware-pd",
    "sglang-router cache_aware": "sglang-cache-aware",
    "sglang-router pd cache_aware": "sglang-cache-aware-pd",
}
"""The emulated bench's peer labels and the simulator's models of them; an own policy keeps its
name."""

PD_SPLITS: tuple[str, ...] = ("1:3:0", "1:1:0", "3:1:0")
"""P:D:H shares searched for a P/D target (on four workers: every split of them)."""
OWN_SPLITS: tuple[str, ...] = (*PD_SPLITS, "0:0:1", "1:1:2")
"""OwnerServe decides P/D per step: the P/D splits, all hybrids, and a mix."""
HYBRID: tuple[str, ...] = ("0:0:1",)


def sim_policy(label: str) -> str:
    return SIM_POLICY.get(label, label)


def splits_for(label: str) -> tuple[str, ...]:
    """The shapes a target is searched on: its own deployment shapes, every one at the same
    worker count."""
    from planner.policies.peers import DISAGGREGATED

    name = sim_policy(label)
    if name == "ownerserve":
        return OWN_SPLITS
    if name in DISAGGREGATED or name == "static-pd":
        return PD_SPLITS
    return HYBRID


# --- per-request samples from the engine --------------------------------------------------------


@dataclass
class _Request:
    session: int
    arrived: float
    ended: float | None = None


@dataclass
class RecordingGate:
    """A `ProgramGate` that passes everything to `inner` (None: lets every request go at once)
    and records each request's session, arrival and end."""

    inner: ProgramGate | None = None
    started_order: list[_Request] = field(default_factory=list)
    _arrived: dict[Hashable, float] = field(default_factory=dict)
    _open: dict[Hashable, list[_Request]] = field(default_factory=dict)
    completed: set[Hashable] = field(default_factory=set)

    # the protocol's attributes, read through to the gate it wraps (setters for the protocol)
    @property
    def tick_s(self) -> float:
        return self.inner.tick_s if self.inner is not None else 0.0

    @tick_s.setter
    def tick_s(self, value: float) -> None:
        if self.inner is not None:
            self.inner.tick_s = value

    @property
    def queued(self) -> int:
        return self.inner.queued if self.inner is not None else 0

    @queued.setter
    def queued(self, value: int) -> None:
        if self.inner is not None:
            self.inner.queued = value

    @property
    def waits_s(self) -> list[float]:
        return self.inner.waits_s if self.inner is not None else []

    @waits_s.setter
    def waits_s(self, value: list[float]) -> None:
        if self.inner is not None:
            self.inner.waits_s = value

    @property
    def programs_paused(self) -> int:
        return self.inner.programs_paused if self.inner is not None else 0

    def spawned(self, session: Hashable, spawner: Hashable) -> None:
        if self.inner is not None:
            self.inner.spawned(session, spawner)

    def arrive(self, session: Hashable, tokens: int, attained: int, now: float) -> bool:
        self._arrived[session] = now
        return self.inner.arrive(session, tokens, attained, now) if self.inner else True

    def started(self, session: Hashable, worker: str, tokens: int, now: float) -> None:
        si = session if isinstance(session, int) else int(str(session))
        req = _Request(si, self._arrived.get(session, now))
        self.started_order.append(req)
        self._open.setdefault(session, []).append(req)
        if self.inner is not None:
            self.inner.started(session, worker, tokens, now)

    def ended(self, session: Hashable, worker: str, tokens: int, now: float, last: bool) -> None:
        if worker:  # "" is a request the policy refused before it ran
            pending = self._open.get(session)
            if pending:
                pending.pop(0).ended = now
            if last:
                self.completed.add(session)
        if self.inner is not None:
            self.inner.ended(session, worker, tokens, now, last)

    def tick(self, now: float) -> None:
        if self.inner is not None:
            self.inner.tick(now)

    def next_release(self, now: float) -> Hashable | None:
        return self.inner.next_release(now) if self.inner is not None else None

    def rejected(self, now: float) -> list[Hashable]:
        return self.inner.rejected(now) if self.inner is not None else []


# --- the workload, its references and the cluster ----------------------------------------------


@dataclass(frozen=True, slots=True)
class SimCase:
    """One workload on one cluster size: the sessions at a reference rate (rescaled per rate),
    each request's unloaded latencies, and the HBM every target gets."""

    workload: str
    workers: int
    sessions: tuple[SimSession, ...]
    reference_rate: float
    ttft_ref_s: tuple[tuple[float, ...], ...]
    """Per session, per turn: `unloaded_ttft_s` with the session running alone on an idle
    worker (its own previous prompt cached, nothing else)."""
    tpot_ref_s: tuple[tuple[float, ...], ...]
    ideal_prefill_tokens: tuple[tuple[int, ...], ...]
    """Per session, per turn: what an unbounded cluster-wide prefix cache would compute (turns
    in planned order: start plus tool gaps, no service time), the prefill's floor."""
    block_tokens: int
    hbm_kv_bytes: int
    cpu_blocks: int
    kv_spec: KVStateSpec | None = None
    """HeteroCache: the model's KV spec (None: dense, the profile's bytes per token); every
    target's simulator keeps its KV by it (a peer by the spec its deployment keeps,
    `loadgen.sim.cli.peer_kv_spec`), HBM is sized by its sealed bytes per token."""
    retention: Retention | None = None
    """With a hybrid spec: which boundaries keep their windows (None: every one)."""

    def sessions_at(self, rate: float) -> list[SimSession]:
        """The same sessions with the main sessions' arrivals at `rate` per minute (the rated
        generators draw one number per arrival: arrival times scale as 1/rate)."""
        k = self.reference_rate / rate
        return [
            s if s.spawned_at is not None else replace(s, start_s=s.start_s * k)
            for s in self.sessions
        ]

    def spec(self, split: str) -> ClusterSpec:
        base = ClusterSpec.of_size(
            self.workers,
            block_tokens=self.block_tokens,
            hbm_kv_bytes=self.hbm_kv_bytes,
            cpu_blocks=self.cpu_blocks,
        )
        try:
            roles = split_roles(split, self.workers)
        except SystemExit as exc:
            raise ValueError(str(exc)) from None
        return replace(
            base, prefill=roles["prefill"], decode=roles["decode"], hybrid=roles["hybrid"]
        )


def sim_case(
    workload: str,
    workers: int,
    profile: TimingProfile,
    *,
    sessions: int,
    scale: float,
    time_scale: float,
    seed: int,
    sizing_rate: float,
    hbm_pressure: float = 3.0,
    block_tokens: int = 64,
    kv_spec: KVStateSpec | None = None,
    retention: Retention | None = None,
) -> SimCase:
    """`sessions` main sessions of `workload`; HBM per worker sized as `ownerserve bench
    capacity` sizes it: the working set at `sizing_rate` is `hbm_pressure` × the cluster's HBM
    (but a worker holds the largest session), with a CPU tier of as many blocks; the blocks'
    bytes are the profile's per token, or with `kv_spec` its sealed bytes per token (as the
    simulator sizes its blocks)."""
    w = sweep_workload(workload, seed, scale, sessions, sizing_rate, time_scale)
    sims = workload_sessions(w, Rendering(block_size=block_tokens))
    peak, largest = kv_working_set(sims, profile, block_tokens)
    blocks = max(math.ceil(peak / (hbm_pressure * workers)), largest, 1)
    ttft, tpot, ideal = references(sims, profile, block_tokens)
    per_token = profile.kv_bytes_per_token if kv_spec is None else kv_spec.bytes_per_token()
    return SimCase(
        workload=workload,
        workers=workers,
        sessions=tuple(sims),
        reference_rate=sizing_rate,
        ttft_ref_s=ttft,
        tpot_ref_s=tpot,
        ideal_prefill_tokens=ideal,
        block_tokens=block_tokens,
        hbm_kv_bytes=blocks * max(1, round(per_token * block_tokens)),
        cpu_blocks=blocks,
        kv_spec=kv_spec,
        retention=retention,
    )


def references(
    sessions: Sequence[SimSession], profile: TimingProfile, block_tokens: int
) -> tuple[
    tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...], tuple[tuple[int, ...], ...]
]:
    """Per session and turn: unloaded TTFT and TPOT (the session alone on an idle worker: its
    previous prompt cached), and the prompt tokens an unbounded cluster-wide prefix cache would
    compute (`loadgen.capacity.kv_demand`'s two counts)."""
    planned: list[tuple[float, int, int]] = []
    for si, s in enumerate(sessions):
        t = s.start_s
        for ti, turn in enumerate(s.turns):
            if ti:
                t += turn.gap_s
            planned.append((t, si, ti))
    planned.sort()
    seen: set[int] = set()
    new: dict[tuple[int, int], int] = {}
    for _, si, ti in planned:
        turn = sessions[si].turns[ti]
        hit = 0
        while hit < len(turn.chain) and turn.chain[hit] in seen:
            hit += 1
        new[(si, ti)] = turn.input_tokens - min(hit * block_tokens, turn.input_tokens)
        seen.update(turn.chain)
    ttft, tpot, ideal = [], [], []
    for si, s in enumerate(sessions):
        ideal.append(tuple(new[(si, ti)] for ti in range(len(s.turns))))
        refs = []
        prev: tuple[int, ...] = ()
        for turn in s.turns:
            hit = 0
            while hit < len(turn.chain) and hit < len(prev) and turn.chain[hit] == prev[hit]:
                hit += 1
            cached = min(hit * block_tokens, turn.input_tokens)
            refs.append(unloaded_ttft_s(profile, turn.input_tokens - cached, cached))
            prev = turn.chain
        ttft.append(tuple(refs))
        tpot.append(
            tuple(unloaded_tpot_s(profile, x.input_tokens + x.output_tokens) for x in s.turns)
        )
    return tuple(ttft), tuple(tpot), tuple(ideal)


# --- one run -----------------------------------------------------------------------------------


def sim_observation(
    case: SimCase,
    label: str,
    split: str,
    rate: float,
    profile: TimingProfile,
    *,
    seed: int = 0,
    admission: str = "own",
) -> Observation:
    """`label` on `case`'s cluster in shape `split`, its sessions at `rate` per minute; the
    observation's `detail` is the simulator's summary plus the ideal prefill of the requests
    it ran."""
    from planner.policies import get_policy
    from planner.policies.peers import PEERS

    name = sim_policy(label)
    policy = get_policy(name)
    peer = name in PEERS
    sessions = case.sessions_at(rate)
    sim = Simulator(
        case.spec(split),
        profile,
        policy,
        seed=seed,
        full_view=peer,
        rate_per_min=rate,
        working_set_views=not peer,
        kv_spec=peer_kv_spec(name, case.kv_spec),
        retention=case.retention,
    )
    gate = RecordingGate(gate_for(name, policy, sim, admission))
    sim.gate = gate
    res = sim.run(sessions)
    per: dict[int, list[RequestSample]] = {}
    turn_of: dict[int, int] = {}
    ideal = 0
    for k, req in enumerate(gate.started_order):
        si = req.session
        ti = turn_of.get(si, 0)
        turn_of[si] = ti + 1
        ttft, step = res.ttft_s[k], res.tpot_s[k]
        out = sessions[si].turns[ti].output_tokens
        tpot: float | None = None
        if req.ended is not None and out >= 2:
            first = req.arrived + ttft
            tpot = max(step, (req.ended - first) / (out - 1))
        per.setdefault(si, []).append(
            RequestSample(ttft, tpot, case.ttft_ref_s[si][ti], case.tpot_ref_s[si][ti])
        )
        ideal += case.ideal_prefill_tokens[si][ti]
    samples = tuple(
        SessionSample(si in gate.completed, tuple(per.get(si, ()))) for si in range(len(sessions))
    )
    detail: dict[str, Any] = {
        **res.summary(),
        "policy": label,
        "split": split,
        "prefill_tokens_ideal": ideal,
    }
    return Observation(rate, samples, detail=detail)


def sim_point(obs: Observation, label: str, attainments: Mapping[str, float]) -> dict[str, Any]:
    """One simulated point as `capacity_latest.json` rows have it (emulated names kept)."""
    d = obs.detail or {}
    return {
        "target": label,
        "split": d.get("split"),
        "rate": obs.rate,
        "goodput_per_min": d.get("goodput_per_min"),
        "e2e_mean_s": d.get("e2e_mean_s"),
        "prefill_tokens_computed": d.get("prefill_tokens"),
        "prefill_tokens_ideal": d.get("prefill_tokens_ideal"),
        "kv_bytes_moved": round(1e9 * float(d.get("network_kv_gb", 0.0))),
        "duplicate_factor": d.get("dup_factor"),
        "errors": d.get("rejected", 0),
        "rejected_429": d.get("rejected_429", 0),
        "sessions": d.get("sessions"),
        "sessions_completed": d.get("sessions_completed"),
        "attainment": dict(attainments),
    }
