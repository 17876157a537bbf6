"""Small enums shared by every package: worker roles, backend kinds, KV paths, KV transports,
memory tiers."""

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


class KVPath(StrEnum):
    """A way KV moves into or out of a worker (a worker's `kv_paths`): the planner plans only
    routes whose workers have the paths they need."""

    NIXL_PD = "nixl_pd"
    """vLLM's P/D hand-over: P answers with `kv_transfer_params` and D pulls the KV (NIXL);
    the emulated engine speaks it too."""
    BOOTSTRAP_PD = "bootstrap_pd"
    """SGLang's P/D hand-over: P and D meet at a bootstrap room on P."""
    SIDECAR = "sidecar"
    """An OwnerServe KV API (the worker's sidecar with the KV connector, or the emulated
    engine's own): it pulls a fetched prefix in and serves its own to other workers (artifact
    fetch, state migration: both ends need it)."""
    CHUNK_FETCH = "chunk_fetch"
    """Its KV API also pulls position-independent chunks (`ownerserve.chunks`) from other
    holders and serves its own (the emulated engine's; the sidecar has no chunk fetch yet)."""


PD_PATHS: dict[BackendKind, KVPath] = {
    BackendKind.VLLM: KVPath.NIXL_PD,
    BackendKind.SGLANG: KVPath.BOOTSTRAP_PD,
    BackendKind.EMULATOR: KVPath.NIXL_PD,
}
"""The P/D hand-over each backend kind speaks."""


class KVTransport(StrEnum):
    """The data path a move of KV bytes takes between two workers (or a tier and HBM), each
    priced by its own bandwidth and fixed latency (a profile's `kv_transports:`,
    `ownerserve.profiles.TransportTiming`)."""

    SAME_HOST = "same_host"
    """Within one host: a pinned host copy / shared memory (or NVLink between its GPUs)."""
    STORE_TCP = "store_tcp"
    """Through Mooncake Store with its transfer engine over TCP."""
    STORE_RDMA = "store_rdma"
    """Through Mooncake Store with its transfer engine over RDMA."""


class Tier(StrEnum):
    """Where a copy of KV lives; ordered fastest first."""

    GPU = "gpu"
    CPU = "cpu"
    SSD = "ssd"


TIER_ORDER: tuple[Tier, ...] = (Tier.GPU, Tier.CPU, Tier.SSD)
