"""Position-independent chunk reuse (as in EPIC, Block-Attention): a chunked prompt parsed
into its system, chunk and question token spans, each chunk named by a hash of its content that
does not depend on where in a prompt it sits.

Two ways to mark chunks, both off unless the model's `chunks:` settings enable them
(`ownerserve.config.ChunkSettings`):

- the plain-text format, `system SEP chunk1 SEP chunk2 SEP question` (SEP: the configured
  separator, `##` by default), matched on token ids: k + 1 separators make k chunks, the
  separators themselves are computed like the question;
- for chat requests, text content parts `{"type": "text", "text": ..., "ownerserve_chunk":
  true}` or whole messages `{"role": ..., "content": ..., "ownerserve_chunk": true}`: each
  marked text is a chunk, found in the rendered prompt by its own token ids.

A chunk's hash is `hash_block(system_hash, chunk tokens)`, `system_hash = hash_block(
chunk_namespace(root), system tokens)`: the model and tokenizer (`root`, the prefix chain's
root) and the system segment the chunk's KV is computed under (it attends to the system
prompt and itself only), never its position. The system segment always starts the prompt, so
prefix caching covers it; it is not a chunk.

The worker learns the layout from `kv_transfer_params: {"ownerserve": {"chunks": [{"hash",
"start", "end"}, ...], "system_end"}}` (`layout_params`, `parse_layout`, `parse_system_end`):
hashes as 16 hex digits, spans in the prompt's token ids.

For vLLM workers a chunk is loaded with the tokens leading into it
(`load_spans`: a worker loads one contiguous run) and computed beforehand by a chunk prefill
(`chunk_prefills`), its KV kept under `chunk_artifact_key`.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from ownerserve.errors import InvalidRequestError
from ownerserve.hashing import hash_block

CHUNK_MARK = "ownerserve_chunk"
"""The key that marks a chat content part or message as a retrievable chunk."""
PARAMS_KEY = "ownerserve"
"""The `kv_transfer_params` key carrying OwnerServe's chunk layout to the worker."""


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk of a prompt: token ids [start, end) and their content hash."""

    start: int
    end: int
    hash: int

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class ChunkedPrompt:
    """A prompt's system segment [0, system_end), its chunks in prompt order, and where the
    question starts (the question runs to the prompt's end; separators and any text between
    chunks are computed like it)."""

    system_end: int
    chunks: tuple[Chunk, ...]
    question_start: int
    system_hash: int

    @property
    def chunk_tokens(self) -> int:
        return sum(c.end - c.start for c in self.chunks)

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        return tuple((c.start, c.end) for c in self.chunks)


def chunk_namespace(root: int) -> int:
    """The parent of every system hash under a chain root: keeps chunk hashes apart from the
    prefix chain's block hashes of the same root."""
    return xxhash.xxh3_64_intdigest(b"ownerserve:chunk", root)


def system_hash(root: int, tokens: Sequence[int]) -> int:
    """The hash of a system segment under `root` (the model's chain root)."""
    return hash_block(chunk_namespace(root), tokens)


def chunk_hash(system: int, tokens: Sequence[int]) -> int:
    """A chunk's content hash under its system segment's hash `system`: no position in it."""
    return hash_block(system, tokens)


def _packed(ids: Sequence[int]) -> bytes:
    a = ids if isinstance(ids, array) and ids.typecode == "I" else array("I", ids)
    if sys.byteorder != "little":
        a = array("I", a)
        a.byteswap()
    return a.tobytes()


def _find(haystack: bytes, needle: bytes, start_token: int) -> int:
    """Token offset of the first occurrence of `needle` (packed ids) at or after
    `start_token`, on a token boundary; -1 if none."""
    pos = 4 * start_token
    while True:
        pos = haystack.find(needle, pos)
        if pos < 0:
            return -1
        if pos % 4 == 0:
            return pos // 4
        pos += 1


def _check(
    ids: Sequence[int], chunks: list[tuple[int, int]], max_model_len: int, max_chunks: int,
    blank: Collection[int], param: str,
) -> None:  # fmt: skip
    if len(chunks) > max_chunks:
        raise InvalidRequestError(
            f"a chunked prompt has at most {max_chunks} chunks, got {len(chunks)}", param=param
        )
    for i, (lo, hi) in enumerate(chunks):
        if hi <= lo or all(t in blank for t in ids[lo:hi]):
            raise InvalidRequestError(f"chunk {i + 1} of the prompt is empty", param=param)
        if hi - lo > max_model_len:
            raise InvalidRequestError(
                f"chunk {i + 1} has {hi - lo} tokens, more than the model's length "
                f"({max_model_len})",
                param=param,
            )


