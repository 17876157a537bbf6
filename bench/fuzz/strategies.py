"""Hypothesis strategies that make fuzz cases for every route of the router: request bodies
shaped like each route's, valid or with fields type-mutated anywhere in the tree (`body_cases`),
and byte-level HTTP abuse sent as is over a socket (`raw_cases`). Pure: no I/O; what sends a
case and judges its answer is `bench.fuzz.harness`.

A body is built as Python values and written by `encode`, which also writes what `json.dumps`
cannot: raw JSON tokens (`Token`: NaN, 1e999, integers past 64 bits, nesting past every
parser's depth limit) and objects with repeated keys (`Pairs`)."""

from __future__ import annotations

import copy
import json
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from hypothesis import strategies as st

from loadgen.cluster import MODEL
from planner.policies import PEER_POLICY_NAMES, POLICY_NAMES
from router.session import SESSION_HEADERS

ADMIN_TOKEN = "fuzz-admin-token"
"""The admin token the fuzzed router is configured with (`server.admin_token`)."""
WORKERS: tuple[tuple[str, str, str], ...] = (
    ("h0", "hybrid", "emulator"),
    ("p0", "prefill", "emulator"),
    ("d0", "decode", "emulator"),
    ("sp0", "prefill", "sglang"),
    ("sd0", "decode", "sglang"),
)
"""(id, role, kind) of the emulated workers behind the fuzzed router: p0 → d0 is a P/D pair of
vLLM's protocol (prefill, then decode with what P hands over), sp0 → sd0 one of SGLang's
(rendezvous on a bootstrap room), h0 serves whole requests. A remote prefill pairs workers of
one kind, so both protocols take two pairs (`static-pd` in the policy header picks them)."""
WORKER_IDS = tuple(w[0] for w in WORKERS)
STORED = "@stored-response@"
"""Stands for the id of a response the router stored in an earlier case (the harness puts the
newest one in its place, or a made-up id when there is none yet)."""

ANTHROPIC = "anthropic"
OPENAI = "openai"


@dataclass(frozen=True, slots=True)
class Case:
    """One fuzz case: an HTTP request (`method`, `path`, `headers`, `body`) sent with httpx, or
    `raw` bytes sent as is over a socket. `route` names what it aims at (the summary counts by
    it); `shape` is the error shape a 4xx must have (`OPENAI`, `ANTHROPIC`, or None: either,
    for raw bytes whose route the server may not have read). A raw case is `complete` when its
    bytes end where a parser would end a request (the harness then sends a closing request
    after them and reads every answer); an incomplete one is sent and the socket closed."""

    route: str
    method: str = "GET"
    path: str = "/"
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    shape: str | None = OPENAI
    raw: bytes | None = None
    complete: bool = True
    pieces: tuple[int, ...] = ()
    """Where a raw case's bytes are split into separate writes."""

    def summary(self, limit: int = 600) -> str:
        """The case in a line or a few, long bodies cut (for failure reports)."""
        if self.raw is not None:
            data = self.raw
            what = f"raw {len(data)} bytes, complete={self.complete}, pieces={self.pieces}"
        else:
            data = self.body
            what = f"{self.method} {self.path} headers={list(self.headers)} body {len(data)} bytes"
        shown = repr(data[:limit]) + ("..." if len(data) > limit else "")
        return f"[{self.route}] {what}: {shown}"


# --- JSON with what json.dumps cannot write -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Token:
    """JSON text put into a body as is."""

    text: str


@dataclass(frozen=True, slots=True)
class Pairs:
    """A JSON object whose members are written in this order, repeated keys included."""

    items: tuple[tuple[str, Any], ...] = field(default_factory=tuple)


def encode(value: Any, ascii_only: bool = True) -> bytes:
    """`value` as JSON bytes. Floats NaN and infinities become the `NaN`/`Infinity` tokens
    (as `json.dumps` writes them). With `ascii_only` false, strings are written as UTF-8, and
    a lone surrogate becomes bytes that are not UTF-8 at all."""
    out: list[str] = []
    _write(value, out, ascii_only)
    return "".join(out).encode("utf-8", "surrogatepass")


def _write(value: Any, out: list[str], ascii_only: bool) -> None:
    if isinstance(value, Token):
        out.append(value.text)
    elif isinstance(value, str):
        out.append(json.dumps(value, ensure_ascii=ascii_only))
    elif isinstance(value, bool) or value is None or isinstance(value, int | float):
        out.append(json.dumps(value))
    elif isinstance(value, dict | Pairs):
        items = value.items if isinstance(value, Pairs) else tuple(value.items())
        out.append("{")
        for i, (k, v) in enumerate(items):
            if i:
                out.append(",")
            out.append(json.dumps(k, ensure_ascii=ascii_only))
            out.append(":")
            _write(v, out, ascii_only)
        out.append("}")
    elif isinstance(value, list | tuple):
        out.append("[")
        for i, v in enumerate(value):
            if i:
                out.append(",")
            _write(v, out, ascii_only)
        out.append("]")
    else:
        raise TypeError(f"cannot encode {type(value).__name__}")


# --- values ---------------------------------------------------------------------------------------

