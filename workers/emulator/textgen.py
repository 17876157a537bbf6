"""Deterministic pseudo-text: what the emulated model "writes".

Output is a stream of words drawn from a fixed vocabulary by a PRNG seeded from the prompt's
hash (and the request's `seed` and choice index), so the same request gets the same text on
every worker and tests can compare outputs. Each word is tokenized once per tokenizer and
cached, so producing a token costs a list index, not a tokenizer call. A tool call's arguments
are drawn from the tool's schema around that text (`tool_call_shape`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

import orjson

from ownerserve.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

_WORD_LIST = (
    "the of and to in is that for it as with was on be at by this had not are but from "
    "or have an they which one you were all we her she there would their will when who "
    "him been has more if no out do so can what up said about other into than its time "
    "only could new them man some these then two first may any like now my such make over "
    "our even most me state after also made many did must before back see through way "
    "where get much go well your know should down work year because come people just say "
    "each those take day good how long own too little use us very great still men here "
    "life both between old under last never place same another think house while high "
    "right might came off find states since used give against three himself look few "
    "general hand school part small american home during number again mrs around thought "
    "went without however govern don't does got public united point end become head once "
    "course fact upon need system set every war put form water took program present "
    "kernel router cache prefix block decode prefill owner lease token session agent tool"
)
WORDS: tuple[str, ...] = tuple(_WORD_LIST.split())


def _word_pieces(tokenizer: Tokenizer, word: str) -> tuple[tuple[int, str], ...]:
    """Token ids of `word` (with its leading space) and the text each contributes."""
    if isinstance(tokenizer, ByteTokenizer):
        return tuple((b, chr(b)) for b in word.encode("ascii"))
    if isinstance(tokenizer, HFTokenizer):
        enc = tokenizer._tok.encode(word, add_special_tokens=False)
        starts = [start for start, _end in enc.offsets] + [len(word)]
        starts[0] = 0
        return tuple((tid, word[starts[i] : starts[i + 1]]) for i, tid in enumerate(enc.ids)) or (
            (tokenizer.eos_token_id, ""),
        )
    ids = tokenizer.encode(word)
    return tuple((tid, tokenizer.decode([tid])) for tid in ids)


class Vocabulary:
    """The word list tokenized once with one tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.words: tuple[tuple[tuple[int, str], ...], ...] = tuple(
            _word_pieces(tokenizer, (" " if i else "") + w) for i, w in enumerate(WORDS)
        ) + tuple(_word_pieces(tokenizer, " " + w) for w in WORDS)
        # Index 0..len(WORDS)-1: words without a leading space (a text's first word).
        self._n = len(WORDS)

    def first(self, rng: random.Random) -> tuple[tuple[int, str], ...]:
        return self.words[rng.randrange(self._n)]

    def next(self, rng: random.Random) -> tuple[tuple[int, str], ...]:
        return self.words[self._n + rng.randrange(self._n)]


def text_seed(prompt_hash: int, seed: int | None, index: int) -> int:
    """The PRNG seed of one output: prompt identity, the request's seed, the choice index."""
    key = f"{prompt_hash}:{seed}:{index}".encode()
    return int.from_bytes(blake2b(key, digest_size=8).digest(), "little")


class OutputText:
    """The token stream of one choice: words, then EOS after `natural_len` tokens."""

    __slots__ = ("_emitted", "_pending", "_rng", "_vocab", "natural_len")

    def __init__(self, vocab: Vocabulary, seed: int, natural_len: int) -> None:
        self._vocab = vocab
        self._rng = random.Random(seed)
        self._pending: list[tuple[int, str]] = list(vocab.first(self._rng))
        self._pending.reverse()
        self._emitted = 0
        self.natural_len = natural_len

    @property
    def eos_id(self) -> int:
        return self._vocab.eos_token_id

    def next_token(self) -> tuple[int, str]:
        """The next (token id, text piece); EOS comes as (eos_token_id, "")."""
        if self._emitted >= self.natural_len:
            return self._vocab.eos_token_id, ""
        if not self._pending:
            self._pending = list(self._vocab.next(self._rng))
            self._pending.reverse()
        self._emitted += 1
        return self._pending.pop()


@dataclass(frozen=True, slots=True)
class ToolCallShape:
    """The JSON arguments of an emulated tool call, split where the emulated text goes: the
    arguments are `head + json-escaped text + tail` (`carries_text`), else `head + tail`."""

    name: str
    head: str
    tail: str
    carries_text: bool

    def piece(self, text: str) -> str:
        """What a piece of the emulated text adds to the arguments."""
        return orjson.dumps(text).decode()[1:-1] if self.carries_text else ""

    def arguments(self, text: str) -> str:
        return self.head + self.piece(text) + self.tail


_TEXT_SLOT = "\x00text\x00"


def _bound(schema: dict[str, Any], key: str, default: float) -> float:
    value = schema.get(key, default)
    return value if isinstance(value, int | float) and not isinstance(value, bool) else default


def _value(schema: Any, rng: random.Random, slot: list[bool]) -> Any:
    """A value that fits `schema` (a JSON schema): the first string met is the text slot."""
    if not isinstance(schema, dict):
        schema = {}
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return rng.choice(schema["enum"])
    if "const" in schema:
        return schema["const"]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or (kind is None and "properties" in schema):
        props = schema.get("properties")
        if not isinstance(props, dict):
            return {}
        return {k: _value(v, rng, slot) for k, v in props.items()}
    if kind == "array":
        return [_value(schema.get("items"), rng, slot)]
    if kind == "integer":
        lo, hi = int(_bound(schema, "minimum", 0)), int(_bound(schema, "maximum", 100))
        return rng.randint(lo, max(lo, hi))
    if kind == "number":
        low, high = _bound(schema, "minimum", 0), _bound(schema, "maximum", 1)
        return round(rng.uniform(low, max(low, high)), 3)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if not slot:
        slot.append(True)
        return _TEXT_SLOT
    return WORDS[rng.randrange(len(WORDS))]


def tool_call_shape(name: str, parameters: Any, seed: int) -> ToolCallShape:
    """Arguments drawn from the tool's `parameters` schema (seeded: the same request gets the
    same arguments); a schema without properties gets `{"input": <text>}`."""
    if not isinstance(parameters, dict) or not isinstance(parameters.get("properties"), dict):
        return ToolCallShape(name, '{"input": "', '"}', True)
    slot: list[bool] = []
    args = orjson.dumps(_value(parameters, random.Random(seed), slot)).decode()
    marker = orjson.dumps(_TEXT_SLOT).decode()
    if not slot or marker not in args:
        return ToolCallShape(name, args, "", False)
    head, _, tail = args.partition(marker)
    return ToolCallShape(name, head + '"', '"' + tail, True)
