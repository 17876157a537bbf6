"""Attention specs and the sizes of each KV state type for a token range (HeteroCache 2.6.3).

A `KVStateSpec` lists every layer's `LayerSpec` (attention type, entry layout, compression ratio,
window, tail state) and answers, without I/O and in time independent of the context length:
how many bytes of each `StateType` a token range holds, which of it is sealed (immutable,
shareable artifacts) and which is mutable session state, and how many tokens of an incomplete
compression block must be recomputed. Specs are loaded from `configs/models/*.yaml` by
`ownerserve.kvstate.registry`.

Conventions, for a prefix of n tokens:
- a compressing layer with ratio m holds ``n // m`` compressed entries; the ``n % m`` pending
  tokens (plus the previous group when the compressor overlaps groups) are TAIL_STATE;
- a window branch holds ``min(window, n)`` uncompressed entries as WINDOW_SWA;
- sealed artifacts cover whole cache blocks of `block_tokens` original tokens (a multiple of
  lcm of every ratio m, m'), so the last ``n % block_tokens`` tokens are the incomplete block
  that a restore always recomputes;
- the spec's `swa_policy` says which boundaries keep a window checkpoint off-GPU; what a
  policy writes (`swa_write_bytes`) and what a restore at a boundary then costs
  (`swa_restore_at`) give the cost-based period p* (`cost_based_period`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from hashlib import blake2b

from ownerserve.kvstate.types import (
    DEFAULT_SWA_POLICY,
    AttentionType,
    DType,
    StateType,
    SwaCaching,
    SwaPolicy,
)

_COMPRESSING = (AttentionType.CSA, AttentionType.HCA)
_PER_TOKEN = (AttentionType.DENSE, AttentionType.MLA)


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One layer's attention and cache entry layout (HeteroCache's `LayerSpec`).

    An entry holds `kv_tensors` tensors (2: separate K and V; 1: one shared latent or KV) of
    `kv_heads` heads of `head_dim` elements each; `rope_dim` of those elements are stored in
    `rope_dtype` (decoupled RoPE keys kept in higher precision), the rest in `dtype`, plus
    `scale_bytes` of quantisation scales per entry.
    """

    kind: str
    attention: AttentionType
    kv_heads: int
    head_dim: int
    dtype: DType = DType.BF16
    kv_tensors: int = 2
    rope_dim: int = 0
    rope_dtype: DType = DType.BF16
    scale_bytes: int = 0
    compress_ratio: int = 1
    compress_overlap: bool = False
    index_head_dim: int = 0
    index_dtype: DType = DType.FP8
    index_scale_bytes: int = 0
    window: int = 0
    swa_entry_bytes: int = 0
    tail_token_bytes: int = 0
    block_alignment: int = 1

    def __post_init__(self) -> None:
        where = f"layer kind {self.kind!r}"
        if self.kv_heads <= 0 or self.head_dim <= 0:
            raise ValueError(f"{where}: kv_heads and head_dim must be positive")
        if self.kv_tensors not in (1, 2):
            raise ValueError(f"{where}: kv_tensors must be 1 (shared) or 2 (K and V)")
        if not 0 <= self.rope_dim <= self.head_dim:
            raise ValueError(f"{where}: rope_dim must be within head_dim")
        if self.compress_ratio < 1 or self.block_alignment < 1:
            raise ValueError(f"{where}: compress_ratio and block_alignment must be >= 1")
        if min(self.scale_bytes, self.index_scale_bytes, self.swa_entry_bytes) < 0:
            raise ValueError(f"{where}: byte counts must not be negative")
        if self.window < 0 or self.tail_token_bytes < 0:
            raise ValueError(f"{where}: window and tail_token_bytes must not be negative")
        if self.attention is AttentionType.SWA and self.window <= 0:
            raise ValueError(f"{where}: a sliding-window layer needs a positive window")
        if self.attention is AttentionType.HCA and self.compress_ratio <= 1:
            raise ValueError(f"{where}: HCA needs compress_ratio > 1")
        if self.attention is AttentionType.CSA and self.index_head_dim <= 0:
            raise ValueError(f"{where}: CSA needs its indexer (index_head_dim > 0)")
        if self.attention in (*_PER_TOKEN, AttentionType.SWA) and self.compress_ratio != 1:
            raise ValueError(f"{where}: only CSA and HCA layers compress (compress_ratio 1)")

    @property
    def entry_bytes(self) -> int:
        """Bytes of one cache entry (one token, or one compressed group) of this layer."""
        bits = (self.head_dim - self.rope_dim) * self.dtype.bits
        bits += self.rope_dim * self.rope_dtype.bits
        return self.kv_tensors * self.kv_heads * math.ceil(bits / 8) + self.scale_bytes

    @property
    def index_entry_bytes(self) -> int:
        """Bytes of one CSA indexer key (0 for layers without an indexer)."""
        if self.attention is not AttentionType.CSA:
            return 0
        return math.ceil(self.index_head_dim * self.index_dtype.bits / 8) + self.index_scale_bytes

    @property
    def window_entry_bytes(self) -> int:
        """Bytes of one uncompressed sliding-window entry (0 without a window)."""
        if self.window <= 0:
            return 0
        return self.swa_entry_bytes or self.entry_bytes

    @property
    def compresses(self) -> bool:
        return self.attention in _COMPRESSING

    def pending_tokens(self, n: int) -> int:
        """Tokens of a prefix of n whose state is still pending compression (TAIL_STATE)."""
        if not self.compresses or self.compress_ratio == 1:
            return 0
        m = self.compress_ratio
        return n % m + (m if self.compress_overlap and n >= m else 0)

    def max_tail_bytes(self) -> int:
        """The largest tail this layer can hold: the fixed per-request state block's tail part."""
        if not self.compresses or self.compress_ratio == 1:
            return 0
        m = self.compress_ratio
        return (m - 1 + (m if self.compress_overlap else 0)) * self.tail_token_bytes

    def state_types(self) -> tuple[StateType, ...]:
        """The state types this layer keeps."""
        out: list[StateType] = []
        if self.attention in _PER_TOKEN:
            out.append(StateType.DENSE_KV)
        elif self.attention is AttentionType.CSA:
            out += [StateType.COMPRESSED_CSA_MAIN, StateType.COMPRESSED_CSA_INDEX]
        elif self.attention is AttentionType.HCA:
            out.append(StateType.COMPRESSED_HCA)
        if self.window > 0:
            out.append(StateType.WINDOW_SWA)
        if self.compresses and self.compress_ratio > 1 and self.tail_token_bytes > 0:
            out.append(StateType.TAIL_STATE)
        return tuple(out)


