"""Deterministic synthetic text of an exact token length, and the chat template's overhead.

Workloads need prompts whose token counts and shared prefixes are exact at the server: the same
key always yields the same text, and `TextFactory.make(key, n)` encodes to exactly `n` tokens with
the built-in byte tokenizer (ASCII text, one token per character). For other tokenizers the text
is trimmed by encode/decode round trips and is exact in the common case (see `make`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from ownerserve.tokenizer import ByteTokenizer, ChatTemplate, Tokenizer

# A code-and-logs vocabulary so prompts look like an agent's context (ASCII only: with the byte
# tokenizer one character is one token).
_WORDS: tuple[str, ...] = (
    "def", "return", "self", "request", "router", "worker", "cache", "block", "prefix", "owner",
    "import", "from", "class", "async", "await", "None", "True", "False", "if", "else", "for",
    "in", "raise", "error", "value", "config", "session", "token", "decode", "prefill", "lease",
    "epoch", "plan", "cost", "queue", "test", "assert", "PASSED", "FAILED", "line", "file",
    "src/", "tests/", "module", "handler", "retry", "timeout", "json", "dict", "list", "int",
    "str", "len", "range", "print", "log", "INFO", "WARN", "diff", "+", "-", "==", "!=", "()",
    "[]", "{}", ":", "=", "0", "1", "2", "42", "128", "4096", "x", "y", "i", "n", "ok",
)  # fmt: skip


def _rng(seed: int, key: str) -> random.Random:
    return random.Random(f"{seed}\x00{key}")


def ascii_text(seed: int, key: str, n_chars: int) -> str:
    """`n_chars` characters of code-like ASCII text, the same for the same `(seed, key)`."""
    if n_chars <= 0:
        return ""
    rng = _rng(seed, key)
    parts: list[str] = []
    size = 0
    col = 0
    while size < n_chars:
        word = rng.choice(_WORDS)
        sep = "\n" if col > 60 or rng.random() < 0.08 else " "
        col = 0 if sep == "\n" else col + len(word) + 1
        parts.append(word)
        parts.append(sep)
        size += len(word) + 1
    return "".join(parts)[:n_chars]


class TextFactory:
    """Makes text of an exact token count for one tokenizer; same `(key, n)` -> same text."""

    def __init__(self, tokenizer: Tokenizer | None = None, seed: int = 0) -> None:
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        self.seed = seed
        self._exact_bytes = isinstance(self.tokenizer, ByteTokenizer)

    def count(self, text: str) -> int:
        """Tokens in `text` (its UTF-8 length for the byte tokenizer)."""
        if self._exact_bytes:
            return len(text.encode("utf-8"))
        return len(self.tokenizer.encode(text))

    def make(self, key: str, n_tokens: int) -> str:
        """Text of exactly `n_tokens` tokens (byte tokenizer); other tokenizers: as close as the
        tokenizer's merges allow, trimmed from a longer candidate so it never exceeds `n_tokens`."""
        if n_tokens <= 0:
            return ""
        if self._exact_bytes:
            return ascii_text(self.seed, key, n_tokens)
        tok = self.tokenizer
        text = ascii_text(self.seed, key, n_tokens * 6 + 16)
        ids = tok.encode(text)[:n_tokens]
        out = tok.decode(ids)
        for _ in range(4):  # decode/encode may merge differently at the cut; trim until it fits
            got = len(tok.encode(out))
            if got <= n_tokens:
                break
            out = tok.decode(tok.encode(out)[: n_tokens - (got - n_tokens)])
        return out


@dataclass(frozen=True, slots=True)
class TemplateOverhead:
    """Tokens the chat template adds around one user message's content."""

    head: int
    tail: int

    @property
    def total(self) -> int:
        return self.head + self.tail


_MARK = "\x00ownerserve-mark\x00"


@lru_cache(maxsize=8)
def _overhead_strings(template_source: str | None) -> tuple[str, str]:
    rendered = ChatTemplate(template_source).render([{"role": "user", "content": _MARK}])
    head, sep, tail = rendered.partition(_MARK)
    if not sep:
        raise ValueError("chat template does not render the message content verbatim")
    return head, tail


def template_overhead(
    tokenizer: Tokenizer | None = None, template: ChatTemplate | None = None
) -> TemplateOverhead:
    """Tokens before and after a single user message's content in the rendered prompt."""
    tok = tokenizer or ByteTokenizer()
    head, tail = _overhead_strings(template.source if template else None)
    return TemplateOverhead(head=len(tok.encode(head)), tail=len(tok.encode(tail)))
