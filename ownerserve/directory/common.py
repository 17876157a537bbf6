"""Helpers shared by the directory backends: argument checks, tier bits, block-hash encoding."""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

from ownerserve.directory.base import Artifact, Holding, HoldKind
from ownerserve.errors import InvalidRequestError
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


def check_transfer(
    chain: Sequence[int], from_worker: str, to_worker: str, lease_s: float, replica_ttl_s: float
) -> tuple[float, float]:
    """Arguments of `transfer`; returns (lease_s, replica_ttl_s) as floats."""
    check_worker(from_worker)
    check_worker(to_worker)
    if from_worker == to_worker:
        raise InvalidRequestError(f"transfer from {from_worker!r} to itself")
    if not chain:
        raise InvalidRequestError("transfer of an empty chain")
    return check_ttl(lease_s), check_ttl(replica_ttl_s, "replica_ttl_s")


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
