"""HeteroCache in the emulated engine: the KV cache groups of a hybrid-attention model beside the
engine's block pool, as vLLM's hybrid KV cache manager keeps them.

The engine's `BlockPool` is the sealed groups' block table: every sealed group (full attention,
CSA main KV and indexer, HCA) has an entry for every block of a prefix, sealed when the block is
complete (a block covers a multiple of every compression ratio), so they are cached, hit and
evicted together and a block's size is their bytes together (`sealed_block_bytes`). The
mutable groups — sliding windows and per-sequence state (compression tails) — have a pool of
their own (`WindowPool`): window block j holds the window entries of tokens [j·B, (j+1)·B) and,
at boundary j+1, the sequence's state. A running sequence references the last
`window_blocks` of them; a block that falls out of the window is kept cached only if a boundary
whose window it belongs to is one the retention policy keeps (`ownerserve.kvstate.retention`),
else dropped at once (vLLM frees sliding-window blocks past the window).

A prefix hit resumes only where every group can be restored (`choose`, the resume rule of
`ownerserve.kvstate.resume`, which the planner and the simulator predict with): at the deepest
boundary whose sealed blocks and window blocks are all cached, or deeper, at the sealed hit (or
past it, from the CPU tier), rebuilding the windows there by recomputing the last n_win·L tokens
over the cached sealed KV (the DeepSeek-V4 report's restore with zero SWA caching): whichever
reaches the same boundary in less modelled time.

KV events carry each group's tag as vLLM's do: the sealed pool's events once per sealed group,
the window pool's once per mutable group, with the group's index, kind and window.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ownerserve.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from ownerserve.kvstate import KVStateSpec
from ownerserve.kvstate.groups import (
    GroupKind,
    KVCacheGroup,
    kv_cache_groups,
    sealed_block_bytes,
)
from ownerserve.kvstate.resume import HostHit, Resume, ResumeRule, resume_point
from ownerserve.kvstate.retention import Retention, restorable_boundary
from ownerserve.kvstate.types import SwaPolicy
from ownerserve.profiles import TimingProfile
from workers.emulator.kv_cache import BlockPool, CachedBlock, HostPool, NewBlock

TokenReader = Callable[[int, int], tuple[int, ...]]
"""A sequence's token ids [lo, hi) (`Sequence.tokens`)."""


@dataclass(slots=True)
class WindowRef:
    """A window block a sequence references: block index j, pool block id, and whether it was
    cached before the sequence took it (then it stays cached when let go)."""

    index: int
    block_id: int
    was_cached: bool


def _tagged(events: Sequence[KVEvent], groups: Sequence[KVCacheGroup]) -> list[KVEvent]:
    """Each event once per group, tagged with the group (AllBlocksCleared once)."""
    out: list[KVEvent] = []
    for e in events:
        if isinstance(e, AllBlocksCleared):
            out.append(e)
            continue
        for g in groups:
            if isinstance(e, BlockStored):
                window = g.window if g.kind is GroupKind.SLIDING_WINDOW else None
                out.append(
                    dataclasses.replace(
                        e, group_idx=g.index, group_kind=g.vllm_kind, sliding_window=window
                    )
                )
            elif isinstance(e, BlockRemoved):
                out.append(dataclasses.replace(e, group_idx=g.index))
    return out


