"""Helpers shared by the directory backends: argument checks, tier bits, block-hash encoding,
and the `transfer` and `add_replica` entry points every directory answers through."""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from ownerserve.directory.base import Artifact, Holding, HoldKind, Lease
from ownerserve.errors import InvalidRequestError, StaleEpochError
from ownerserve.types import TIER_ORDER, Tier

TIER_BIT: dict[Tier, int] = {Tier.GPU: 1, Tier.CPU: 2, Tier.SSD: 4}
"""Bit of each tier in a worker's cached-tier mask (one byte per worker in Redis)."""

_KIND_ORDER = {HoldKind.OWNER: 0, HoldKind.REPLICA: 1, HoldKind.CACHED: 2}
_TIER_INDEX = {t: i for i, t in enumerate(TIER_ORDER)}
_MAX_HASH = (1 << 64) - 1


def check_worker(worker: str) -> str:
    """Worker ids are stored in keys and tab-separated records: no control characters."""
    if not isinstance(worker, str) or not worker or any(ord(c) < 32 for c in worker):
        raise InvalidRequestError(f"invalid worker id {worker!r}")
    return worker


def check_ttl(seconds: float, what: str = "lease_s") -> float:
    if not isinstance(seconds, int | float) or not math.isfinite(seconds) or seconds <= 0:
        raise InvalidRequestError(f"{what} must be a positive number, got {seconds!r}")
    return float(seconds)


@dataclass(frozen=True, slots=True)
class TransferMove:
    """The checked arguments of one `transfer`: hand `chain` from one worker to another."""

    chain: tuple[int, ...]
    from_worker: str
    to_worker: str
    lease_s: float
    replica_ttl_s: float
    tier: Tier


def check_transfer(
    chain: Sequence[int],
    from_worker: str,
    to_worker: str,
    lease_s: float,
    replica_ttl_s: float,
    tier: Tier,
) -> TransferMove:
    """Arguments of `transfer`, checked; durations as floats, the chain as a tuple."""
    check_worker(from_worker)
    check_worker(to_worker)
    if from_worker == to_worker:
        raise InvalidRequestError(f"transfer from {from_worker!r} to itself")
    if not chain:
        raise InvalidRequestError("transfer of an empty chain")
    return TransferMove(
        tuple(chain),
        from_worker,
        to_worker,
        check_ttl(lease_s),
        check_ttl(replica_ttl_s, "replica_ttl_s"),
        Tier(tier),
    )


class TransferEntryPoints:
    """`transfer` of a directory: the arguments are checked here, the move itself is the
    directory's `move_leases`."""

    async def transfer(
        self,
        chain: Sequence[int],
        from_worker: str,
        to_worker: str,
        lease_s: float,
        replica_ttl_s: float,
        tier: Tier = Tier.GPU,
    ) -> int:
        move = check_transfer(chain, from_worker, to_worker, lease_s, replica_ttl_s, tier)
        moved, _ = await self.move_leases(move)
        return moved

    async def move_leases(self, move: TransferMove) -> tuple[int, tuple[Lease, ...]]:
        """`transfer`, plus the leases it handed over (what `ResilientDirectory` replays and
        mirrors). One epoch for all of them: the move is one event."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class ReplicaWrite:
    """The checked arguments of one `add_replica`: a copy of the artifact's prefix on `worker`
    for `ttl_s`, over `blocks` (None: the artifact's own blocks, or just its id)."""

    artifact_id: int
    worker: str
    tier: Tier
    ttl_s: float
    read_only: bool
    blocks: Sequence[int] | None


class ReplicaEntryPoints:
    """`add_replica` of a directory: the arguments are checked here, the write itself is the
    directory's `put_replica`."""

    async def add_replica(
        self,
        artifact_id: int,
        worker: str,
        tier: Tier,
        ttl_s: float,
        read_only: bool = True,
        blocks: Sequence[int] | None = None,
    ) -> None:
        check_worker(worker)
        ttl_s = check_ttl(ttl_s, "ttl_s")
        await self.put_replica(
            ReplicaWrite(artifact_id, worker, Tier(tier), ttl_s, read_only, blocks)
        )

    async def put_replica(self, write: ReplicaWrite) -> None:
        """`add_replica`, its arguments checked."""
        raise NotImplementedError


def check_holder(worker: str, tier: Tier, incarnation: int) -> Tier:
    """A replica holder's arguments: a valid worker id, a tier (returned as `Tier`) and an
    incarnation, a positive integer below 2^63 (it travels as decimal text and is compared as
    such)."""
    check_worker(worker)
    if isinstance(incarnation, bool) or not isinstance(incarnation, int):
        raise InvalidRequestError(f"incarnation must be an integer, got {incarnation!r}")
    if not 0 < incarnation < 1 << 63:
        raise InvalidRequestError(f"incarnation must be in [1, 2^63), got {incarnation}")
    return Tier(tier)


def holder_lapsed(worker: str, tier: Tier, incarnation: int) -> StaleEpochError:
    """The error of a renewal of an incarnation whose lease lapsed or was ended."""
    return StaleEpochError(f"replica holder {worker}/{tier} incarnation {incarnation} has lapsed")


def holder_not_live(worker: str, tier: Tier, incarnation: int) -> StaleEpochError:
    """The error of held lines written without a live lease at that incarnation."""
    return StaleEpochError(
        f"replica holder {worker}/{tier} is not live at incarnation {incarnation}"
    )


def check_artifact(artifact: Artifact) -> None:
    if not artifact.chain:
        raise InvalidRequestError("artifact chain is empty")
    if not 0 <= artifact.start < len(artifact.chain):
        raise InvalidRequestError(
            f"artifact start {artifact.start} outside chain of {len(artifact.chain)} blocks"
        )
    if artifact.size_bytes < 0:
        raise InvalidRequestError("artifact size_bytes must be >= 0")


def hex_blocks(blocks: Sequence[int]) -> str:
    """Block hashes as one string of 16 hex digits each (the Redis field names)."""
    try:
        return struct.pack(f">{len(blocks)}Q", *blocks).hex()
    except struct.error as exc:
        raise InvalidRequestError(f"block hashes must be unsigned 64-bit integers: {exc}") from None


def hex_block(block: int) -> str:
    if not isinstance(block, int) or not 0 <= block <= _MAX_HASH:
        raise InvalidRequestError(f"block hash must be an unsigned 64-bit integer: {block!r}")
    return format(block, "016x")


def sort_holdings(holdings: list[Holding]) -> tuple[Holding, ...]:
    """The one order both backends answer in: owners, replicas, cached; then worker, tier."""
    holdings.sort(key=lambda h: (_KIND_ORDER[h.kind], h.worker, _TIER_INDEX[h.tier]))
    return tuple(holdings)