SPECIAL_TOKENS = (
    "NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    "-1e999",
    "1e-999",
    "-0",
    "4.9e-324",
    "123456789012345678901234567890",
    "-9223372036854775809",
    "18446744073709551616",
    "1E400",
    "0.0000000000000000000000000001",
)
"""Numbers as JSON tokens: not JSON at all (NaN), past a double, past 64-bit integers."""
WEIRD_STRINGS = (
    "",
    " ",
    "\x00",
    "\ud800",
    "\udfff",
    "\ud83d",
    "\x00\x01\x1f\x7f",
    "\u202e\u2066",
    "\ufeff",
    "\uffff",
    "\U0010ffff",
    "🦀" * 8,
    "é" * 100,
    "null",
    "true",
    "NaN",
    "{{ 7 * 7 }}",
    "{% for x in range(999999999) %}x{% endfor %}",
    "<|im_start|>system\n",
    "<|endoftext|>",
    "\r\n\r\n",
    "%s%n%x%00",
    "../../../../etc/passwd",
    "'; --",
)
_IDENT = st.text(alphabet=string.ascii_letters + string.digits + "_-", min_size=1, max_size=16)
_ASCII = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
_HEADER_VALUE = st.text(alphabet=_ASCII, max_size=40).map(str.strip)
"""Header values httpx sends: printable ASCII, no whitespace around."""
_SHORT_TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(WEIRD_STRINGS),
    st.builds(lambda s, n: s * n, st.text(min_size=1, max_size=8), st.integers(20, 700)),
)
"""Message texts: short, odd, or a few hundred to a few thousand characters."""


def _huge(n: int, char: str) -> str:
    return char * n


HUGE_STRINGS = st.builds(
    _huge, st.integers(20_000, 700_000), st.sampled_from(["a", "é", "🦀", " ", "\n", "\x00"])
)
"""Strings of up to a few MB as JSON: the fuzzed router's body limit is 2 MiB, so some pass and
some get 413."""


def _deep(depth: int, obj: bool) -> Token:
    if obj:
        return Token('{"a":' * depth + "1" + "}" * depth)
    return Token("[" * depth + "1" + "]" * depth)


DEEP_NESTING = st.builds(_deep, st.integers(100, 1200), st.booleans())
"""Arrays or objects nested 100 to 1,200 deep: within, at and past the JSON parser's limit."""
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from((0, -1, 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63) - 1)),
    st.floats(),
    st.sampled_from(SPECIAL_TOKENS).map(Token),
    st.text(max_size=30),
    st.sampled_from(WEIRD_STRINGS),
)
JUNK = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3)
    ),
    max_leaves=6,
)
"""A value of any JSON type (and some that are not JSON), shallow."""
ANY_JUNK = st.one_of(JUNK, JUNK, JUNK, JUNK, DEEP_NESTING, HUGE_STRINGS)
"""Mostly `JUNK`, sometimes deeply nested or huge."""
FIELD_NAMES = st.one_of(
    st.sampled_from(
        (
            "kv_transfer_params",
            "bootstrap_host",
            "bootstrap_port",
            "bootstrap_room",
            "rid",
            "request_id",
            "data_parallel_rank",
            "disagg_prefill_dp_rank",
            "decode_tp_size",
            "priority",
            "ignore_eos",
            "min_tokens",
            "guided_json",
            "extra_body",
            "__proto__",
            "",
            "model ",
            "MODEL",
            "stream",
            "n",
        )
    ),
    st.text(max_size=12),
)
"""Fields a mutation adds: the router's control-plane fields, engines' extensions, odd names."""


# --- mutations ------------------------------------------------------------------------------------


