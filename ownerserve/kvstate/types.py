"""The vocabulary of heterogeneous KV state: state types, attention types and storage dtypes."""

from __future__ import annotations

from enum import StrEnum


class StateType(StrEnum):
    """The kinds of KV state a request holds (HeteroCache's state types)."""

    DENSE_KV = "dense_kv"
    """Per-token KV of dense attention (MHA/GQA/MQA) or MLA latents: one entry per token."""
    COMPRESSED_CSA_MAIN = "csa_main"
    """CSA compressed KV: one entry per m original tokens."""
    COMPRESSED_CSA_INDEX = "csa_index"
    """The CSA lightning indexer's keys: one small entry per m original tokens."""
    COMPRESSED_HCA = "hca"
    """HCA heavily compressed KV: one entry per m' original tokens."""
    WINDOW_SWA = "swa"
    """The last n_win uncompressed entries of a sliding-window branch (mutable session state)."""
    TAIL_STATE = "tail"
    """Pending per-token states of an incomplete compression block (mutable session state)."""


SEALED_TYPES: frozenset[StateType] = frozenset(
    {
        StateType.DENSE_KV,
        StateType.COMPRESSED_CSA_MAIN,
        StateType.COMPRESSED_CSA_INDEX,
        StateType.COMPRESSED_HCA,
    }
)
"""State that, once a cache block is complete, never changes: immutable, shareable artifacts."""

MUTABLE_TYPES: frozenset[StateType] = frozenset({StateType.WINDOW_SWA, StateType.TAIL_STATE})
"""State that changes with every token: owned by the session's decode owner, never shared."""


class AttentionType(StrEnum):
    """How one layer attends, which decides which state types it keeps."""

    DENSE = "dense"
    """Full attention over per-token K and V (MHA, GQA, MQA); also the dense fallback."""
    MLA = "mla"
    """Multi-head latent attention: one latent (plus decoupled RoPE key) per token."""
    SWA = "swa"
    """Sliding-window attention only: keeps the last `window` tokens."""
    CSA = "csa"
    """Compressed sparse attention: entries per m tokens, a lightning indexer, a SWA branch."""
    HCA = "hca"
    """Heavily compressed attention: entries per m' tokens, dense over them, a SWA branch."""


class DType(StrEnum):
    """Storage precision of a cache entry."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    FP4 = "fp4"

    @property
    def bits(self) -> int:
        return _BITS[self]


_BITS: dict[DType, int] = {
    DType.FP32: 32,
    DType.BF16: 16,
    DType.FP16: 16,
    DType.FP8: 8,
    DType.FP4: 4,
}
