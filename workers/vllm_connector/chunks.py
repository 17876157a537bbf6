"""Position-independent chunk reuse on the connector: a chunk's KV, computed in isolation (the
system segment and the chunk, nothing else), saved to the sidecar under its content key, and
loaded into any prompt that holds the chunk with K re-rotated from the position it was computed
at to the one it sits at.

Two requests drive it, both marked in `kv_transfer_params.ownerserve`:

- a **chunk prefill** (`"chunk_save": {"key", "start", "end", "position"}`), the router's
  `system + lead-in + chunk` prompt with `max_tokens` 1: once its prompt is computed, tokens
  [start, end) (the system segment's partial last block, then the load span) are copied out of
  the cache and PUT as one artifact (`chunk_artifact_key`), with the position the load span
  was computed at;
- a **chunked request** (`"chunks": [...], "system_end"`, `ownerserve.chunks.layout_params`):
  the scheduler side reports the run [local prefix hit, end of the last stored chunk) as
  externally matched, and the worker side loads it synchronously in `start_load_kv`: the
  system tail from the first chunk's artifact, each load span from its own, K re-rotated by
  `actual - computed` positions (`kernels.rope.rotate`, the reference path). The tokens after
  the last chunk (separator, question) are computed by vLLM and see everything.

Chunked requests should carry a `cache_salt` of their own (the router's `CHUNK_CACHE_SALT`):
their blocks hold isolated KV and must never serve a plain prompt from vLLM's prefix cache.

Artifact: a 32-byte header (`_HEADER`: magic, version, first token index, tokens, the
position the load span was computed at, the system tail's length) then `[kv_heads, layers, 2
(K, V), tokens, head_size]` of the cache dtype, token-major. TP = 1 only (all heads on this
rank); anything else is refused at start of use and the request computes normally.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kernels import LayoutError
from kernels.rope import RopeSpec, rotate
from ownerserve.chunks import (
    LoadSpan,
    chunk_artifact_key,
    load_spans,
    parse_layout,
    parse_system_end,
)

_HEADER = struct.Struct("<4sIIIII8x")
_MAGIC = b"OSCK"
_VERSION = 1
PARAMS_KEY = "ownerserve"


@dataclass(frozen=True, slots=True)
class ChunkSaveSpec:
    """A chunk prefill's order: save prompt tokens [start, end) under `key`; the load span
    starts at `position` (tokens before it are the system segment's tail)."""

    key: int
    start: int
    end: int
    position: int


@dataclass(frozen=True, slots=True)
class ChunkPiece:
    """Copy `tokens` tokens from artifact `key` (from its token `src`) to prompt token `dst`,
    K rotated by `delta` positions."""

    key: str
    src: int
    dst: int
    tokens: int
    delta: int


@dataclass(slots=True)
class ChunkTransfer:
    """Scheduler -> worker: one request's chunk load or save on these engine blocks."""

    req_id: str
    block_ids: list[int]
    first_token: int  # prompt index of block_ids[0]'s first token
    pieces: list[ChunkPiece] = field(default_factory=list)
    save: ChunkSaveSpec | None = None
    save_key: str = ""


@dataclass(frozen=True, slots=True)
class ChunkArtifact:
    """A parsed chunk artifact."""

    start: int
    position: int
    system_tail: int
    kv: torch.Tensor  # [heads, layers, 2, tokens, head_size]


def _ours(params: Any) -> Mapping[str, Any] | None:
    ours = params.get(PARAMS_KEY) if isinstance(params, Mapping) else None
    return ours if isinstance(ours, Mapping) else None


def save_spec_of(params: Any) -> ChunkSaveSpec | None:
    """The chunk prefill order in a request's `kv_transfer_params`, if well formed."""
    ours = _ours(params)
    spec = ours.get("chunk_save") if ours is not None else None
    if not isinstance(spec, Mapping):
        return None
    try:
        out = ChunkSaveSpec(
            int(spec["key"], 16), int(spec["start"]), int(spec["end"]), int(spec["position"])
        )
    except (KeyError, TypeError, ValueError):
        return None
    ok = 0 <= out.start <= out.position < out.end and 0 <= out.key < 1 << 64
    return out if ok else None


def layout_of(params: Any, prompt: Sequence[int]) -> tuple[int, tuple[LoadSpan, ...]] | None:
    """(system_end, load spans) of a chunked request's `kv_transfer_params`; None when it has
    no (well-formed) layout."""
    ours = _ours(params)
    if ours is None or "chunks" not in ours:
        return None
    try:
        chunks = parse_layout(ours, len(prompt))
    except Exception:  # the router checked it; a hand-made bad layout just computes normally
        return None
    system_end = parse_system_end(ours, chunks)
    if not chunks or system_end is None:
        return None
    return system_end, load_spans(prompt, system_end, chunks)


def plan_pieces(
    model: str,
    system_end: int,
    spans: Sequence[LoadSpan],
    present: Sequence[bool],
    local_tokens: int,
    prompt_tokens: int,
    block_size: int,
) -> tuple[int, list[ChunkPiece]]:
    """The external run for a chunked request whose first `local_tokens` are cached locally:
    (its end, the pieces that fill [local_tokens, end)). Loads the leading stored spans only
    (a gap would have to be computed with the later chunks in view), never the prompt's last
    token; (local_tokens, []) when nothing can be loaded. Every artifact holds the system
    segment's partial last block first, so the first span's also fills the system tail."""
    base = system_end // block_size * block_size
    if local_tokens < base or not spans:
        return local_tokens, []
    end = local_tokens
    pieces: list[ChunkPiece] = []
    tail = system_end - base
    for i, (span, ok) in enumerate(zip(spans, present, strict=True)):
        if not ok or span.end > prompt_tokens - 1:
            break
        key = chunk_artifact_key(model, span.key)
        if i == 0 and local_tokens < system_end:
            tail_tokens = system_end - local_tokens
            pieces.append(ChunkPiece(key, local_tokens - base, local_tokens, tail_tokens, 0))
        lo = max(span.start, local_tokens)
        if lo < span.end:
            # the span was computed right after the system segment: position system_end
            delta = span.start - system_end
            pieces.append(ChunkPiece(key, tail + lo - span.start, lo, span.end - lo, delta))
        end = span.end
    if end <= local_tokens:
        return local_tokens, []
    return end, pieces


def encode_artifact(kv: torch.Tensor, start: int, position: int) -> bytes:
    """Header + `kv[heads, layers, 2, tokens, head_size]` (contiguous, cache dtype)."""
    tokens = kv.shape[3]
    head = _HEADER.pack(_MAGIC, _VERSION, start, tokens, position, position - start)
    return head + kv.contiguous().view(torch.uint8).numpy().tobytes()


def decode_artifact(
    data: bytes, heads: int, layers: int, head_size: int, dtype: torch.dtype
) -> ChunkArtifact:
    """Parse `encode_artifact`'s bytes; `LayoutError` when they do not fit the geometry."""
    if len(data) < _HEADER.size:
        raise LayoutError("chunk artifact shorter than its header")
    magic, version, start, tokens, position, tail = _HEADER.unpack_from(data)
    if magic != _MAGIC or version != _VERSION:
        raise LayoutError("not a chunk artifact")
    itemsize = torch.empty((), dtype=dtype).element_size()
    body = len(data) - _HEADER.size
    if body != heads * layers * 2 * tokens * head_size * itemsize:
        raise LayoutError(f"chunk artifact of {body} bytes does not fit {tokens} tokens")
    raw = torch.frombuffer(bytearray(data[_HEADER.size :]), dtype=dtype)
    return ChunkArtifact(start, position, tail, raw.view(heads, layers, 2, tokens, head_size))


def tokens_of(blocks: torch.Tensor, first: int, lo: int, hi: int) -> torch.Tensor:
    """Tokens [lo, hi) of gathered blocks `[heads, n, layers, 2, block_size, head_size]` whose
    first token is prompt token `first`, as `[heads, layers, 2, hi - lo, head_size]`."""
    h, n, layers, two, bs, d = blocks.shape
    flat = blocks.permute(0, 2, 3, 1, 4, 5).reshape(h, layers, two, n * bs, d)
    return flat[:, :, :, lo - first : hi - first]


def place(
    blocks: torch.Tensor,
    first: int,
    piece: ChunkPiece,
    art: ChunkArtifact,
    rope: RopeSpec,
) -> None:
    """Write `piece` from `art` into gathered blocks (as `tokens_of` reads them), K rotated by
    the piece's delta."""
    bs = blocks.shape[4]
    kv = art.kv[:, :, :, piece.src : piece.src + piece.tokens]
    if kv.shape[3] != piece.tokens:
        raise LayoutError("chunk artifact holds fewer tokens than the piece")
    k, v = kv[:, :, 0], kv[:, :, 1]  # [heads, layers, T, D]
    if piece.delta:
        # rotate wants [..., T, H, D]: per layer, tokens then heads
        kt = k.permute(1, 2, 0, 3)
        k = rotate(kt, torch.full((piece.tokens,), float(piece.delta)), rope).permute(2, 0, 1, 3)
    flat = blocks.permute(0, 2, 3, 1, 4, 5)  # view [h, layers, 2, n, bs, d]
    idx = torch.arange(piece.dst - first, piece.dst - first + piece.tokens)
    b, o = idx // bs, idx % bs
    flat[:, :, 0, b, o] = k.to(blocks.dtype)  # writes through the view, [h, layers, T, d]
    flat[:, :, 1, b, o] = v.to(blocks.dtype)


def blocks_for(
    block_ids: Sequence[int], lo: int, hi: int, block_size: int
) -> tuple[int, list[int]]:
    """(first token, engine block ids) of the blocks that hold prompt tokens [lo, hi)."""
    a, b = lo // block_size, (hi + block_size - 1) // block_size
    return a * block_size, list(block_ids[a:b])


def rope_of(hf_config: Any, head_size: int) -> RopeSpec | None:
    """The model's RoPE when the re-rotation here is exact for it (plain RoPE, NeoX pairs as
    vLLM's Llama uses); None otherwise (chunk loads then stay off)."""
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling and str(scaling.get("rope_type", scaling.get("type", "default"))) != "default":
        return None
    theta = getattr(hf_config, "rope_theta", None)
    if theta is None:
        params = getattr(hf_config, "rope_parameters", None) or {}
        theta = params.get("rope_theta", 10000.0)
    partial = float(getattr(hf_config, "partial_rotary_factor", 1.0) or 1.0)
    rot = int(head_size * partial)
    return RopeSpec(head_size, neox=True, base=float(theta), rotary_dim=rot)