def _spots(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside `value` (the empty path: `value` itself)."""
    out = [path]
    if isinstance(value, dict):
        for k, v in value.items():
            out.extend(_spots(v, (*path, k)))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.extend(_spots(v, (*path, i)))
    return out


def _at(value: Any, path: Sequence[Any]) -> Any:
    for key in path:
        value = value[key]
    return value


MUTATIONS = ("replace", "replace", "replace", "delete", "wrap_list", "wrap_object", "add", "null")
"""What a mutation does at a spot: a value of another type, the field gone, the value in an
array or an object where it was bare, an unknown field added, null."""


@st.composite
def mutated(draw: st.DrawFn, base: st.SearchStrategy[Any]) -> Any:
    """A value of `base` with up to three mutations anywhere in its tree (none: the value as
    it is), and sometimes a top-level key repeated with a junk value."""
    body = copy.deepcopy(draw(base))  # a `just` value is shared between draws
    for _ in range(draw(st.integers(0, 3))):
        path = draw(st.sampled_from(_spots(body)))
        op = draw(st.sampled_from(MUTATIONS))
        if not path:
            if op in ("replace", "null", "delete"):
                body = None if op == "null" else draw(ANY_JUNK)
            elif op == "wrap_list":
                body = [body]
            elif op == "wrap_object":
                body = {"body": body}
            elif isinstance(body, dict):
                body[draw(FIELD_NAMES)] = draw(JUNK)
            continue
        parent = _at(body, path[:-1])
        key = path[-1]
        if op == "replace":
            parent[key] = draw(ANY_JUNK)
        elif op == "null":
            parent[key] = None
        elif op == "delete":
            del parent[key]
        elif op == "wrap_list":
            parent[key] = [parent[key]]
        elif op == "wrap_object":
            parent[key] = {"value": parent[key]}
        elif isinstance(parent[key], dict):
            parent[key][draw(FIELD_NAMES)] = draw(JUNK)
        else:
            parent[key] = draw(ANY_JUNK)
    if isinstance(body, dict) and body and draw(st.integers(0, 9)) == 0:
        key = draw(st.sampled_from(sorted(body)))
        return Pairs((*body.items(), (key, draw(JUNK))))
    return body


# --- chat completions -----------------------------------------------------------------------------

DATA_IMAGE = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhf"
    "DwAChwGA60e6kgAAAABJRU5ErkJggg=="
)
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
_IMAGE_URLS = st.sampled_from([DATA_IMAGE, "data:,", "", "http://127.0.0.1:1/x.png", "x"])
_ROLES = ("system", "user", "assistant", "developer", "tool", "function", "")
_ARGUMENTS = st.sampled_from(['{"a": "b"}', "{}", "not json", "", "[1, 2]"])


def _obj(required: dict[str, Any], optional: dict[str, Any] | None = None) -> Any:
    """`st.fixed_dictionaries`, its values strategies or plain values."""

    def strat(v: Any) -> st.SearchStrategy[Any]:
        return v if isinstance(v, st.SearchStrategy) else st.just(v)

    return st.fixed_dictionaries(
        {k: strat(v) for k, v in required.items()},
        optional={k: strat(v) for k, v in (optional or {}).items()},
    )


CHAT_PARTS = st.one_of(
    _obj({"type": "text", "text": _SHORT_TEXT}),
    _obj({"type": "image_url", "image_url": _obj({"url": _IMAGE_URLS}, {"detail": "low"})}),
    _obj({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}),
    _obj(
        {
            "type": "file",
            "file": {"file_data": "data:application/pdf;base64,JVBERi0=", "filename": "a.pdf"},
        }
    ),
    _obj({"type": "refusal", "refusal": _SHORT_TEXT}),
    _obj({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}),
    _obj({"type": st.text(max_size=10)}, {"text": _SHORT_TEXT}),
)
"""A chat message's content parts, of every kind (and of none)."""
_TOOL_CALL = _obj(
    {"id": _IDENT, "type": "function", "function": _obj({"name": _IDENT, "arguments": _ARGUMENTS})}
)
CHAT_MESSAGES = st.one_of(
    _obj(
        {
            "role": st.sampled_from(_ROLES),
            "content": st.one_of(_SHORT_TEXT, st.lists(CHAT_PARTS, min_size=1, max_size=3)),
        },
        {"name": _IDENT},
    ),
    _obj(
        {
            "role": "assistant",
            "content": st.one_of(st.none(), _SHORT_TEXT),
            "tool_calls": st.lists(_TOOL_CALL, min_size=1, max_size=2),
        }
    ),
    _obj({"role": "tool", "tool_call_id": _IDENT, "content": _SHORT_TEXT}),
    _obj({"role": "assistant", "content": _SHORT_TEXT, "reasoning_content": _SHORT_TEXT}),
)
_FUNCTION_TOOL = _obj(
    {
        "type": "function",
        "function": _obj({"name": _IDENT, "parameters": SCHEMA}, {"description": _SHORT_TEXT}),
    }
)
_RESPONSE_FORMATS = st.sampled_from(
    [
        {"type": "json_object"},
        {"type": "text"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
    ]
)
_SAMPLING = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "seed": st.integers(0, 2**31),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=3)),
    "user": st.text(max_size=20),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 4),
    "stream_options": _obj({"include_usage": st.booleans()}),
    "n": st.integers(1, 3),
    "kv_transfer_params": {"ownerserve": {"load": False}},
    "bootstrap_room": st.integers(0, 2**63),
}
"""Optional fields both completion endpoints take."""
CHAT_BODIES = _obj(
    {
        "model": MODEL,
        "messages": st.lists(CHAT_MESSAGES, min_size=1, max_size=4),
        "max_tokens": st.integers(1, 8),
    },
    {
        **_SAMPLING,
        "stream": st.booleans(),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 5),
        "tools": st.lists(_FUNCTION_TOOL, min_size=1, max_size=2),
        "tool_choice": st.sampled_from(["auto", "none", "required"]),
        "response_format": _RESPONSE_FORMATS,
        "parallel_tool_calls": st.booleans(),
        "max_completion_tokens": st.integers(1, 8),
        "logit_bias": st.dictionaries(
            st.integers(0, 255).map(str), st.integers(-100, 100), max_size=2
        ),
        "metadata": st.dictionaries(_IDENT, st.text(max_size=10), max_size=2),
    },
)
"""Valid chat completion bodies (before mutation): small answers, streamed or not."""
COMPLETION_BODIES = _obj(
    {
        "model": MODEL,
        "prompt": st.one_of(
            _SHORT_TEXT,
            st.lists(st.integers(0, 255), min_size=1, max_size=300),
            st.lists(
                st.lists(st.integers(0, 255), min_size=1, max_size=50), min_size=1, max_size=2
            ),
            st.lists(_SHORT_TEXT, min_size=1, max_size=2),
        ),
        "max_tokens": st.integers(1, 8),
    },
    {
        **_SAMPLING,
        "stream": st.booleans(),
        "echo": st.booleans(),
        "logprobs": st.integers(0, 5),
        "suffix": st.text(max_size=10),
        "best_of": st.integers(1, 2),
    },
)
"""Valid text completion bodies (before mutation)."""

