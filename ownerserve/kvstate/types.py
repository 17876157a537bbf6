"""The vocabulary of heterogeneous KV state: state types, attention types, storage dtypes and
the sliding-window caching policy."""

from __future__ import annotations

from dataclasses import dataclass
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


class SwaCaching(StrEnum):
    """How a model's sliding-window state is kept off-GPU (a per-model setting, `swa_policy:`
    in its spec file). vLLM's prefix cache keeps a retention interval for SWA/state groups
    (unset: every window, N, 0: only the last prompt boundary); SGLang HiCache offloads only
    compressed KV and re-prefills the SWA tail after load-back (ZERO)."""

    FULL = "full"
    """Every sealed block boundary restorable: the window entries of every token are kept."""
    PERIODIC = "periodic"
    """A window checkpoint every `period_tokens` tokens: multiples of p are restorable."""
    ZERO = "zero"
    """No window state off-GPU: a restore recomputes the last n_win·L tokens."""
    COST = "cost"
    """A period p* chosen per model by cost (`ownerserve.kvstate.spec.cost_based_period`):
    periodic(p*) once resolved, zero when p* = 0."""


@dataclass(frozen=True, slots=True)
class SwaPolicy:
    """How window state is kept off-GPU, and so which sealed boundaries have a window
    checkpoint to restore from (`checkpoint_at`, `restorable`).

    `period_tokens`: PERIODIC's p; for COST the resolved p* (0: unresolved, or resolved to
    zero caching when `resolved`)."""

    caching: SwaCaching
    period_tokens: int = 0
    resolved: bool = True

    def __post_init__(self) -> None:
        if self.period_tokens < 0:
            raise ValueError("period_tokens must not be negative")
        if self.caching is SwaCaching.PERIODIC and self.period_tokens <= 0:
            raise ValueError("periodic SWA checkpointing needs period_tokens > 0")
        if self.caching is not SwaCaching.COST and not self.resolved:
            raise ValueError("only a cost-based SWA policy can be unresolved")

    @classmethod
    def full(cls) -> SwaPolicy:
        return cls(SwaCaching.FULL)

    @classmethod
    def periodic(cls, period_tokens: int) -> SwaPolicy:
        return cls(SwaCaching.PERIODIC, period_tokens)

    @classmethod
    def zero(cls) -> SwaPolicy:
        return cls(SwaCaching.ZERO)

    @classmethod
    def cost_based(cls, period_tokens: int | None = None) -> SwaPolicy:
        """Cost-based caching; `period_tokens` is p* once chosen (0: zero caching won), None
        while it is still to be chosen for a deployment's profile."""
        if period_tokens is None:
            return cls(SwaCaching.COST, 0, resolved=False)
        return cls(SwaCaching.COST, period_tokens)

    @property
    def period(self) -> int:
        """Tokens between window checkpoints: 1 for full (every boundary), 0 for none."""
        if not self.resolved:
            raise ValueError("a cost-based SWA policy must be resolved to a period first")
        if self.caching is SwaCaching.FULL:
            return 1
        if self.caching is SwaCaching.ZERO:
            return 0
        return self.period_tokens

    def checkpoint_at(self, sealed_tokens: int) -> int:
        """The latest position <= `sealed_tokens` whose window state is stored (0: none)."""
        p = self.period
        if p == 0:
            return 0
        return sealed_tokens - sealed_tokens % p

    def restorable(self, boundary: int) -> bool:
        """Whether the windows at the sealed `boundary` can be loaded as they are (a checkpoint
        sits exactly there), rather than rebuilt from an earlier checkpoint or recomputed."""
        return boundary > 0 and self.checkpoint_at(boundary) == boundary

    def __str__(self) -> str:
        if self.caching is SwaCaching.PERIODIC:
            return f"periodic({self.period_tokens})"
        if self.caching is SwaCaching.COST:
            return f"cost({self.period_tokens})" if self.resolved else "cost"
        return self.caching.value


DEFAULT_SWA_POLICY = SwaPolicy.periodic(4096)
"""A spec file without `swa_policy:` checkpoints its windows every 4096 tokens."""
