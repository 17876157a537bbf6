"""Tokenization for routing: the model's chat template and tokenizer give token ids, the
`ownerserve.hashing` chain gives the block hashes the directory is keyed by.

Token ids are kept in `array("I")` buffers, not lists: caches of millions of ids must not
become work for Python's cyclic garbage collector, and hashing reads the buffer in place.

Cached so a turn of a long session only tokenizes and hashes what is new:
- rendered messages by content (per model, shared by sessions that repeat a system prompt, a
  tool schema or a tool output);
- per session, the previous prompt's message keys, token ids and block hashes: a new turn
  keeps every block that lies inside its unchanged leading messages and hashes only the rest
  (no token comparison needed). Templates that render the whole prompt at once fall back to
  comparing text prefixes.

Both caches are least recently used first out, bounded by entries (sessions:
`server.tokenizer_cache_sessions` a model, 8,192 by default) and by bytes (what the entries
hold as `_SessionState.nbytes` and the messages' sizes count it; `server.tokenizer_cache_mib`,
256 MiB by default, for every model together: a session's 6K-token prompt holds ~60-130 KiB,
so a bound by count alone let 8,192 of them take ~1 GB).
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from xxhash import xxh3_64_intdigest, xxh3_128_intdigest

from ownerserve.chunks import ChunkedPrompt, locate_chunks, marked_texts, split_on_separator
from ownerserve.config import ModelSettings
from ownerserve.hashing import chain_root
from ownerserve.records import fast_init
from ownerserve.tokenizer import (
    ByteTokenizer,
    ChatTemplate,
    Tokenizer,
    load_chat_template,
    load_tokenizer,
)


def array_encoder(tokenizer: Tokenizer) -> Callable[[str], array[int]]:
    """`tokenizer.encode` returning an `array("I")`. For the byte tokenizer the ids are the
    UTF-8 bytes widened to 32 bits by a strided copy (no per-token Python objects)."""
    if isinstance(tokenizer, ByteTokenizer) and sys.byteorder == "little":

        def encode_bytes(text: str) -> array[int]:
            data = text.encode("utf-8")
            wide = bytearray(4 * len(data))
            wide[0::4] = data
            out = array("I")
            out.frombytes(wide)
            return out

        return encode_bytes

    def encode(text: str) -> array[int]:
        return array("I", tokenizer.encode(text))

    return encode


def token_array(ids: Sequence[int]) -> array[int]:
    return ids if isinstance(ids, array) and ids.typecode == "I" else array("I", ids)


def hash_blocks(tokens: Sequence[int], block_size: int, parent: int, start: int = 0) -> list[int]:
    """`ownerserve.hashing.block_hash_chain(tokens[start:], block_size, ..., start_parent=parent)`
    computed in place over the packed `array("I")` buffer (same hashes, no conversions)."""
    n_blocks = (len(tokens) - start) // block_size
    if n_blocks <= 0:
        return []
    packed = token_array(tokens)
    if sys.byteorder != "little":
        packed = array("I", packed)
        packed.byteswap()
    step = 4 * block_size
    raw = memoryview(packed)[start : start + n_blocks * block_size].cast("B")
    out: list[int] = []
    append = out.append
    h = xxh3_64_intdigest
    # hash_block(parent, block) = XXH3-64(block as uint32 LE, seed=parent)
    for i in range(0, n_blocks * step, step):
        parent = h(raw[i : i + step], parent)
        append(parent)
    return out


@fast_init
@dataclass(frozen=True, slots=True)
class Tokenized:
    """A prompt as routing sees it."""

    token_ids: Sequence[int]
    chain: tuple[int, ...]
    previous_chain_len: int
    """Blocks of the session's previous prompt (0 for a new session)."""
    common_blocks: int
    """Leading blocks shared with the session's previous prompt."""

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def extends_previous(self) -> bool:
        """True if this prompt continues the session's previous one (not a fork of it)."""
        return self.common_blocks >= self.previous_chain_len


_ENTRY_BYTES = 120
"""What one cached entry costs besides its contents: its dict slot and ordering link, a
key tuple or bytes object, the array's header (measured with tracemalloc on CPython 3.11)."""
_INT_BYTES = 40
"""One int held in a list or tuple: its pointer (8) and the int object (32: hashes are
64-bit)."""


