"""How a plan is shown to clients and operators: the `x-ownerserve-plan` response header
(the planner's `plan_to_header`, the chosen candidate's cost breakdown and what ran instead
when a hop was given up) and the record kept for `GET /admin/plans`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ownerserve.directory.base import Match
from ownerserve.directory.restorable import RestorableUnit
from ownerserve.kvprobe import PriceSource, TransportPrice
from ownerserve.kvstate import load_spec
from ownerserve.records import fast_init
from ownerserve.types import Tier
from planner import plan_to_dict, plan_to_header
from planner.types import Plan


@dataclass(frozen=True, slots=True)
class GaveUp:
    """A worker the router gave up on before the answer's first byte, and why: one of
    `connect_timeout`, `connect_failed`, `first_byte_timeout`, `kv_transfer_timeout`,
    `kv_transfer_failed` (a P/D hand-over or fetch that failed otherwise), `kv_fetch_empty`
    (a fetch's source had none of the prefix: the directory's record of it was stale; not the
    worker's failure), `upstream_failed` (a 5xx, or the connection lost before the first
    byte)."""

    worker: str
    reason: str


Ran = Literal["colocated", "other_worker"]
"""What ran instead of a plan: its decode worker computing the prompt itself (its P/D
hand-over or fetch given up), or another worker (the request planned again without those
that failed it)."""


@dataclass(frozen=True, slots=True)
class Fallback:
    """What ran instead of the plan (`Ran`: the last fallback's), and the hops given up on
    the way, in order."""

    ran: Ran
    gave_up: tuple[GaveUp, ...]

    @property
    def reason(self) -> str:
        """Why the last fallback happened."""
        return self.gave_up[-1].reason

    def then(self, ran: Ran, gave_up: GaveUp) -> Fallback:
        return Fallback(ran, (*self.gave_up, gave_up))


@dataclass(frozen=True, slots=True)
class RestoreShown:
    """What the plan's worker can restore of the prompt, for a hybrid-attention model
    (`Match.restorable`): from `tier`, every KV cache group down to boundary `blocks`, the
    sealed groups down to `sealed_blocks` (past `blocks` the windows are rebuilt), and the
    bytes of each state type of that prefix (the model's spec, `models[].kv_spec`)."""

    worker: str
    tier: Tier
    blocks: int
    sealed_blocks: int
    state_bytes: tuple[tuple[str, int], ...]

    def fields(self) -> str:
        """`restore=WORKER:TIER:BLOCKS/SEALED;state_bytes=TYPE:BYTES,...`"""
        by_type = ",".join(f"{t}:{n}" for t, n in self.state_bytes)
        return (
            f"restore={self.worker}:{self.tier.value}:{self.blocks}/{self.sealed_blocks}"
            f";state_bytes={by_type}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "worker": self.worker,
            "tier": self.tier.value,
            "blocks": self.blocks,
            "sealed_blocks": self.sealed_blocks,
            "state_bytes": dict(self.state_bytes),
        }


def restore_shown(
    match: Match, plan: Plan, kv_spec: str | None, block_size: int
) -> RestoreShown | None:
    """What `plan`'s decode worker can restore of the looked-up prompt (GPU first, then
    CPU), or None for a dense model (no worker's events name KV cache groups, or no spec)."""
    if not match.restorable or kv_spec is None:
        return None
    worker = plan.chosen.decode_worker
    unit = match.restorable_on(worker, Tier.GPU) or match.restorable_on(worker, Tier.CPU)
    if unit is None:
        return None
    spec = load_spec(kv_spec)
    by_type = spec.state_bytes(0, unit.sealed_blocks * block_size)
    return RestoreShown(
        worker,
        unit.tier,
        unit.blocks,
        unit.sealed_blocks,
        tuple((t.value, n) for t, n in by_type.items()),
    )


def fallback_fields(fallback: Fallback) -> str:
    """`fallback=RAN;reason=WHY;gave_up=WHY:WORKER,...` (worker ids hold no `,`; reasons no
    `:`)."""
    gave_up = ",".join(f"{g.reason}:{g.worker}" for g in fallback.gave_up)
    return f"fallback={fallback.ran};reason={fallback.reason};gave_up={gave_up}"


def kv_prices_field(prices: Sequence[TransportPrice]) -> str:
    """`kv_prices=TRANSPORT:measured,...`: the KV transports the planner prices at a probe's
    measured rate; "" when every one is configured (the header then says nothing of them)."""
    measured = [p.transport.value for p in prices if p.source is PriceSource.MEASURED]
    return f"kv_prices={','.join(t + ':measured' for t in measured)}" if measured else ""


def plan_header(
    plan: Plan,
    fetched: bool | None = None,
    fallback: Fallback | None = None,
    ran: Plan | None = None,
    fetched_blocks: tuple[int, int] | None = None,
    chunks: tuple[int, int, int] | None = None,
    restore: RestoreShown | None = None,
    kv_prices: str = "",
) -> bytes:
    """`key=value;...`: policy, class, action, workers, cost and runner-up, then the cost
    terms of the chosen candidate (seconds; `m_hbm` in bytes), whether a fetch succeeded and
    how many of its blocks the destination holds (`fetched_blocks=GOT/PLANNED`), for a
    chunked prompt its chunks as they ran (`chunks=REUSED/FETCHED/RECOMPUTED`), for a
    hybrid-attention model what the worker can restore and its bytes by state type
    (`RestoreShown.fields`), `kv_prices` (`kv_prices_field`, when any transport is priced as
    measured) and, when something else ran, `ran=ACTION;ran_workers=P>D` and
    `fallback_fields`."""
    b = plan.chosen.cost
    text = (
        f"{plan_to_header(plan)};t_queue={b.t_queue:.6g};t_compute={b.t_compute:.6g}"
        f";t_network={b.t_network:.6g};t_restore={b.t_restore:.6g};m_hbm={b.m_hbm_bytes:.6g}"
        f";i_decode={b.i_decode:.6g}"
    )
    if b.w_disp:
        text += f";w_disp={b.w_disp:.6g}"
    if fetched is not None:
        text += f";fetched={'1' if fetched else '0'}"
    if fetched_blocks is not None:
        text += f";fetched_blocks={fetched_blocks[0]}/{fetched_blocks[1]}"
    if chunks is not None:
        text += f";chunks={chunks[0]}/{chunks[1]}/{chunks[2]}"
    if restore is not None:
        text += ";" + restore.fields()
    if kv_prices:
        text += ";" + kv_prices
    if ran is not None and ran is not plan:
        c = ran.chosen
        text += f";ran={c.action.value};ran_workers={c.prefill_worker}>{c.decode_worker}"
    if fallback is not None:
        text += ";" + fallback_fields(fallback)
    return text.encode("latin-1", errors="replace")


@fast_init
@dataclass(frozen=True, slots=True)
class PlanRecord:
    """One executed plan, as `GET /admin/plans` lists it (the dict is built lazily); a
    continuation's (`migrated_from`: the worker whose answer it took over mid-stream) is listed
    after its request's first plan."""

    at: float
    session_id: str | None
    plan: Plan
    fetched: bool | None
    fallback: Fallback | None = None
    ran: Plan | None = None
    fetched_blocks: tuple[int, int] | None = None
    chunks: tuple[int, int, int] | None = None
    migrated_from: str | None = None
    restore: RestoreShown | None = None
    restorable: tuple[RestorableUnit, ...] = ()
    """What every hybrid worker could restore of the prompt (`Match.restorable`)."""

    @classmethod
    def of(
        cls,
        plan: Plan,
        session_id: str | None,
        fetched: bool | None,
        fallback: Fallback | None = None,
        ran: Plan | None = None,
        fetched_blocks: tuple[int, int] | None = None,
        chunks: tuple[int, int, int] | None = None,
        migrated_from: str | None = None,
        restore: RestoreShown | None = None,
        restorable: tuple[RestorableUnit, ...] = (),
    ) -> PlanRecord:
        return cls(
            time.time(),
            session_id,
            plan,
            fetched,
            fallback,
            ran,
            fetched_blocks,
            chunks,
            migrated_from,
            restore,
            restorable,
        )

    def as_dict(self) -> dict[str, Any]:
        out = plan_to_dict(self.plan)
        out.update(at=self.at, session_id=self.session_id, fetched=self.fetched)
        out["migrated_from"] = self.migrated_from
        out["restore"] = None if self.restore is None else self.restore.as_dict()
        out["restorable"] = [
            {"worker": u.worker, "tier": u.tier.value, "blocks": u.blocks,
             "sealed_blocks": u.sealed_blocks}
            for u in self.restorable
        ]  # fmt: skip
        fb_blocks = self.fetched_blocks
        out["fetched_blocks"] = None if fb_blocks is None else list(fb_blocks)
        ch = self.chunks
        out["chunks"] = (
            None if ch is None else {"reused": ch[0], "fetched": ch[1], "recomputed": ch[2]}
        )
        ran = self.ran
        out["ran"] = None if ran is None or ran is self.plan else {
            "action": ran.chosen.action.value,
            "prefill_worker": ran.chosen.prefill_worker,
            "decode_worker": ran.chosen.decode_worker,
        }  # fmt: skip
        fb = self.fallback
        out["fallback"] = None if fb is None else {
            "ran": fb.ran,
            "reason": fb.reason,
            "gave_up": [{"worker": g.worker, "reason": g.reason} for g in fb.gave_up],
        }  # fmt: skip
        return out