class HybridKV:
    """The groups of one hybrid spec in one engine: the window pool, the retention policy and
    the resume rule. Pure logic: no I/O, no clock."""

    def __init__(
        self,
        spec: KVStateSpec,
        block_size: int,
        retention: Retention,
        window_pool_blocks: int,
        offload: SwaPolicy | None = None,
        host_window_blocks: int = 0,
    ) -> None:
        self.spec = spec
        self.block_size = block_size
        self.retention = retention
        self.groups = kv_cache_groups(spec, block_size)
        self.sealed = tuple(g for g in self.groups if g.sealed)
        self.mutable = tuple(g for g in self.groups if not g.sealed)
        windows = [g for g in self.mutable if g.kind is GroupKind.SLIDING_WINDOW]
        self.window_blocks = max((g.window_blocks for g in windows), default=0)
        if not self.window_blocks and self.mutable:
            self.window_blocks = 1  # state only: the state at boundary j+1 lives with block j
        self.rule = ResumeRule.of(spec, block_size)
        """The resume rule of the spec on this engine's blocks (`ownerserve.kvstate.resume`)."""
        self.rebuild_tokens = self.rule.rebuild_tokens
        """Tokens recomputed to rebuild every window at a boundary: n_win·L."""
        self.block_bytes = sealed_block_bytes(self.groups)
        """Bytes of one block over every sealed group."""
        self.pool: BlockPool | None = (
            BlockPool(window_pool_blocks, block_size) if self.mutable else None
        )
        self.window_block_bytes = sum(g.block_bytes for g in self.mutable)
        policy = spec.swa_policy if offload is None else offload
        self.offload = policy if policy.resolved else SwaPolicy.zero()
        """Which boundaries the CPU tier keeps window checkpoints for (the model's off-GPU
        SWA policy, `swa_policy:` in its spec; a cost-based one not yet resolved keeps none)."""
        self.host: HostPool | None = (
            HostPool(host_window_blocks, block_size)
            if host_window_blocks and self.mutable
            else None
        )
        """Window blocks written to the CPU tier at the checkpoints of `offload`."""

    @property
    def kv_bytes_per_token(self) -> float:
        """Sealed bytes per token (what a block of the prefix costs to store or move)."""
        return self.block_bytes / self.block_size

    # --- the resume rule --------------------------------------------------------------------

    def window_held(self, hashes: Sequence[int], blocks: int, host: bool = False) -> bool:
        """Whether the windows (and state) at boundary `blocks` are cached (in HBM, or with
        `host` also in the CPU tier)."""
        pool = self.pool
        if pool is None or blocks <= 0:
            return True
        held = self._held(hashes, host)
        return all(held(j) for j in range(max(0, blocks - self.window_blocks), blocks))

    def _held(self, hashes: Sequence[int], host: bool) -> Callable[[int], bool]:
        pool = self.pool
        assert pool is not None
        cpu = self.host if host else None
        if cpu is None:
            return lambda j: pool.contains(hashes[j])
        return lambda j: pool.contains(hashes[j]) or cpu.contains(hashes[j])

    def host_windows(self, hashes: Sequence[int], blocks: int) -> bool:
        """Whether the windows at boundary `blocks` come from the CPU tier (not all in HBM,
        all in HBM or CPU)."""
        return not self.window_held(hashes, blocks) and self.window_held(hashes, blocks, True)

    def choose(
        self,
        hashes: Sequence[int],
        hbm_blocks: int,
        profile: TimingProfile,
        host_blocks: int = 0,
        host_load_s: float = 0.0,
    ) -> Resume:
        """Where a sequence whose sealed blocks are cached for `hbm_blocks` blocks (and in the
        CPU tier for `host_blocks` more, loading in `host_load_s`) resumes: the resume rule
        (`ownerserve.kvstate.resume`) over the deepest boundary whose windows HBM caches
        (`restorable_boundary`) and, with a CPU part, whether its end's windows are held in
        HBM or the CPU tier and the deepest boundary whose are."""
        pool = self.pool
        if pool is None or hbm_blocks + host_blocks == 0:
            host_hit = HostHit(host_blocks, host_load_s)
            return resume_point(self.rule, profile.prefill, hbm_blocks, hbm_blocks, host=host_hit)
        k = restorable_boundary(hbm_blocks, lambda j: pool.contains(hashes[j]), self.window_blocks)
        host: HostHit | None = None
        if host_blocks:
            end = hbm_blocks + host_blocks
            host = HostHit(
                host_blocks,
                host_load_s,
                self.window_held(hashes, end, host=True),
                restorable_boundary(end, self._held(hashes, True), self.window_blocks),
            )
        return resume_point(self.rule, profile.prefill, hbm_blocks, k, host=host)

    # --- a sequence's window blocks ---------------------------------------------------------

    def _retained(self, j: int, computed: int, prompt_blocks: int) -> bool:
        """Whether window block j belongs to the window of a boundary in
        (j, min(j + window, computed)] that the retention policy keeps."""
        bs = self.block_size
        last_prompt = prompt_blocks * bs
        hi = min(j + self.window_blocks, computed)
        return any(self.retention.keeps(b * bs, last_prompt) for b in range(j + 1, hi + 1))

    def take(
        self,
        refs: list[WindowRef],
        hashes: Sequence[int],
        tokens: TokenReader,
        lo: int,
        hi: int,
        prompt_blocks: int,
    ) -> None:
        """Reference the window blocks of [lo, hi) a sequence now computed (or restored)
        still needs: those in the window at `hi` and those of a boundary the policy keeps,
        the newest first. A cached one is shared; a new one takes a free slot (evicting the
        least recently freed) and is registered; with no slot left it goes uncached (the
        sequence runs on; only a later hit at its boundary is lost)."""
        pool = self.pool
        assert pool is not None
        new: list[NewBlock] = []
        bs = self.block_size
        window_from = hi - self.window_blocks
        for j in range(hi - 1, lo - 1, -1):
            if j < window_from and not self._retained(j, hi, prompt_blocks):
                continue  # left the window already and no kept boundary needs it
            h = hashes[j]
            if pool.contains(h):
                refs.append(WindowRef(j, pool.touch([h])[0], True))
                continue
            got = pool.allocate(1)
            if got is None:
                continue
            refs.append(WindowRef(j, got[0], False))
            new.append(
                NewBlock(got[0], h, hashes[j - 1] if j else None, tokens(j * bs, (j + 1) * bs))
            )
        new.reverse()  # registered in chain order: runs of consecutive blocks, one event each
        pool.register(new)

    def release(
        self, refs: list[WindowRef], keep_from: int, computed: int, prompt_blocks: int
    ) -> list[WindowRef]:
        """Let go of the window blocks before block `keep_from` (all with `keep_from` past
        the last); returns the rest. A block stays cached when it was cached before the
        sequence took it or when a boundary in (j, min(j + window, computed)] is one the
        retention policy keeps; otherwise it leaves the cache."""
        pool = self.pool
        assert pool is not None
        rest: list[WindowRef] = []
        free: list[int] = []
        drop: list[int] = []
        for ref in refs:
            if ref.index >= keep_from:
                rest.append(ref)
                continue
            keep = ref.was_cached or self._retained(ref.index, computed, prompt_blocks)
            (free if keep else drop).append(ref.block_id)
        if free:
            pool.free(free)
        if drop:
            pool.discard(drop)
        return rest

    def _checkpointed(self, j: int) -> bool:
        """Whether window block j is part of a CPU checkpoint: of the window of a boundary
        in (j, j + window] where the off-GPU policy keeps one."""
        bs = self.block_size
        policy = self.offload
        return any(policy.restorable(b * bs) for b in range(j + 1, j + self.window_blocks + 1))

    def offload_windows(self, hashes: Sequence[int], tokens: TokenReader, lo: int, hi: int) -> None:
        """Write through to the CPU tier the window blocks of [lo, hi) (prompt blocks just
        offered there) that a checkpoint of the off-GPU policy needs."""
        host = self.host
        if host is None:
            return
        bs = self.block_size
        blocks = [
            CachedBlock(hashes[j], hashes[j - 1] if j else None, tokens(j * bs, (j + 1) * bs))
            for j in range(lo, hi)
            if self._checkpointed(j)
        ]
        if blocks:
            host.store(blocks)

    def describe(self) -> dict[str, Any]:
        """The groups as `GET /kv_blocks` shows them: kind, layers, bytes per block, and for
        the window pool its blocks held and their hashes."""
        pool = self.pool
        out: dict[str, Any] = {
            "kv_spec": self.spec.name,
            "retention": self.retention.name,
            "kv_groups": [
                {
                    "group_idx": g.index,
                    "kind": g.vllm_kind,
                    "state_type": g.state_type.value,
                    "layers": g.layers,
                    "block_bytes": g.block_bytes,
                    "ratio": g.ratio,
                    "window": g.window,
                }
                for g in self.groups
            ],
        }
        out["swa_policy"] = str(self.offload)
        if pool is not None:
            out["window_capacity_blocks"] = pool.num_blocks
            out["window_blocks_held"] = pool.num_cached
            out["window_block_hashes"] = pool.cached_hashes()
        return out

    # --- events -----------------------------------------------------------------------------

    def tag_sealed(self, events: Sequence[KVEvent]) -> list[KVEvent]:
        """The sealed pool's (or CPU tier's) events, once per sealed group."""
        return _tagged(events, self.sealed)

    def drain_window_events(self) -> list[KVEvent]:
        """The window pool's events since the last drain, once per mutable group."""
        if self.pool is None:
            return []
        events = self.pool.drain_events()
        if self.host is not None:
            events.extend(self.host.drain_events())
        return _tagged(events, self.mutable)