def _build(
    ids: Sequence[int], root: int, system_end: int, spans: list[tuple[int, int]], question: int
) -> ChunkedPrompt:
    sh = system_hash(root, ids[:system_end])
    chunks = tuple(Chunk(lo, hi, chunk_hash(sh, ids[lo:hi])) for lo, hi in spans)
    return ChunkedPrompt(system_end, chunks, question, sh)


def split_on_separator(
    ids: Sequence[int],
    separator: Sequence[int],
    root: int,
    *,
    max_model_len: int,
    max_chunks: int = 64,
    blank: Collection[int] = (),
    param: str = "messages",
) -> ChunkedPrompt | None:
    """The plain-text format: `system SEP chunk1 SEP ... SEP chunkK SEP question` in token ids.
    None when the separator does not occur (not a chunked prompt); a 400
    (`InvalidRequestError`) when it occurs once (unbalanced: no chunk is closed), when a
    chunk is empty (no tokens, or only `blank` ones), longer than `max_model_len`, or when
    there are more than `max_chunks`."""
    if not separator:
        return None
    hay = _packed(ids)
    needle = _packed(separator)
    width = len(separator)
    at = _find(hay, needle, 0)
    if at < 0:
        return None
    seps = [at]
    while True:
        at = _find(hay, needle, at + width)
        if at < 0:
            break
        seps.append(at)
        if len(seps) > max_chunks + 1:
            break
    if len(seps) < 2:
        raise InvalidRequestError(
            "unbalanced chunk separators: a chunked prompt is `system SEP chunk SEP ... SEP "
            "question` (a separator after the system prompt and after every chunk); found one",
            param=param,
        )
    spans = [(seps[i] + width, seps[i + 1]) for i in range(len(seps) - 1)]
    _check(ids, spans, max_model_len, max_chunks, blank, param)
    return _build(ids, root, seps[0], spans, seps[-1])


def locate_chunks(
    ids: Sequence[int],
    chunk_ids: Sequence[Sequence[int]],
    root: int,
    *,
    max_model_len: int,
    max_chunks: int = 64,
    blank: Collection[int] = (),
    param: str = "messages",
) -> ChunkedPrompt:
    """Marked chunks (their token ids, in prompt order) found in the prompt `ids`, each after
    the previous one; the system segment is what precedes the first. A 400 when one is empty,
    too long, not found as tokenized alone (a tokenizer that merges it with its neighbours:
    give it its own content part or message), or when there are more than `max_chunks`."""
    if len(chunk_ids) > max_chunks:
        _check(ids, [(0, 1)] * len(chunk_ids), max_model_len, max_chunks, blank, param)
    hay = _packed(ids)
    spans: list[tuple[int, int]] = []
    pos = 0
    for i, cids in enumerate(chunk_ids):
        if not cids or all(t in blank for t in cids):
            raise InvalidRequestError(f"chunk {i + 1} of the prompt is empty", param=param)
        at = _find(hay, _packed(cids), pos)
        if at < 0:
            raise InvalidRequestError(
                f"chunk {i + 1} (marked {CHUNK_MARK}) does not appear in the prompt as it "
                "tokenizes alone; give it its own content part or message",
                param=param,
            )
        spans.append((at, at + len(cids)))
        pos = at + len(cids)
    _check(ids, spans, max_model_len, max_chunks, blank, param)
    return _build(ids, root, spans[0][0], spans, spans[-1][1])