@dataclass(frozen=True, slots=True)
class _Group:
    """Identical layers counted once so that sizes cost O(distinct kinds), not O(layers)."""

    layer: LayerSpec
    count: int


@dataclass(frozen=True, slots=True)
class KVStateSpec:
    """A model's attention spec: per-layer layouts, the sealed block size, derived sizes."""

    name: str
    layers: tuple[LayerSpec, ...]
    block_tokens: int
    aliases: tuple[str, ...] = ()
    revision: str = ""
    description: str = ""
    swa_policy: SwaPolicy = DEFAULT_SWA_POLICY
    """How this model's window state is kept off-GPU (`swa_policy:` in its spec file)."""
    groups: tuple[_Group, ...] = field(init=False, repr=False, compare=False)
    state_types: tuple[StateType, ...] = field(init=False, repr=False, compare=False)
    fingerprint: str = field(init=False, repr=False, compare=False)
    _dense_per_token: int = field(init=False, repr=False, compare=False)
    # per-call hot paths read these plain-int tables instead of walking LayerSpec properties
    _sealed_groups: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)
    _window_groups: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)
    _tail_groups: tuple[tuple[int, bool, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError(f"spec {self.name!r}: no layers")
        if self.block_tokens <= 0:
            raise ValueError(f"spec {self.name!r}: block_tokens must be positive")
        for layer in self.layers:
            if layer.compresses and self.block_tokens % layer.compress_ratio:
                raise ValueError(
                    f"spec {self.name!r}: block_tokens {self.block_tokens} must be a multiple "
                    f"of every compression ratio (layer kind {layer.kind!r} has "
                    f"{layer.compress_ratio}): a cache block covers lcm(m, m') tokens"
                )
        heads = {layer.kv_heads for layer in self.layers}
        if len(heads) != 1:
            raise ValueError(
                f"spec {self.name!r}: all layers must have the same kv_heads (got "
                f"{sorted(heads)}): per-head artifact keys assume one head layout"
            )
        counts: dict[LayerSpec, int] = {}
        for layer in self.layers:
            counts[layer] = counts.get(layer, 0) + 1
        groups = tuple(_Group(layer, n) for layer, n in counts.items())
        types: list[StateType] = []
        for st in StateType:
            if any(st in g.layer.state_types() for g in groups):
                types.append(st)
        dense = sum(
            g.count * g.layer.entry_bytes for g in groups if g.layer.attention in _PER_TOKEN
        )
        digest = blake2b(repr((self.block_tokens, self.layers)).encode(), digest_size=8)
        object.__setattr__(self, "groups", groups)
        object.__setattr__(self, "state_types", tuple(types))
        object.__setattr__(self, "fingerprint", digest.hexdigest())
        object.__setattr__(self, "_dense_per_token", dense)
        sealed = tuple(
            (g.layer.compress_ratio, g.count * (g.layer.entry_bytes + g.layer.index_entry_bytes))
            for g in groups
            if g.layer.compresses
        )
        windows = tuple(
            (g.layer.window, g.count * g.layer.window_entry_bytes)
            for g in groups
            if g.layer.window > 0
        )
        tails = tuple(
            (g.layer.compress_ratio, g.layer.compress_overlap, g.count * g.layer.tail_token_bytes)
            for g in groups
            if g.layer.compresses and g.layer.compress_ratio > 1 and g.layer.tail_token_bytes
        )
        object.__setattr__(self, "_sealed_groups", sealed)
        object.__setattr__(self, "_window_groups", windows)
        object.__setattr__(self, "_tail_groups", tails)

    # --- shape -------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def kv_heads(self) -> int:
        """KV heads per layer (1 for MLA and shared-KV compressed attention)."""
        return self.layers[0].kv_heads

    def count(self, attention: AttentionType) -> int:
        """How many layers use `attention`."""
        return sum(g.count for g in self.groups if g.layer.attention is attention)

    @property
    def window_layers(self) -> int:
        """Layers with a sliding window (pure SWA layers and CSA/HCA window branches)."""
        return sum(g.count for g in self.groups if g.layer.window > 0)

    # --- sealed artifacts and the incomplete block --------------------------------------------

    def sealed_tokens(self, n: int) -> int:
        """Tokens of a prefix of n covered by complete cache blocks (sealed artifacts)."""
        return n - n % self.block_tokens

    def tail_tokens(self, n: int) -> int:
        """Tokens of the incomplete block at the end of a prefix of n: always recomputed."""
        return n % self.block_tokens

    def sealed_bytes(self, start: int, end: int) -> int:
        """Bytes of every sealed state type produced by tokens [start, end)."""
        _check_range(start, end)
        total = (end - start) * self._dense_per_token
        for m, per_entry in self._sealed_groups:
            total += (end // m - start // m) * per_entry
        return total

    # --- mutable session state ----------------------------------------------------------------

    def swa_bytes(self, n: int) -> int:
        """WINDOW_SWA bytes held after n tokens (the last `window` entries of every layer)."""
        return sum(min(window, n) * per_entry for window, per_entry in self._window_groups)

    @property
    def max_window(self) -> int:
        """The widest sliding window of any layer (0 without windows)."""
        return max(g.layer.window for g in self.groups)

    @property
    def swa_bytes_per_token(self) -> int:
        """Bytes one token adds to the window state summed over all window layers."""
        return sum(g.count * g.layer.window_entry_bytes for g in self.groups)

    @property
    def swa_recompute_tokens(self) -> int:
        """Tokens to recompute to rebuild every window exactly: n_win·L for L window layers.

        Each window layer extends the receptive field backwards by its window, so the last
        n_win entries of L stacked window layers depend on the last n_win·L tokens; older
        context comes from the cached compressed (or dense) KV.
        """
        return sum(g.count * g.layer.window for g in self.groups if g.layer.window > 0)

    def swa_write_bytes(self, policy: SwaPolicy, n: int) -> int:
        """Bytes of window state `policy` writes off-GPU over a sequence of n tokens.

        Checkpoints at p, 2p, ..., ⌊n/p⌋·p each hold a layer's last w entries; their union is
        ⌊n/p⌋·min(p, w) entries (the windows overlap when p < w), so per window layer group
        ``count · entry_bytes · ⌊n/p⌋ · min(p, w)``: full (p = 1) writes every token's entries
        once, zero writes nothing."""
        p = policy.period
        if p == 0 or n <= 0:
            return 0
        k = n // p
        return sum(k * min(p, window) * per_entry for window, per_entry in self._window_groups)

    def tail_bytes(self, n: int) -> int:
        """TAIL_STATE bytes after n tokens: pending tokens of incomplete compression groups."""
        return sum(
            (n % m + (m if overlap and n >= m else 0)) * per_token
            for m, overlap, per_token in self._tail_groups
        )

    def mutable_bytes(self, n: int) -> int:
        return self.swa_bytes(n) + self.tail_bytes(n)

    @property
    def state_block_bytes(self) -> int:
        """Size of the fixed per-request state block: full windows plus the largest tails."""
        return sum(
            g.count * (g.layer.window * g.layer.window_entry_bytes + g.layer.max_tail_bytes())
            for g in self.groups
        )

    # --- per type, totals, averages -----------------------------------------------------------

    def state_bytes(self, start: int, end: int) -> dict[StateType, int]:
        """Bytes of each state type of this spec for the token range [start, end).

        Sealed types count what tokens [start, end) produce (so ranges add up); mutable types
        (WINDOW_SWA, TAIL_STATE) are the session state held after `end` tokens.
        """
        _check_range(start, end)
        out = dict.fromkeys(self.state_types, 0)
        for g in self.groups:
            layer, c = g.layer, g.count
            if layer.attention in _PER_TOKEN:
                out[StateType.DENSE_KV] += c * (end - start) * layer.entry_bytes
            elif layer.compresses:
                m = layer.compress_ratio
                entries = end // m - start // m
                if layer.attention is AttentionType.CSA:
                    out[StateType.COMPRESSED_CSA_MAIN] += c * entries * layer.entry_bytes
                    out[StateType.COMPRESSED_CSA_INDEX] += c * entries * layer.index_entry_bytes
                else:
                    out[StateType.COMPRESSED_HCA] += c * entries * layer.entry_bytes
                if StateType.TAIL_STATE in out:
                    out[StateType.TAIL_STATE] += (
                        c * layer.pending_tokens(end) * layer.tail_token_bytes
                    )
            if layer.window > 0:
                out[StateType.WINDOW_SWA] += c * min(layer.window, end) * layer.window_entry_bytes
        return out

    def total_bytes(self, n: int) -> int:
        """All KV state of a prefix of n tokens: sealed artifacts plus session state."""
        return self.sealed_bytes(0, n) + self.mutable_bytes(n)

    def bytes_per_token(self, context_tokens: int | None = None) -> float:
        """Average KV bytes per token: the long-context rate of the sealed types by default,
        or `total_bytes(context_tokens) / context_tokens` for a given context."""
        if context_tokens is not None:
            if context_tokens <= 0:
                raise ValueError("context_tokens must be positive")
            return self.total_bytes(context_tokens) / context_tokens
        rate = float(self._dense_per_token)
        for m, per_entry in self._sealed_groups:
            rate += per_entry / m
        return rate

    def allocated_bytes(self, n: int) -> int:
        """Sealed bytes a paged allocator reserves for n tokens: each layer's entries rounded up
        to its kernel `block_alignment` (in entries), plus the fixed state block."""
        total = 0
        for g in self.groups:
            layer = g.layer
            if layer.attention in _PER_TOKEN:
                entries, per = n, layer.entry_bytes
            elif layer.compresses:
                entries = n // layer.compress_ratio
                per = layer.entry_bytes + layer.index_entry_bytes
            else:
                continue
            a = layer.block_alignment
            total += g.count * (-(-entries // a) * a) * per
        return total + self.state_block_bytes


def _check_range(start: int, end: int) -> None:
    if start < 0 or end < start:
        raise ValueError(f"invalid token range [{start}, {end})")


def artifact_id(
    spec: KVStateSpec,
    prefix_hash: int,
    start: int,
    end: int,
    *,
    tokenizer: str = "",
    state: StateType | None = None,
) -> str:
    """An artifact's identity: H(model, revision, tokenizer, attention spec
    and precision, prefix hash, block range[, state type]). It names no TP size or rank, so
    any consumer finds it; a different layout or precision never matches."""
    _check_range(start, end)
    key = (
        spec.name,
        spec.revision,
        tokenizer,
        spec.fingerprint,
        prefix_hash,
        start,
        end,
        state.value if state is not None else "",
    )
    return blake2b(repr(key).encode(), digest_size=16).hexdigest()


# --- the cost-based SWA checkpoint period --------------------------------------------------


@dataclass(frozen=True, slots=True)
class SwaCostInputs:
    """What the cost-based SWA period weighs, every input explicit (seconds, bytes, tokens).

    Restores happen at sealed block boundaries S = B, 2B, ..., ⌊n/B⌋·B, each as likely."""

    session_tokens: int
    """n: the tokens whose window state a session writes (its final context)."""
    restores: float
    """R: restores per session (each at one boundary)."""
    load_bps: float
    """Bandwidth of a checkpoint load from the tier it is kept in into HBM."""
    load_latency_s: float
    """Latency of that load."""
    recompute_s_per_token: float
    """ρ: seconds of prefill per recomputed token (at the context a restore sees)."""
    alpha: float
    """α: seconds charged per byte of window state written off-GPU."""
    beta: float = 1.0
    """β: weight of a restore's latency (seconds on the request's critical path)."""
    gamma: float = 0.0
    """γ: weight of a restore's recompute (GPU seconds taken from other requests)."""

    def __post_init__(self) -> None:
        if self.session_tokens < 0 or self.restores < 0:
            raise ValueError("session_tokens and restores must not be negative")
        if self.load_bps <= 0:
            raise ValueError("load_bps must be positive")
        if min(self.load_latency_s, self.recompute_s_per_token, self.alpha) < 0:
            raise ValueError("latency, recompute seconds and alpha must not be negative")
        if self.beta < 0 or self.gamma < 0:
            raise ValueError("beta and gamma must not be negative")


@dataclass(frozen=True, slots=True)
class SwaRestore:
    """How the windows at one sealed boundary come back, and what that costs."""

    latency_s: float
    recompute_tokens: int
    load_bytes: int


def swa_restore_at(
    spec: KVStateSpec, policy: SwaPolicy, boundary: int, inputs: SwaCostInputs
) -> SwaRestore:
    """The windows at sealed `boundary` S under `policy`, the cheaper of:

        checkpoint  q = checkpoint_at(S) > 0:  load_latency_s + swa_bytes(q) / load_bps
                                               + (S − q)·ρ          (recompute [q, S))
        recompute   min(S, n_win·L)·ρ                                (RECOMPUTE_SWA)

    (the restore planner's two ways, `planner.restore`, with the sealed KV already in HBM)."""
    w = spec.swa_recompute_tokens
    if w == 0 or boundary <= 0:
        return SwaRestore(0.0, 0, 0)
    rho = inputs.recompute_s_per_token
    tokens = min(boundary, w)
    best = SwaRestore(tokens * rho, tokens, 0)
    q = policy.checkpoint_at(boundary)
    if q > 0:
        nbytes = spec.swa_bytes(q)
        t = inputs.load_latency_s + nbytes / inputs.load_bps + (boundary - q) * rho
        if t < best.latency_s:
            best = SwaRestore(t, boundary - q, nbytes)
    return best


def expected_swa_restore(
    spec: KVStateSpec, policy: SwaPolicy, inputs: SwaCostInputs
) -> tuple[float, float]:
    """(mean latency_s, mean recompute tokens) of `swa_restore_at` over the boundaries
    S = B, 2B, ..., ⌊n/B⌋·B of a session of n = `session_tokens` (0, 0 when it has none)."""
    b = spec.block_tokens
    k = inputs.session_tokens // b
    if k == 0 or spec.swa_recompute_tokens == 0:
        return 0.0, 0.0
    lat = rec = 0.0
    for i in range(1, k + 1):
        r = swa_restore_at(spec, policy, i * b, inputs)
        lat += r.latency_s
        rec += r.recompute_tokens
    return lat / k, rec / k


def swa_policy_cost(spec: KVStateSpec, policy: SwaPolicy, inputs: SwaCostInputs) -> float:
    """J(policy) = α·swa_write_bytes(policy, n) + R·(β·E[latency] + γ·ρ·E[recompute tokens])."""
    lat, rec = expected_swa_restore(spec, policy, inputs)
    writes = spec.swa_write_bytes(policy, inputs.session_tokens)
    per_restore = inputs.beta * lat + inputs.gamma * inputs.recompute_s_per_token * rec
    return inputs.alpha * writes + inputs.restores * per_restore


def swa_period_candidates(spec: KVStateSpec, session_tokens: int) -> tuple[int, ...]:
    """The periods the cost-based policy weighs: 0 (zero caching), 1 (full), and B·2^k up to
    the session's length (B = block_tokens)."""
    out = [0, 1]
    p = spec.block_tokens
    while p <= max(session_tokens, spec.block_tokens):
        out.append(p)
        p *= 2
    return tuple(out)


def cost_based_period(
    spec: KVStateSpec, inputs: SwaCostInputs, candidates: tuple[int, ...] | None = None
) -> int:
    """p* = argmin over p of `swa_policy_cost` (0: zero caching, 1: every token); ties go to
    the period that writes less. Pure: a function of the spec's sizes and `inputs` only."""
    if spec.swa_recompute_tokens == 0:
        return 0
    cands = (
        candidates if candidates is not None else swa_period_candidates(spec, inputs.session_tokens)
    )
    n = inputs.session_tokens
    best_p, best_key = 0, (float("inf"), 0)
    for p in cands:
        if p < 0:
            raise ValueError("a checkpoint period must not be negative")
        pol = SwaPolicy.cost_based(p)
        key = (swa_policy_cost(spec, pol, inputs), spec.swa_write_bytes(pol, n))
        if key < best_key:
            best_p, best_key = p, key
    return best_p


def resolve_swa_policy(spec: KVStateSpec, policy: SwaPolicy, inputs: SwaCostInputs) -> SwaPolicy:
    """`policy` as a restore can use it: an unresolved cost-based policy gets its p*."""
    if policy.caching is SwaCaching.COST and not policy.resolved:
        return SwaPolicy.cost_based(cost_based_period(spec, inputs))
    return policy