def _key_bytes(key: Any) -> int:
    """Bytes of a cache key's contents: a message's (role, content), its digest, the tools'
    JSON."""
    if isinstance(key, tuple):
        return sum(len(k) for k in key if isinstance(k, str | bytes))
    return len(key) if isinstance(key, str | bytes) else _INT_BYTES


class _LRU(OrderedDict[Any, Any]):
    """Least recently used first out, bounded by entries and by bytes: each entry is put
    with its size in bytes (`put`, `resize` when it grows in place), and the oldest go while
    either bound is passed (the newest stays, whatever its size)."""

    def __init__(self, capacity: int, max_bytes: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.bytes = 0
        """What the entries held add up to (their `put`/`resize` sizes)."""
        self.evicted = 0
        self._sizes: dict[Any, int] = {}

    def get_or_none(self, key: Any) -> Any:
        value = self.get(key)
        if value is not None:
            self.move_to_end(key)
        return value

    def put(self, key: Any, value: Any, size: int) -> None:
        self[key] = value
        self.move_to_end(key)
        self.resize(key, size)

    def resize(self, key: Any, size: int) -> None:
        """`key`'s entry now holds `size` bytes (it is still the newest)."""
        if key not in self:
            return
        self.bytes += size - self._sizes.get(key, 0)
        self._sizes[key] = size
        while len(self) > 1 and (len(self) > self.capacity or self.bytes > self.max_bytes):
            self.drop(next(iter(self)))
            self.evicted += 1

    def drop(self, key: Any) -> None:
        if key in self:
            del self[key]
            self.bytes -= self._sizes.pop(key, 0)


@dataclass(slots=True)
class _SessionState:
    """The session's previous prompt."""

    keys: list[Any] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    """Token offset where each message's rendering ends."""
    ids: array[int] = field(default_factory=lambda: array("I"))
    chain: tuple[int, ...] = ()
    """A tuple (ints only, so the cyclic collector untracks it): each turn's chain reuses the
    previous one's int objects, and an unchanged prompt reuses the tuple itself."""
    text: str = ""
    session_id: str | None = None
    """Its key in the session cache (None: a request without a session, not cached)."""

    def nbytes(self) -> int:
        """What it holds, in bytes: token ids, hashes, message keys and offsets, text."""
        return (
            _ENTRY_BYTES
            + 4 * len(self.ids)
            + _INT_BYTES * (len(self.chain) + len(self.ends))
            + sum(_key_bytes(k) + 16 for k in self.keys)
            + len(self.text)
        )


def _message_key(message: Mapping[str, Any]) -> Any:
    """A hashable identity of a message: (role, content) for plain text messages, else the
    XXH3-128 digest of the message's JSON. Not the JSON itself: `orjson.dumps` returns its
    bytes in a buffer grown for writing (measured ~6 KB for a 0.1-2 KB message: tool calls and
    results), and every session's cached prompt holds one key per message."""
    if len(message) == 2:
        content = message.get("content")
        if isinstance(content, str):
            return (message.get("role"), content)
    return xxh3_128_intdigest(orjson.dumps(message))


class ModelTokenizer:
    """One model's tokenizer, template, block size and chain root, with its caches."""

    def __init__(
        self,
        settings: ModelSettings,
        *,
        max_sessions: int = 8192,
        max_messages: int = 65536,
        max_bytes: int = 256 * 1024 * 1024,
        tokenizer: Tokenizer | None = None,
        template: ChatTemplate | None = None,
    ) -> None:
        self.settings = settings
        self.block_size = settings.block_size
        self.root = chain_root(settings.name, settings.salt)
        self.tokenizer = tokenizer or load_tokenizer(settings.tokenizer)
        self.template = template or load_chat_template(settings.chat_template)
        # sessions hold each one's whole prompt; messages only the distinct ones
        self._sessions: _LRU = _LRU(max_sessions, max_bytes - max_bytes // 4)
        self._messages: _LRU = _LRU(max_messages, max_bytes // 4)
        self._encode = array_encoder(self.tokenizer)
        self._gen_prompt = self._encode(ChatTemplate.GENERATION_PROMPT)
        self.chunking = settings.chunks
        """Chunk reuse settings (None: off, and `chunk_prompt` is never called)."""
        self._separator: array[int] = array("I")
        self._blank: frozenset[int] = frozenset()
        if self.chunking is not None:
            if self.chunking.separator:
                self._separator = self._encode(self.chunking.separator)
            self._blank = frozenset(self._encode(" \n\t\r"))
        self.message_cache_hits = 0
        self.message_cache_misses = 0

    # --- pieces ------------------------------------------------------------------------------

    def _message_tokens(self, key: Any, message: Mapping[str, Any]) -> array[int]:
        cached: array[int] | None = self._messages.get_or_none(key)
        if cached is not None:
            self.message_cache_hits += 1
            return cached
        self.message_cache_misses += 1
        ids = self._encode(self.template.render_message(message))
        self._messages.put(key, ids, _ENTRY_BYTES + _key_bytes(key) + 4 * len(ids))
        return ids

    def _tools_tokens(self, tools: Any) -> tuple[bytes, array[int]]:
        key = b"tools\0" + orjson.dumps(tools)
        cached: array[int] | None = self._messages.get_or_none(key)
        if cached is None:
            head = self.template.render([], tools=tools, add_generation_prompt=False)
            cached = self._encode(head)
            self._messages.put(key, cached, _ENTRY_BYTES + len(key) + 4 * len(cached))
        return key, cached

    def _session(self, session_id: str | None) -> _SessionState:
        if session_id is None:
            return _SessionState()
        state = self._sessions.get_or_none(session_id)
        if state is None:
            state = _SessionState(session_id=session_id)
            self._sessions.put(session_id, state, state.nbytes())
        return state

    def _finish(self, state: _SessionState, ids: array[int], keep_tokens: int) -> Tokenized:
        """Hash `ids`, reusing the state's blocks that lie within its first `keep_tokens`."""
        bs = self.block_size
        old = state.chain
        keep = min(keep_tokens // bs, len(old), len(ids) // bs)
        parent = old[keep - 1] if keep else self.root
        new = hash_blocks(ids, bs, parent, keep * bs)
        chain = old if not new and keep == len(old) else old[:keep] + tuple(new)
        common = keep
        limit = min(len(old), len(chain))
        while common < limit and old[common] == chain[common]:
            common += 1
        state.ids = ids
        state.chain = chain
        if state.session_id is not None:
            self._sessions.resize(state.session_id, state.nbytes())
        return Tokenized(ids, chain, len(old), common)

    # --- chat --------------------------------------------------------------------------------

    def tokenize_chat(
        self, session_id: str | None, messages: Sequence[Mapping[str, Any]], tools: Any = None
    ) -> Tokenized:
        state = self._session(session_id)
        if not self.template.per_message:
            text = self.template.render(messages, tools=tools, add_generation_prompt=True)
            return self._tokenize_text(state, text)
        keys: list[Any] = []
        head_key: Any = None
        head: array[int] = array("I")
        if tools:
            head_key, head = self._tools_tokens(tools)
        keys.append(head_key)
        keys.extend(_message_key(m) for m in messages)
        # leading messages (and tools) unchanged since the previous turn keep their tokens
        old_keys = state.keys
        same = 0
        limit = min(len(old_keys), len(keys))
        while same < limit and old_keys[same] == keys[same]:
            same += 1
        if same == len(keys) == len(old_keys):
            # the same prompt again (a retry, another sample): same ids, same chain
            n = len(state.chain)
            return Tokenized(state.ids, state.chain, n, n)
        if same:
            keep_tokens = state.ends[same - 1]
            ids = state.ids[:keep_tokens]
            ends = state.ends[:same]
        else:
            keep_tokens = 0
            ids = array("I", head)
            ends = [len(ids)]
            same = 1
        for i in range(same, len(keys)):
            ids.extend(self._message_tokens(keys[i], messages[i - 1]))
            ends.append(len(ids))
        ids.extend(self._gen_prompt)
        state.keys = keys
        state.ends = ends
        return self._finish(state, ids, keep_tokens)

    # --- whole-text prompts (completions, non-per-message templates) -------------------------

    def _tokenize_text(self, state: _SessionState, text: str) -> Tokenized:
        # tokenize only the suffix beyond the session's previous text (a routing approximation
        # for BPE merges across the boundary; exact for the byte tokenizer)
        if state.text and text.startswith(state.text):
            keep = len(state.ids)
            ids = state.ids + self._encode(text[len(state.text) :])
        else:
            keep = 0
            ids = self._encode(text)
        state.text = text
        state.keys = []
        return self._finish(state, ids, keep)

    def tokenize_prompt(self, session_id: str | None, prompt: Any) -> Tokenized:
        """A `/v1/completions` prompt: a string, token ids, or a batch (routed by its first)."""
        state = self._session(session_id)
        if isinstance(prompt, list) and prompt:
            first = prompt[0]
            if isinstance(first, list):
                prompt = first
                first = prompt[0] if prompt else None
            if isinstance(first, int) and not isinstance(first, bool):
                try:
                    ids = array("I", (t for t in prompt if isinstance(t, int)))
                except OverflowError:
                    from ownerserve.errors import InvalidRequestError

                    raise InvalidRequestError(
                        "prompt token ids must be in [0, 2^32)", param="prompt"
                    ) from None
                keep = 0
                old = state.ids
                if old and len(ids) >= len(old) and ids[: len(old)] == old:
                    keep = len(old)
                state.text = ""
                return self._finish(state, ids, keep)
            prompt = first
        text = prompt if isinstance(prompt, str) else str(prompt)
        return self._tokenize_text(state, text)

    # --- chunked prompts (chunk reuse) ----------------------------------------------------------

    def chunk_prompt(
        self, tok: Tokenized, messages: Sequence[Mapping[str, Any]] | None
    ) -> ChunkedPrompt | None:
        """The prompt's chunks (`ownerserve/chunks.py`) when chunk reuse is on: chat parts or
        messages marked as chunks, else the separator format; None for a prompt without
        chunks. A malformed chunked prompt raises `InvalidRequestError` (400)."""
        cfg = self.chunking
        assert cfg is not None
        param = "messages" if messages is not None else "prompt"
        limit = self.settings.max_model_len
        if messages is not None and cfg.marked_parts:
            texts = marked_texts(messages)
            if texts:
                ids = [self._encode(t) for t in texts]
                return locate_chunks(
                    tok.token_ids, ids, self.root, max_model_len=limit,
                    max_chunks=cfg.max_chunks, blank=self._blank, param=param,
                )  # fmt: skip
        if not self._separator:
            return None
        return split_on_separator(
            tok.token_ids, self._separator, self.root, max_model_len=limit,
            max_chunks=cfg.max_chunks, blank=self._blank, param=param,
        )  # fmt: skip

    def forget(self, session_id: str) -> None:
        self._sessions.drop(session_id)

    def cache_stats(self) -> dict[str, int]:
        """The caches' entries, bytes held (as accounted) and evictions so far."""
        out: dict[str, int] = {}
        for name, lru in (("sessions", self._sessions), ("messages", self._messages)):
            out[f"{name}"] = len(lru)
            out[f"{name}_bytes"] = lru.bytes
            out[f"{name}_evicted"] = lru.evicted
        return out


class TokenizationCache:
    """Every configured model's `ModelTokenizer`."""

    def __init__(
        self,
        models: Sequence[ModelSettings],
        max_bytes: int = 256 * 1024 * 1024,
        max_sessions: int = 8192,
    ) -> None:
        """`max_bytes`: what every model's caches may hold together, split evenly;
        `max_sessions`: the sessions' last prompts each model's cache keeps."""
        share = max_bytes // max(1, len(models))
        self._models = {
            m.name: ModelTokenizer(m, max_sessions=max_sessions, max_bytes=share) for m in models
        }

    def get(self, model: str) -> ModelTokenizer | None:
        return self._models.get(model)

    def __contains__(self, model: str) -> bool:
        return model in self._models