def marked_texts(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The texts of a chat's marked chunks, in prompt order: every text part of a message
    marked `"ownerserve_chunk": true` (its content when a string), and every text part marked
    so. A marker that is not a boolean is a 400."""
    out: list[str] = []
    for i, m in enumerate(messages):
        whole = m.get(CHUNK_MARK)
        if whole is not None and not isinstance(whole, bool):
            raise InvalidRequestError(
                f"messages[{i}].{CHUNK_MARK} must be a boolean", param="messages"
            )
        content = m.get("content")
        if isinstance(content, str):
            if whole:
                out.append(content)
            continue
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                continue
            mark = part.get(CHUNK_MARK)
            if mark is not None and not isinstance(mark, bool):
                raise InvalidRequestError(
                    f"messages[{i}].content[{j}].{CHUNK_MARK} must be a boolean",
                    param="messages",
                )
            if whole or mark:
                out.append(str(part.get("text", "")))
    return out


def layout_params(prompt: ChunkedPrompt) -> dict[str, Any]:
    """The value of `kv_transfer_params["ownerserve"]` telling a worker the chunk layout."""
    return {
        "chunks": [
            {"hash": f"{c.hash:016x}", "start": c.start, "end": c.end} for c in prompt.chunks
        ],
        "system_end": prompt.system_end,
    }


@dataclass(frozen=True, slots=True)
class LoadSpan:
    """What a worker loads for one chunk: tokens [start, end) of the prompt, the chunk plus the
    tokens that lead into it since the previous chunk (or the system segment) ended, e.g. the
    separator. A worker can only load one contiguous run after its prefix hit, so the lead-in
    is computed in isolation with its chunk; `key` names that KV: the chunk's hash joined with
    the lead-in tokens (position-free, like the chunk's)."""

    start: int
    end: int
    key: int


def load_spans(
    ids: Sequence[int], system_end: int, chunks: Sequence[Chunk]
) -> tuple[LoadSpan, ...]:
    """Each chunk's load span (`LoadSpan`), in prompt order."""
    out: list[LoadSpan] = []
    last = system_end
    for c in chunks:
        lead = ids[last : c.start]
        out.append(LoadSpan(last, c.end, hash_block(c.hash, lead) if lead else c.hash))
        last = c.end
    return tuple(out)


def parse_system_end(value: Any, chunks: Sequence[Chunk]) -> int | None:
    """`kv_transfer_params["ownerserve"]["system_end"]`: where the system segment ends (at or
    before the first chunk); None when absent or out of place."""
    end = value.get("system_end") if isinstance(value, Mapping) else None
    if not isinstance(end, int) or isinstance(end, bool) or end < 0:
        return None
    if chunks and end > chunks[0].start:
        return None
    return end


def parse_layout(value: Any, prompt_tokens: int) -> tuple[Chunk, ...]:
    """A worker's reading of `kv_transfer_params["ownerserve"]`: the chunks, in order, not
    overlapping and inside the prompt; a malformed layout is a 400."""
    if value is None:
        return ()
    chunks = value.get("chunks") if isinstance(value, Mapping) else None
    if not isinstance(chunks, list):
        raise InvalidRequestError(
            f"kv_transfer_params.{PARAMS_KEY}.chunks must be an array", param="kv_transfer_params"
        )
    out: list[Chunk] = []
    last = 0
    for i, c in enumerate(chunks):
        try:
            h = int(c["hash"], 16)
            lo, hi = c["start"], c["end"]
            ok = isinstance(lo, int) and isinstance(hi, int) and last <= lo < hi <= prompt_tokens
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok or not 0 <= h < 1 << 64:
            raise InvalidRequestError(
                f"kv_transfer_params.{PARAMS_KEY}.chunks[{i}] must be {{hash: 16 hex digits, "
                f"start, end}} with spans in order inside the {prompt_tokens}-token prompt",
                param="kv_transfer_params",
            )
        out.append(Chunk(lo, hi, h))
        last = hi
    return tuple(out)


def chunk_artifact_key(model: str, key: int) -> str:
    """The sidecar key of a load span's KV (`LoadSpan.key`; the connector's chunk store)."""
    return f"chunk@{model}@{key:016x}"


CHUNK_CACHE_SALT = "ownerserve-chunks"
"""The `cache_salt` of a worker-computed chunked request and of its chunk prefills: their
blocks hold chunk-isolated KV, which must never answer a plain prompt from a prefix cache."""


@dataclass(frozen=True, slots=True)
class ChunkPrefill:
    """A chunk's KV computed in isolation: `prompt` (the system segment, then the chunk's load
    span) run with `max_tokens` 1; `params` (`kv_transfer_params["ownerserve"]`) tell the
    worker's connector to save tokens [start, end) — the system segment's partial last block
    and the span — under `key`, the span computed at position `system_end`."""

    span: LoadSpan
    prompt: tuple[int, ...]
    params: dict[str, Any]


def chunk_prefills(
    ids: Sequence[int], prompt: ChunkedPrompt, block_size: int
) -> tuple[ChunkPrefill, ...]:
    """One `ChunkPrefill` per load span of `prompt` (`load_spans`), in prompt order."""
    system = tuple(ids[: prompt.system_end])
    base = prompt.system_end // block_size * block_size
    out = []
    for span in load_spans(ids, prompt.system_end, prompt.chunks):
        tokens = system + tuple(ids[span.start : span.end])
        save = {
            "key": f"{span.key:016x}",
            "start": base,
            "end": len(tokens),
            "position": prompt.system_end,
        }
        out.append(ChunkPrefill(span, tokens, {"chunk_save": save, "load": False}))
    return tuple(out)