# --- Responses ------------------------------------------------------------------------------------

_RESPONSE_PARTS = st.one_of(
    _obj({"type": "input_text", "text": _SHORT_TEXT}),
    _obj({"type": "input_image", "image_url": _IMAGE_URLS}, {"detail": "auto"}),
    _obj(
        {
            "type": "input_file",
            "file_data": "data:application/pdf;base64,JVBERi0=",
            "filename": "a.pdf",
        }
    ),
    _obj({"type": "output_text", "text": _SHORT_TEXT}),
    _obj({"type": "refusal", "refusal": _SHORT_TEXT}),
    _obj({"type": st.text(max_size=10)}),
)
_RESPONSE_ITEMS = st.one_of(
    _obj(
        {
            "role": st.sampled_from(["user", "system", "developer", "assistant"]),
            "content": st.one_of(_SHORT_TEXT, st.lists(_RESPONSE_PARTS, min_size=1, max_size=3)),
        },
        {"type": "message"},
    ),
    _obj({"type": "function_call", "call_id": _IDENT, "name": _IDENT, "arguments": _ARGUMENTS}),
    _obj({"type": "function_call_output", "call_id": _IDENT, "output": _SHORT_TEXT}),
    _obj({"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "x"}]}),
    _obj({"type": "item_reference", "id": "msg_1"}),
    _obj({"type": "web_search_call", "id": "ws_1", "status": "completed"}),
)
_RESPONSE_TOOLS = st.one_of(
    _obj({"type": "function", "name": _IDENT, "parameters": SCHEMA}, {"strict": st.booleans()}),
    st.just({"type": "web_search"}),
    st.just({"type": "file_search", "vector_store_ids": ["vs_1"]}),
)
RESPONSE_BODIES = _obj(
    {
        "model": MODEL,
        "input": st.one_of(_SHORT_TEXT, st.lists(_RESPONSE_ITEMS, min_size=1, max_size=4)),
    },
    {
        "instructions": _SHORT_TEXT,
        "max_output_tokens": st.integers(1, 8),
        "stream": st.booleans(),
        "store": st.booleans(),
        "previous_response_id": st.one_of(st.just(STORED), _IDENT.map(lambda s: "resp_" + s)),
        "tools": st.lists(_RESPONSE_TOOLS, min_size=1, max_size=2),
        "tool_choice": st.one_of(
            st.sampled_from(["auto", "none", "required"]),
            _obj({"type": "function", "name": _IDENT}),
        ),
        "text": st.sampled_from(
            [
                {"format": {"type": "text"}},
                {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}},
                {"format": {"type": "json_object"}},
            ]
        ),
        "reasoning": _obj({"effort": st.sampled_from(["low", "medium", "high"])}),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1),
        "metadata": st.dictionaries(_IDENT, st.text(max_size=10), max_size=2),
        "truncation": st.sampled_from(["auto", "disabled"]),
        "parallel_tool_calls": st.booleans(),
        "background": st.booleans(),
        "user": st.text(max_size=10),
        "include": st.just(["reasoning.encrypted_content"]),
    },
)
"""Valid Responses API bodies (before mutation)."""

# --- Anthropic Messages ---------------------------------------------------------------------------

