"""The chaos bench's fault schedule and the arithmetic of its report: which fault happens when and
to whom (seeded, so a run can be repeated), and the slope of a series (memory over time)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

FAULT_KINDS: tuple[str, ...] = (
    "worker_kill",
    "worker_stop",
    "redis_restart",
    "router_restart",
    "pd_drop",
    "sidecar_kill",
    "store_master_kill",
)
"""Every fault the bench knows:

- `worker_kill`: SIGKILL a worker; once the directory no longer names it as an owner (or a
  bound passed), start it again on the same ports, with cold caches;
- `worker_stop`: SIGSTOP a worker, SIGCONT it `stop_s` later (a hung engine that comes back);
- `redis_restart`: SIGKILL Redis, start it again on the same port and data directory;
- `router_restart`: SIGTERM the second router replica (a graceful stop), start it again;
- `pd_drop`: SIGKILL the prefill worker of the P/D pair while it has requests in flight (the
  KV hand-over to its decode worker is cut), then as `worker_kill`;
- `sidecar_kill`: SIGKILL a worker's KV sidecar while a peer sidecar's fetch from it is in
  flight; once the directory names none of its replicas, start it again (its memory tier
  empty). The scheduled sidecar is killed once the directory names replicas on it; if it
  holds none within two replica TTLs and a lease, the peer holding the most is. Needs KV
  sidecars (`--kv-sidecars tcp` or `store`);
- `store_master_kill`: SIGKILL the Mooncake Store master the sidecars keep their artifacts
  on, start it again on the same ports (the objects it held are gone); the sidecars' puts
  must resume. Needs `--kv-sidecars store`."""

SIDECAR_MODES: dict[str, tuple[str, ...]] = {
    "sidecar_kill": ("tcp", "store"),
    "store_master_kill": ("store",),
}
"""The faults that need KV sidecars, and the `--kv-sidecars` modes they run under."""


def unsupported(kinds: Sequence[str], kv_sidecars: str) -> dict[str, str]:
    """Of `kinds`, those the topology cannot run, and why."""
    out = {}
    for kind in kinds:
        modes = SIDECAR_MODES.get(kind)
        if modes is not None and kv_sidecars not in modes:
            out[kind] = f"needs --kv-sidecars {' or '.join(modes)} (this run: {kv_sidecars}): " + (
                "no sidecar process exists to kill"
                if kind == "sidecar_kill"
                else "no Mooncake Store master exists to kill"
            )
    return out


def sidecar_mode_for(kinds: Sequence[str]) -> str:
    """`--kv-sidecars auto`: the least topology every fault of `kinds` runs on."""
    if "store_master_kill" in kinds:
        return "store"
    if "sidecar_kill" in kinds:
        return "tcp"
    return "off"


@dataclass(frozen=True, slots=True)
class ScheduledFault:
    """One fault: at `at_s` seconds into the load, `kind` happens to `target` (a worker id,
    `redis`, or a router replica's name)."""

    at_s: float
    kind: str
    target: str


def fault_schedule(
    kinds: Sequence[str],
    repeats: int,
    start_s: float,
    end_s: float,
    seed: int,
    *,
    victims: Sequence[str],
    prefill: Sequence[str],
    replica: str,
    sidecars: Sequence[str] | None = None,
) -> tuple[ScheduledFault, ...]:
    """`repeats` rounds of every kind in `kinds`, each round in its own seeded order, spread
    evenly over `[start_s, end_s)`: fault i of n starts in the i-th of n equal slots, at a
    seeded point in the slot's first third (so two faults are at least two thirds of a slot
    apart). `worker_kill` and `worker_stop` pick their worker from `victims` in a seeded
    order that visits each before repeating one, `pd_drop` its worker from `prefill`,
    `sidecar_kill` the worker whose sidecar dies from `sidecars` (default `victims`);
    `router_restart` restarts `replica`, `store_master_kill` the `mooncake_master`."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if end_s <= start_s:
        raise ValueError(f"the schedule needs end_s > start_s, got [{start_s:g}, {end_s:g})")
    unknown = [k for k in kinds if k not in FAULT_KINDS]
    if unknown:
        raise ValueError(f"unknown faults {unknown}; choose from {', '.join(FAULT_KINDS)}")
    if not kinds:
        return ()
    rng = random.Random(f"chaos:{seed}")
    order: list[str] = []
    for _ in range(repeats):
        round_ = list(dict.fromkeys(kinds))
        rng.shuffle(round_)
        if order and len(round_) > 1 and round_[0] == order[-1]:
            round_[0], round_[-1] = round_[-1], round_[0]  # never the same fault twice in a row
        order.extend(round_)
    pickers = {
        "worker_kill": _Cycle(victims, rng),
        "worker_stop": _Cycle(victims, rng),
        "pd_drop": _Cycle(prefill, rng),
        "sidecar_kill": _Cycle(victims if sidecars is None else sidecars, rng),
    }
    width = (end_s - start_s) / len(order)
    out = []
    for i, kind in enumerate(order):
        at = start_s + i * width + rng.uniform(0.0, width / 3)
        if kind in pickers:
            target = pickers[kind].next(kind)
        elif kind == "redis_restart":
            target = "redis"
        elif kind == "router_restart":
            target = replica
        elif kind == "store_master_kill":
            target = "mooncake_master"
        else:
            target = ""
        out.append(ScheduledFault(round(at, 3), kind, target))
    return tuple(out)


class _Cycle:
    """Seeded rounds over `items`: each item once per round, in a new order every round."""

    def __init__(self, items: Sequence[str], rng: random.Random) -> None:
        self.items = list(items)
        self.rng = rng
        self.left: list[str] = []

    def next(self, kind: str) -> str:
        if not self.items:
            raise ValueError(f"{kind} needs a worker to act on; the topology has none")
        if not self.left:
            self.left = list(self.items)
            self.rng.shuffle(self.left)
        return self.left.pop()


def slope_per_min(samples: Sequence[tuple[float, float]]) -> float | None:
    """The least-squares slope of `(t_s, value)` samples, per minute; None below 3 samples or
    when every sample has the same time."""
    if len(samples) < 3:
        return None
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_v = sum(v for _, v in samples) / n
    var = sum((t - mean_t) ** 2 for t, _ in samples)
    if var == 0:
        return None
    cov = sum((t - mean_t) * (v - mean_v) for t, v in samples)
    return cov / var * 60.0
