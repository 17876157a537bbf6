"""Small enums shared by every package: worker roles, backend kinds, memory tiers."""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """What a worker does in the xPyD cluster."""

    PREFILL = "prefill"
    DECODE = "decode"
    HYBRID = "hybrid"


class BackendKind(StrEnum):
    """Which wire protocol a worker speaks."""

    VLLM = "vllm"
    SGLANG = "sglang"
    EMULATOR = "emulator"


class Tier(StrEnum):
    """Where a copy of KV lives; ordered fastest first."""

    GPU = "gpu"
    CPU = "cpu"
    SSD = "ssd"


TIER_ORDER: tuple[Tier, ...] = (Tier.GPU, Tier.CPU, Tier.SSD)