_M_TEXT = _obj({"type": "text", "text": _SHORT_TEXT}, {"cache_control": {"type": "ephemeral"}})
_M_IMAGE = _obj(
    {
        "type": "image",
        "source": st.sampled_from(
            [
                {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
                {"type": "url", "url": "http://127.0.0.1:1/x.png"},
                {"type": "file", "file_id": "file_1"},
            ]
        ),
    }
)
_M_TOOL_RESULT = _obj(
    {
        "type": "tool_result",
        "tool_use_id": _IDENT,
        "content": st.one_of(_SHORT_TEXT, st.lists(st.one_of(_M_TEXT, _M_IMAGE), max_size=2)),
    },
    {"is_error": st.booleans()},
)
_M_DOCUMENT = _obj(
    {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc"}}
)
_M_TOOL_USE = _obj(
    {
        "type": "tool_use",
        "id": _IDENT,
        "name": _IDENT,
        "input": st.dictionaries(_IDENT, JUNK, max_size=2),
    }
)
_M_THINKING = _obj({"type": "thinking", "thinking": _SHORT_TEXT, "signature": "sig"})
_M_UNKNOWN = _obj({"type": st.text(max_size=10)})
_M_MESSAGES = st.one_of(
    _obj(
        {
            "role": "user",
            "content": st.one_of(
                _SHORT_TEXT,
                st.lists(
                    st.one_of(_M_TEXT, _M_IMAGE, _M_TOOL_RESULT, _M_DOCUMENT, _M_UNKNOWN),
                    min_size=1,
                    max_size=3,
                ),
            ),
        }
    ),
    _obj(
        {
            "role": "assistant",
            "content": st.one_of(
                _SHORT_TEXT,
                st.lists(
                    st.one_of(
                        _M_TEXT,
                        _M_TOOL_USE,
                        _M_THINKING,
                        st.just({"type": "redacted_thinking", "data": "x"}),
                    ),
                    min_size=1,
                    max_size=3,
                ),
            ),
        }
    ),
)
_M_TOOLS = st.one_of(
    _obj({"name": _IDENT, "input_schema": SCHEMA}, {"description": _SHORT_TEXT}),
    st.just({"type": "web_search_20250305", "name": "web_search"}),
    _obj({"type": "custom", "name": _IDENT, "input_schema": SCHEMA}),
)
_M_OPTIONAL = {
    "system": st.one_of(_SHORT_TEXT, st.lists(_M_TEXT, max_size=2)),
    "tools": st.lists(_M_TOOLS, min_size=1, max_size=2),
    "tool_choice": st.one_of(
        _obj(
            {"type": st.sampled_from(["auto", "any", "none"])},
            {"disable_parallel_tool_use": st.booleans()},
        ),
        _obj({"type": "tool", "name": _IDENT}),
    ),
    "stop_sequences": st.lists(st.text(max_size=5), max_size=3),
    "temperature": st.floats(0, 1),
    "top_k": st.integers(0, 100),
    "top_p": st.floats(0.01, 1),
    "metadata": _obj({"user_id": st.text(max_size=20)}),
    "stream": st.booleans(),
    "output_config": st.just({"format": {"type": "json_schema", "schema": SCHEMA}}),
    "thinking": _obj({"type": "enabled", "budget_tokens": st.integers(1024, 4096)}),
    "service_tier": st.sampled_from(["auto", "standard_only"]),
}
MESSAGES_BODIES = _obj(
    {
        "model": MODEL,
        "max_tokens": st.integers(1, 8),
        "messages": st.lists(_M_MESSAGES, min_size=1, max_size=4),
    },
    _M_OPTIONAL,
)
"""Valid Anthropic Messages bodies (before mutation)."""
COUNT_TOKENS_BODIES = _obj(
    {"model": MODEL, "messages": st.lists(_M_MESSAGES, min_size=1, max_size=4)},
    {k: v for k, v in _M_OPTIONAL.items() if k != "stream"},
)
"""Valid `count_tokens` bodies (before mutation)."""

# --- headers --------------------------------------------------------------------------------------

POLICIES = (*POLICY_NAMES, *PEER_POLICY_NAMES, "nope", "", "OWNERSERVE", "static pd")
HEADERS = st.lists(
    st.one_of(
        st.tuples(
            st.just("x-session-id"), st.one_of(st.sampled_from(["s1", "s2", "s3"]), _HEADER_VALUE)
        ),
        st.tuples(st.sampled_from(SESSION_HEADERS), _HEADER_VALUE),
        st.tuples(st.just("x-ownerserve-policy"), st.sampled_from(POLICIES)),
        st.tuples(st.just("x-ownerserve-policy"), st.sampled_from(["static-pd", "colocated"])),
        st.tuples(
            st.just("content-type"),
            st.sampled_from(
                ["application/json", "text/plain", "multipart/form-data; boundary=x", ""]
            ),
        ),
        st.tuples(
            st.just("authorization"), st.sampled_from(["Bearer x", "Basic eA==", "Bearer", ""])
        ),
        st.tuples(
            st.sampled_from(["x-api-key", "x-request-id", "user-agent", "anthropic-version"]),
            _HEADER_VALUE,
        ),
        st.tuples(st.just("x-data-parallel-rank"), st.sampled_from(["0", "-1", "x"])),
        st.tuples(st.just("accept-encoding"), st.sampled_from(["gzip", "br", "identity;q=0"])),
        st.tuples(st.just("expect"), st.just("100-continue")),
    ),
    max_size=3,
).map(tuple)
"""Request headers a client may send (printable ASCII: what httpx sends; the byte-level cases
send the rest)."""


def _body_case(route: str, path: str, shape: str, bodies: st.SearchStrategy[Any]) -> Any:
    return st.builds(
        lambda body, ascii_only, headers: Case(
            route, "POST", path, headers, encode(body, ascii_only), shape
        ),
        mutated(bodies),
        st.booleans(),
        HEADERS,
    )


_METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS")
_ID_TEXT = st.one_of(
    st.just(STORED),
    _IDENT.map(lambda s: "resp_" + s),
    st.text(max_size=20),
    st.text(alphabet=_ASCII, min_size=190, max_size=220),
)
"""Ids in a path: a stored response's, made-up ones, odd characters, too long."""


def _segment(text: str) -> str:
    return quote(text.encode("utf-8", "surrogatepass"), safe="")


def _responses_id_case() -> Any:
    def make(method: str, rid: str, cancel: bool, headers: tuple[tuple[str, str], ...]) -> Case:
        path = f"/v1/responses/{rid if rid == STORED else _segment(rid)}"
        return Case("responses/{id}", method, path + ("/cancel" if cancel else ""), headers)

    return st.builds(
        make,
        st.sampled_from(["GET", "GET", "DELETE", "POST", "PUT"]),
        _ID_TEXT,
        st.booleans(),
        HEADERS,
    )


def _simple_get(route: str, path: str) -> Any:
    return st.builds(
        lambda method, query, headers: Case(route, method, path + query, headers),
        st.sampled_from(["GET", "GET", "GET", *_METHODS]),
        st.one_of(st.just(""), st.text(alphabet=_ASCII, max_size=20).map(lambda q: "?" + quote(q))),
        HEADERS,
    )


# --- admin API ------------------------------------------------------------------------------------

_ADMIN_AUTH = st.sampled_from(
    [
        (("x-admin-token", ADMIN_TOKEN),),
        (("authorization", f"Bearer {ADMIN_TOKEN}"),),
        (("authorization", f"bearer   {ADMIN_TOKEN}"),),
        (("x-admin-token", ADMIN_TOKEN),),
        (("x-admin-token", "wrong"),),
        (("authorization", "Bearer"),),
        (("x-admin-token", ADMIN_TOKEN + "x"),),
        (),
    ]
)
LOOPBACK_ONLY = ("url", "sidecar_url", "kv_events_endpoint", "kv_events_replay_endpoint")
"""Fields of a worker the router connects to: the fuzz only ever names loopback addresses
there (`loopback_only` checks each added worker before it is sent)."""
_WORKER_BODIES = _obj(
    {
        "id": st.one_of(
            _IDENT.map(lambda s: "fz-" + s), st.sampled_from(WORKER_IDS), st.text(max_size=10)
        ),
        "url": st.sampled_from(
            ["http://127.0.0.1:1", "http://127.0.0.1:9/", "not a url", "", "127.0.0.1:1"]
        ),
    },
    {
        "role": st.sampled_from(["hybrid", "prefill", "decode", "x"]),
        "kind": st.sampled_from(["emulator", "sglang", "vllm", "x"]),
        "models": st.one_of(st.just([MODEL]), st.lists(st.text(max_size=8), max_size=2)),
        "node": st.text(max_size=10),
        "profile": st.sampled_from([None, "h100-llama3-8b", "nope", "../../etc/passwd"]),
        "bootstrap_port": st.integers(-1, 70000),
        "kv_events_endpoint": st.sampled_from([None, "tcp://127.0.0.1:1", "bogus"]),
        "sidecar_url": st.sampled_from([None, "http://127.0.0.1:1"]),
        "cpu_kv_tokens": st.integers(-5, 10**6),
        "kv_paths": st.lists(
            st.sampled_from(["nixl_pd", "bootstrap_pd", "sidecar", "chunk_fetch", "x"]), max_size=3
        ),
    },
)


def loopback_only(value: Any) -> bool:
    """Whether a worker body names no address but loopback ones in `LOOPBACK_ONLY` (a string
    there with a scheme must be one on 127.0.0.1; anything else, the router cannot connect
    to)."""
    items = value.items if isinstance(value, Pairs) else tuple(value.items())
    for k, v in items:
        named = k in LOOPBACK_ONLY and isinstance(v, str) and "://" in v
        if named and not v.split("://", 1)[1].startswith("127.0.0.1:"):
            return False
    return True


def _admin_case() -> Any:
    def add(body: Any, auth: tuple[tuple[str, str], ...]) -> Case:
        return Case("admin", "POST", "/admin/workers", auth, encode(body))

    def one(method: str, what: str, wid: str, auth: tuple[tuple[str, str], ...]) -> Case:
        if what == "workers/{id}":
            path = f"/admin/workers/{_segment(wid)}"
        elif what in ("drain", "undrain"):
            path = f"/admin/workers/{_segment(wid)}/{what}"
        else:
            path = f"/admin/{what}"
        return Case("admin", method, path, auth)

    worker_ids = st.one_of(st.sampled_from(WORKER_IDS), _IDENT, st.text(max_size=12), st.just(""))
    adds = st.builds(
        add,
        mutated(_WORKER_BODIES).filter(
            lambda b: not isinstance(b, dict | Pairs) or loopback_only(b)
        ),
        _ADMIN_AUTH,
    )
    others = st.builds(
        one,
        st.sampled_from(["GET", "GET", "POST", "DELETE", "PUT"]),
        st.sampled_from(
            ["workers", "workers/{id}", "drain", "undrain", "plans", "calibration", "links", "nope"]
        ),
        worker_ids,
        _ADMIN_AUTH,
    )
    return st.one_of(adds, others)


# --- byte-level HTTP ------------------------------------------------------------------------------

ROUTE_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/responses/resp_x",
    "/v1/responses/resp_x/cancel",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/models",
    "/health",
    "/metrics",
    "/admin/workers",
)
ODD_TARGETS = (
    "http://127.0.0.1:1/v1/chat/completions",
    "http://127.0.0.1:1/health",
    "https://127.0.0.1/v1/messages",
    "127.0.0.1:1",
    "*",
    "",
    "//v1/models",
    "/v1/chat%2Fcompletions",
    "/v1/%63hat/completions",
    "/v1/messages%00",
    "/%2e%2e/admin/workers",
    "/v1/../admin/workers",
    "/v1/responses/%ZZ",
    "/v1/responses/%00%ff",
    "/health?" + "a=" * 2000,
    "/v1/chat/completions?stream=true",
    "/v1/chat/completions#frag",
    "/\x00",
    "/é",
    "/v1/models\t",
)
"""Request targets besides the routes: absolute form, authority form, asterisk, empty,
percent-encoded and dot segments, control bytes."""
_BAD_JSON = (
    b"",
    b"{",
    b"{}",
    b"[]",
    b"null",
    b'"x"',
    b"{'model': 'x'}",
    b'{"model": "x",}',
    b'{"model": "x"} trailing',
    b"\xef\xbb\xbf{}",
    b'{"a": NaN}',
    b"\xff\xfe\x00{",
    b'{"model": "\xc3\x28"}',
    b'{"model": "x" /* c */}',
    b"\x00" * 64,
)
"""Bodies that are not JSON, or not an object, or not UTF-8."""
_ROUTE_BODIES: dict[str, st.SearchStrategy[Any]] = {
    "/v1/chat/completions": CHAT_BODIES,
    "/v1/completions": COMPLETION_BODIES,
    "/v1/responses": RESPONSE_BODIES,
    "/v1/messages": MESSAGES_BODIES,
    "/v1/messages/count_tokens": COUNT_TOKENS_BODIES,
}
_TOKEN_CHARS = string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~"
METHODS = st.one_of(
    st.sampled_from(["POST"] * 6 + ["GET"] * 3 + ["PUT", "DELETE", "HEAD", "OPTIONS", "TRACE"]),
    st.sampled_from(["CONNECT", "PRI", "post", "G E T", "", "X" * 300, "GET\x00", "PATCH"]),
    st.text(alphabet=_TOKEN_CHARS, min_size=1, max_size=10),
)
"""Request methods: mostly the routes' own, then odd and unknown ones."""
VERSIONS = st.sampled_from(
    ["HTTP/1.1"] * 6 + ["HTTP/1.0", "HTTP/1.0", "HTTP/2.0", "HTTP/0.9", "HTTP/1.1x", "http/1.1",
                        "HTTP/1", "", "HTTP/9.9"]
)  # fmt: skip
HEADER_ABUSE = st.one_of(
    st.sampled_from(
        [
            b"X-Ctl: a\x00b",
            b"X-Ctl: a\x01b",
            b"X-Ctl: a\x7fb",
            b"X-Ctl: a\rb",
            b"X-Ctl: a\nb",
            b"X-Fold: a\r\n  folded",
            b"X-Inject: a\r\nX-Injected: 1",
            b"Bad Name: x",
            b": empty-name",
            b"(a): x",
            b"NoColon",
            b"X-Latin: \xe9\xff",
            b"X-Utf8: \xc3\xa9\xf0\x9f\xa6\x80",
            b"Host: a\r\nHost: b",
            b"Host:",
            b"Expect: 100-continue",
            b"Expect: 999-nope",
            b"Upgrade: h2c\r\nConnection: Upgrade, HTTP2-Settings\r\nHTTP2-Settings: AAMAAABkAAQ",
            b"Upgrade: websocket\r\nConnection: Upgrade",
            b"Connection: close",
            b"Connection: keep-alive",
            b"Content-Type: application/json; charset=latin-1",
            b"Content-Encoding: gzip",
            b"X-Session-Id: \x00\xff",
            b"X-Ownerserve-Policy: static-pd",
            b"X-Ownerserve-Policy:  static-pd \t",
            b"Authorization: Bearer \x00",
            b"X-Admin-Token: " + ADMIN_TOKEN.encode() + b"\x00",
            b"Transfer-Encoding: identity",
        ]
    ),
    st.builds(lambda n: b"X-Big: " + b"a" * n, st.integers(1000, 70_000)),
    st.builds(lambda n: b"\r\n".join(b"X-%d: v" % i for i in range(n)), st.integers(90, 130)),
    st.binary(min_size=1, max_size=30).map(lambda b: b"X-Bin: " + b),
)
"""Header lines that are odd or broken: control characters, folding, injection, bad names,
non-ASCII, upgrades, too large or too many (431)."""
FRAMINGS = (
    "length",
    "length",
    "length",
    "none",
    "chunked",
    "chunked",
    "chunked_bad_size",
    "chunked_no_crlf",
    "chunked_ext",
    "chunked_truncated",
    "length_short",
    "length_long",
    "length_odd",
    "length_dup_same",
    "length_dup_diff",
    "te_and_cl",
    "te_unknown",
    "te_twice",
    "length_huge",
)
"""How a raw case frames its body; `length_long` and `chunked_truncated` leave the request
unfinished (the case is then incomplete)."""


def _chunked(body: bytes, sizes: Sequence[int]) -> bytes:
    out = []
    i = 0
    for n in sizes:
        if i >= len(body):
            break
        piece = body[i : i + max(n, 1)]
        out.append(b"%x\r\n%s\r\n" % (len(piece), piece))
        i += len(piece)
    if i < len(body):
        out.append(b"%x\r\n%s\r\n" % (len(body) - i, body[i:]))
    out.append(b"0\r\n\r\n")
    return b"".join(out)


def frame(framing: str, body: bytes, sizes: Sequence[int]) -> tuple[list[bytes], bytes, bool]:
    """(header lines, body bytes as sent, whether the request is complete) for `framing`."""
    n = len(body)
    if framing == "length":
        return [b"Content-Length: %d" % n], body, True
    if framing == "none":
        return [], body, True
    if framing == "chunked":
        return [b"Transfer-Encoding: chunked"], _chunked(body, sizes), True
    if framing == "chunked_bad_size":
        return [b"Transfer-Encoding: chunked"], b"zz\r\n" + body + b"\r\n0\r\n\r\n", True
    if framing == "chunked_no_crlf":
        return [b"Transfer-Encoding: chunked"], b"%x\r\n%s0\r\n\r\n" % (n, body), True
    if framing == "chunked_ext":
        return (
            [b"Transfer-Encoding: chunked"],
            b"%x;name=value;x\r\n%s\r\n0\r\nX-Trailer: 1\r\n\r\n" % (n, body),
            True,
        )
    if framing == "chunked_truncated":
        return [b"Transfer-Encoding: chunked"], b"%x\r\n%s" % (n + 10, body), False
    if framing == "length_short":
        return [b"Content-Length: %d" % (n // 2)], body, True
    if framing == "length_long":
        return [b"Content-Length: %d" % (n + 10)], body, False
    if framing == "length_odd":
        odd = [b"+%d", b" %d ", b"%d, %d", b"0x%x", b"%d.0", b"-%d", b"%dabc", b"\xef\xbc\x95"]
        pattern = odd[sizes[0] % len(odd)] if sizes else odd[0]
        value = (
            pattern % ((n, n) if pattern.count(b"%") == 2 else (n,)) if b"%" in pattern else pattern
        )
        return [b"Content-Length: " + value], body, True
    if framing == "length_dup_same":
        return [b"Content-Length: %d" % n, b"Content-Length: %d" % n], body, True
    if framing == "length_dup_diff":
        return [b"Content-Length: %d" % n, b"Content-Length: %d" % (n + 7)], body, True
    if framing == "te_and_cl":
        return (
            [b"Content-Length: %d" % n, b"Transfer-Encoding: chunked"],
            _chunked(body, sizes),
            True,
        )
    if framing == "te_unknown":
        return [b"Transfer-Encoding: gzip"], body, True
    if framing == "te_twice":
        return (
            [b"Transfer-Encoding: chunked", b"Transfer-Encoding: chunked"],
            _chunked(body, sizes),
            True,
        )
    if framing == "length_huge":
        return [b"Content-Length: %d" % (10**12)], body, True
    raise ValueError(framing)


@st.composite
def raw_requests(draw: st.DrawFn) -> Case:
    """One request as bytes, broken somewhere (or not): method, target, version, headers,
    framing and body each drawn on their own; sometimes a valid request pipelined after it."""
    method = draw(METHODS)
    routes = st.sampled_from(ROUTE_PATHS)
    target = draw(st.one_of(routes, routes, routes, st.sampled_from(ODD_TARGETS)))
    version = draw(VERSIONS)
    path = target.split("?", 1)[0]
    route_bodies = _ROUTE_BODIES.get(path)
    choices: list[st.SearchStrategy[bytes]] = [
        st.just(b""),
        st.sampled_from(_BAD_JSON),
        st.binary(max_size=200),
    ]
    if route_bodies is not None:
        valid = st.builds(encode, mutated(route_bodies), st.booleans())
        choices += [valid, valid]
    body = draw(st.one_of(choices))
    framing = draw(st.sampled_from(FRAMINGS))
    sizes = draw(st.lists(st.integers(1, 64), min_size=1, max_size=4))
    framing_lines, sent, complete = frame(framing, body, sizes)
    lines = [b"Host: fuzz", *framing_lines]
    lines += draw(st.lists(HEADER_ABUSE, max_size=2))
    draw(st.randoms()).shuffle(lines)
    line_end = draw(st.sampled_from([b"\r\n"] * 9 + [b"\n"]))
    head = f"{method} {target} {version}".rstrip().encode("utf-8", "surrogatepass")
    data = line_end.join([head, *lines]) + line_end + line_end + sent
    if complete and draw(st.integers(0, 5)) == 0:
        data += b"GET /v1/models HTTP/1.1\r\nHost: fuzz\r\n\r\n"
    pieces = tuple(sorted(set(draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=3)))))
    return Case("raw", raw=data, complete=complete, pieces=pieces, shape=None)


# --- every route ----------------------------------------------------------------------------------


def body_cases() -> st.SearchStrategy[Case]:
    """Cases sent with httpx: every route's body, valid or mutated, with client headers."""
    return st.one_of(
        _body_case("chat", "/v1/chat/completions", OPENAI, CHAT_BODIES),
        _body_case("completions", "/v1/completions", OPENAI, COMPLETION_BODIES),
        _body_case("responses", "/v1/responses", OPENAI, RESPONSE_BODIES),
        _body_case("messages", "/v1/messages", ANTHROPIC, MESSAGES_BODIES),
        _body_case("count_tokens", "/v1/messages/count_tokens", ANTHROPIC, COUNT_TOKENS_BODIES),
        _responses_id_case(),
        _simple_get("models", "/v1/models"),
        _simple_get("health", "/health"),
        _simple_get("metrics", "/metrics"),
        _admin_case(),
    )


def raw_cases() -> st.SearchStrategy[Case]:
    """Cases sent as bytes over a socket: HTTP broken at the byte level."""
    return raw_requests()


def all_cases() -> st.SearchStrategy[Case]:
    """Every kind of case: one in four byte-level."""
    body = body_cases()
    return st.one_of(body, body, body, raw_cases())


ROUTES: tuple[str, ...] = (
    "chat",
    "completions",
    "responses",
    "messages",
    "count_tokens",
    "responses/{id}",
    "models",
    "health",
    "metrics",
    "admin",
    "raw",
)
"""Every `Case.route` the strategies make."""
