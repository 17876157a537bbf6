"""Tokenization for routing: the model's chat template and tokenizer give token ids, the
`ownerserve.hashing` chain gives the block hashes the directory is keyed by.

Cached at two levels so a turn of a long session only tokenizes what is new: rendered
messages by content hash (per model, shared by sessions that repeat a system prompt or a
tool output), and each session's `ChainHasher`, which re-hashes only blocks past the longest
unchanged prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

import orjson

from ownerserve.config import ModelSettings
from ownerserve.hashing import ChainHasher, chain_root
from ownerserve.tokenizer import ChatTemplate, Tokenizer, load_chat_template, load_tokenizer


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


class _LRU(OrderedDict[Any, Any]):
    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def get_or_none(self, key: Any) -> Any:
        value = self.get(key)
        if value is not None:
            self.move_to_end(key)
        return value

    def put(self, key: Any, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        if len(self) > self.capacity:
            self.popitem(last=False)


@dataclass(slots=True)
class _SessionState:
    hasher: ChainHasher
    text: str = ""
    tokens: list[int] | None = None


class ModelTokenizer:
    """One model's tokenizer, template, block size and chain root, with its caches."""

    def __init__(
        self,
        settings: ModelSettings,
        *,
        max_sessions: int = 8192,
        max_messages: int = 65536,
        tokenizer: Tokenizer | None = None,
        template: ChatTemplate | None = None,
    ) -> None:
        self.settings = settings
        self.block_size = settings.block_size
        self.root = chain_root(settings.name, settings.salt)
        self.tokenizer = tokenizer or load_tokenizer(settings.tokenizer)
        self.template = template or load_chat_template(settings.chat_template)
        self._sessions: _LRU = _LRU(max_sessions)
        self._messages: _LRU = _LRU(max_messages)
        self._gen_prompt = self.tokenizer.encode(ChatTemplate.GENERATION_PROMPT)
        self.message_cache_hits = 0
        self.message_cache_misses = 0

    def _message_tokens(self, message: Mapping[str, Any]) -> list[int]:
        key = blake2b(orjson.dumps(message, option=orjson.OPT_SORT_KEYS), digest_size=16).digest()
        cached = self._messages.get_or_none(key)
        if cached is not None:
            self.message_cache_hits += 1
            return cached
        self.message_cache_misses += 1
        ids = self.tokenizer.encode(self.template.render_message(message))
        self._messages.put(key, ids)
        return ids

    def _tools_tokens(self, tools: Any) -> list[int]:
        key = blake2b(b"tools\0" + orjson.dumps(tools, option=orjson.OPT_SORT_KEYS)).digest()
        cached: list[int] | None = self._messages.get_or_none(key)
        if cached is None:
            head = self.template.render([], tools=tools, add_generation_prompt=False)
            cached = self.tokenizer.encode(head)
            self._messages.put(key, cached)
        return cached

    def _session(self, session_id: str | None) -> _SessionState:
        if session_id is None:
            return _SessionState(ChainHasher(self.block_size, self.root))
        state = self._sessions.get_or_none(session_id)
        if state is None:
            state = _SessionState(ChainHasher(self.block_size, self.root))
            self._sessions.put(session_id, state)
        return state

    def _text_tokens(self, state: _SessionState, text: str) -> list[int]:
        # Templates that are not per-message render the whole prompt; tokenize only the
        # suffix beyond the session's previous text (a routing approximation for BPE merges
        # across the boundary, exact for the byte tokenizer).
        if state.tokens is not None and state.text and text.startswith(state.text):
            tokens = state.tokens + self.tokenizer.encode(text[len(state.text) :])
        else:
            tokens = self.tokenizer.encode(text)
        state.text = text
        state.tokens = tokens
        return tokens

    def chat_tokens(
        self, state: _SessionState, messages: Sequence[Mapping[str, Any]], tools: Any
    ) -> list[int]:
        if not self.template.per_message:
            text = self.template.render(messages, tools=tools, add_generation_prompt=True)
            return self._text_tokens(state, text)
        ids: list[int] = []
        if tools:
            ids.extend(self._tools_tokens(tools))
        for m in messages:
            ids.extend(self._message_tokens(m))
        ids.extend(self._gen_prompt)
        return ids

    def tokenize_chat(
        self, session_id: str | None, messages: Sequence[Mapping[str, Any]], tools: Any = None
    ) -> Tokenized:
        state = self._session(session_id)
        ids = self.chat_tokens(state, messages, tools)
        return self._hash(state, ids)

    def tokenize_prompt(self, session_id: str | None, prompt: Any) -> Tokenized:
        """A `/v1/completions` prompt: a string, token ids, or a batch (routed by its first)."""
        state = self._session(session_id)
        if isinstance(prompt, list) and prompt:
            first = prompt[0]
            if isinstance(first, int) and not isinstance(first, bool):
                ids = [int(t) for t in prompt if isinstance(t, int)]
                return self._hash(state, ids)
            prompt = first
            if isinstance(prompt, list):
                return self._hash(state, [int(t) for t in prompt if isinstance(t, int)])
        text = prompt if isinstance(prompt, str) else str(prompt)
        return self._hash(state, self._text_tokens(state, text))

    def _hash(self, state: _SessionState, ids: Sequence[int]) -> Tokenized:
        hasher = state.hasher
        previous = len(hasher.hashes)
        old = list(hasher.hashes)
        chain = hasher.update(ids)
        common = 0
        for a, b in zip(old, chain, strict=False):
            if a != b:
                break
            common += 1
        return Tokenized(ids, tuple(chain), previous, common)

    def forget(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)


class TokenizationCache:
    """Every configured model's `ModelTokenizer`."""

    def __init__(self, models: Sequence[ModelSettings]) -> None:
        self._models = {m.name: ModelTokenizer(m) for m in models}

    def get(self, model: str) -> ModelTokenizer | None:
        return self._models.get(model)

    def __contains__(self, model: str) -> bool:
        return model in self._models
