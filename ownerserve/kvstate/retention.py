"""Which prefix boundaries keep a sequence's mutable state (sliding windows, per-sequence
state) once it moves on: the prefix-cache retention policy of vLLM's hybrid KV cache manager
(`VLLM_PREFIX_CACHE_RETENTION_INTERVAL`, the `reachable_block_mask` of its sliding-window and
Mamba managers), which decides at which boundaries a later prefix hit can resume.

- `FULL` (interval unset): every block boundary keeps its window, as plain prefix caching;
- `periodic(N)`: every boundary at a multiple of N tokens, and the last prompt boundary;
- `ZERO` (interval 0): only the last prompt boundary (where the next turn resumes).

Sealed groups are unaffected: their blocks are cached at every boundary. A boundary whose
state is not kept can still be resumed from by rebuilding the windows (recomputing the last
n_win·L tokens over the cached sealed KV: `KVStateSpec.swa_recompute_tokens`). Pure logic.

This is the engine's HBM prefix cache (what the emulated engine keeps, as vLLM does); which
boundaries a CPU/SSD copy keeps window checkpoints for is the model's off-GPU policy,
`SwaPolicy` (`swa_policy:` in its spec file), priced by the restore planner and followed by
the emulated engine's CPU tier.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ownerserve.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Retention:
    """A retention policy: `interval` None (every boundary), 0 (the last prompt boundary
    only) or N > 0 tokens."""

    interval: int | None = None

    def __post_init__(self) -> None:
        if self.interval is not None and self.interval < 0:
            raise ConfigError(f"retention interval must be >= 0, got {self.interval}")

    @classmethod
    def parse(cls, value: str | int | None) -> Retention:
        """`None`/`"full"`/`"all"`: FULL; `0`/`"zero"`: ZERO; an integer N: every N tokens."""
        if value is None:
            return cls(None)
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(value)
        text = str(value).strip().lower()
        if text in ("", "full", "all", "none"):
            return cls(None)
        if text == "zero":
            return cls(0)
        try:
            return cls(int(text))
        except ValueError:
            raise ConfigError(
                f"retention must be 'full', 'zero' or a token interval, got {value!r}"
            ) from None

    @property
    def name(self) -> str:
        """`full`, `zero` or `periodic:N`."""
        if self.interval is None:
            return "full"
        return "zero" if self.interval == 0 else f"periodic:{self.interval}"

    def keeps(self, boundary: int, last_prompt_boundary: int) -> bool:
        """Whether the state at `boundary` (tokens, a block boundary > 0) stays cached once
        the sequence has moved past it; `last_prompt_boundary` is the last block boundary of
        the sequence's prompt."""
        if boundary <= 0:
            return False
        if self.interval is None or boundary == last_prompt_boundary:
            return True
        return self.interval > 0 and boundary % self.interval == 0

    def kept_boundaries(self, block_tokens: int, last_prompt_boundary: int, upto: int) -> list[int]:
        """Every boundary in (0, upto] whose state this policy keeps (for tests and plans)."""
        return [
            b
            for b in range(block_tokens, upto + 1, block_tokens)
            if self.keeps(b, last_prompt_boundary)
        ]


FULL = Retention(None)
ZERO = Retention(0)


def periodic(interval: int) -> Retention:
    """Keep every `interval` tokens (and the last prompt boundary)."""
    if interval <= 0:
        raise ConfigError(f"a periodic retention interval must be positive, got {interval}")
    return Retention(interval)


WindowHeld = Callable[[int], bool]
"""Whether window block j (tokens [j·B, (j+1)·B)) of a prefix is cached."""


def restorable_boundary(attention_blocks: int, window_held: WindowHeld, window_blocks: int) -> int:
    """The deepest block boundary k <= `attention_blocks` where every group can be restored:
    the sealed groups hold blocks [0, k) and the window group holds the blocks
    [max(0, k - window_blocks), k); 0 when none is (a cold start). O(attention_blocks)."""
    run = 0  # consecutive held window blocks ending just below the boundary looked at
    # scan upwards, remembering the deepest boundary whose window is complete
    best = 0
    for j in range(attention_blocks):
        run = run + 1 if window_held(j) else 0
        k = j + 1
        if run >= min(window_blocks, k):
            best = k
    return best
