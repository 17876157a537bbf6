"""Which agent session a request belongs to, with or without the client's cooperation.

Explicit keys win, in this order (sources for each agent framework's header):
- `x-session-id`: generic; also sent by OpenCode >= 1.17 (BYK/loreai PR #687).
- `x-claude-code-session-id`: Claude Code >= 2.1.86 sends one UUID per session
  (coder/aibridge PR #241); older versions put it in `metadata.user_id`
  (`user_<sha>_account_<id>_session_<uuid>`, later a JSON string with `session_id`).
- `session-id` / `session_id`: the Codex CLI (modern hyphen / legacy underscore form;
  KarpelesLab/teamclaude PR #352, router-for-me/CLIProxyAPI issue #4452); `conversation_id`
  / `x-codex-session-id` likewise.
- `x-opencode-session`, `x-session-affinity`: OpenCode (anomalyco/opencode PR #31511 via
  BYK/loreai PR #687; raine/claude-code-proxy PR #138).
- the OpenAI `user` field, then `prompt_cache_key`.

A subagent is a session of its own inside its parent's program (`SessionKey.parent`), so its
turns are tracked apart from its parent's while admission counts it as part of a program
under way:
- Claude Code >= 2.1.258 reuses the parent's `x-claude-code-session-id` on a subagent's
  requests and adds `x-claude-code-agent-id` (and `x-claude-code-parent-agent-id` when the
  parent is itself a subagent; BYK/loreai PR #1701, preloop/preloop PR #701): the subagent's
  session is `<session id>/<agent id>`, its parent `<session id>/<parent agent id>` or the
  main agent's `<session id>`.
- OpenCode gives a subagent its own `x-session-id` and names the spawning session in
  `x-parent-session-id` (anomalyco/opencode PR #12932, BYK/loreai PR #1309); so may any client.

Otherwise the session is derived from the conversation itself: a hash of its stable prefix
(the system prompt and the first user turn; for raw completions, the first blocks of the
prompt's hash chain), so an unkeyed multi-turn session still sticks to its owner.

`SessionTable` is what the router remembers of each recent session between its turns.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from hashlib import blake2b
from typing import Any

import orjson
from xxhash import xxh3_128

from ownerserve.records import fast_init

SESSION_HEADERS: tuple[str, ...] = (
    "x-session-id",
    "x-claude-code-session-id",
    "session-id",
    "session_id",
    "x-codex-session-id",
    "conversation_id",
    "x-opencode-session",
    "x-session-affinity",
)
"""Lower-case header names carrying a client's session id, highest priority first."""

CLAUDE_SESSION_HEADER = "x-claude-code-session-id"
CLAUDE_AGENT_HEADER = "x-claude-code-agent-id"
CLAUDE_PARENT_AGENT_HEADER = "x-claude-code-parent-agent-id"
PARENT_SESSION_HEADER = "x-parent-session-id"

MAX_SESSION_ID_LEN = 256
DERIVED_PREFIX_BLOCKS = 64
"""A derived completion session hashes at most this many leading blocks of the prompt."""


class SessionSource(StrEnum):
    HEADER = "header"
    USER = "user"
    METADATA = "metadata"
    PROMPT_CACHE_KEY = "prompt_cache_key"
    DERIVED = "derived"
    NONE = "none"


@fast_init
@dataclass(frozen=True, slots=True)
class SessionKey:
    """A session id and where it came from."""

    session_id: str | None
    source: SessionSource
    parent: str | None = None
    """The session whose program this one belongs to (the agent that spawned it), when the
    client says so; None for a main agent."""

    @property
    def explicit(self) -> bool:
        return self.source not in (SessionSource.DERIVED, SessionSource.NONE)


def _clean(value: object) -> str | None:
    if not isinstance(value, str):
        return None
    value = value.strip()
    if not value or len(value) > MAX_SESSION_ID_LEN:
        return None
    return value


def _claude_metadata_session(body: Mapping[str, Any]) -> str | None:
    meta = body.get("metadata")
    if not isinstance(meta, Mapping):
        return None
    user_id = meta.get("user_id")
    if not isinstance(user_id, str):
        return None
    if user_id.startswith("{"):
        try:
            parsed = orjson.loads(user_id)
        except orjson.JSONDecodeError:
            return None
        return _clean(parsed.get("session_id")) if isinstance(parsed, dict) else None
    _, sep, tail = user_id.rpartition("_session_")
    return _clean(tail) if sep else None


def derived_session_id(model: str, stable_prefix: bytes) -> str:
    """The session id of a conversation without explicit key: a hash of its stable prefix."""
    h = blake2b(model.encode(), digest_size=12)
    h.update(b"\0")
    h.update(stable_prefix)
    return "auto-" + h.hexdigest()


def stable_chat_prefix(messages: Sequence[Mapping[str, Any]]) -> bytes:
    """System/developer messages and the first user turn: what every later turn repeats."""
    parts: list[Any] = []
    for m in messages:
        parts.append(m)
        if m.get("role") == "user":
            break
    return orjson.dumps(parts, option=orjson.OPT_SORT_KEYS)


def _frame(h: xxh3_128, data: bytes) -> None:
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)


def _prefix_key(model: str, messages: Sequence[Mapping[str, Any]]) -> int:
    """A digest of the stable prefix (XXH3-128), cheap to build (no serialization for plain
    text messages). Not the prefix itself: a key that held its strings kept a session's whole
    system prompt and first turn, KBs to MBs, alive in the cache (65,536 of them)."""
    h = xxh3_128()
    _frame(h, model.encode())
    for m in messages:
        content = m.get("content")
        if len(m) == 2 and isinstance(content, str):
            h.update(b"t")
            _frame(h, str(m.get("role")).encode())
            _frame(h, content.encode(errors="surrogatepass"))
        else:
            h.update(b"j")
            _frame(h, orjson.dumps(m, option=orjson.OPT_SORT_KEYS))
        if m.get("role") == "user":
            break
    return h.intdigest()


class DerivedSessionCache:
    """Derived session ids by a digest of the stable prefix, so later turns skip serializing
    and hashing it with BLAKE2b; at most `capacity` of them (~0.2 KB each), oldest first out."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._ids: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def session_id(self, model: str, messages: Sequence[Mapping[str, Any]]) -> str:
        key = _prefix_key(model, messages)
        sid = self._ids.get(key)
        if sid is None:
            sid = derived_session_id(model, stable_chat_prefix(messages))
            if len(self._ids) >= self.capacity:
                self._ids.pop(next(iter(self._ids)))
            self._ids[key] = sid
        return sid


def identify_session(
    headers: Mapping[str, str],
    body: Mapping[str, Any],
    model: str,
    messages: Sequence[Mapping[str, Any]] | None,
    chain: Sequence[int] = (),
    derived: DerivedSessionCache | None = None,
) -> SessionKey:
    """The request's session: explicit key if the client offers one, else derived; a
    subagent's is its own, with its parent's (`SessionKey.parent`)."""
    for name in SESSION_HEADERS:
        sid = _clean(headers.get(name))
        if sid is not None:
            if name == CLAUDE_SESSION_HEADER:
                agent = _clean(headers.get(CLAUDE_AGENT_HEADER))
                if agent is not None:
                    parent_agent = _clean(headers.get(CLAUDE_PARENT_AGENT_HEADER))
                    spawner = sid if parent_agent is None else f"{sid}/{parent_agent}"
                    return SessionKey(f"{sid}/{agent}", SessionSource.HEADER, spawner)
            parent = _clean(headers.get(PARENT_SESSION_HEADER))
            return SessionKey(sid, SessionSource.HEADER, parent if parent != sid else None)
    sid = _clean(body.get("user"))
    if sid is not None:
        return SessionKey(sid, SessionSource.USER)
    sid = _claude_metadata_session(body)
    if sid is not None:
        return SessionKey(sid, SessionSource.METADATA)
    sid = _clean(body.get("prompt_cache_key"))
    if sid is not None:
        return SessionKey(sid, SessionSource.PROMPT_CACHE_KEY)
    if messages:
        if derived is not None:
            return SessionKey(derived.session_id(model, messages), SessionSource.DERIVED)
        return SessionKey(
            derived_session_id(model, stable_chat_prefix(messages)), SessionSource.DERIVED
        )
    return chain_session(model, chain)


NO_SESSION = SessionKey(None, SessionSource.NONE)


def chain_session(model: str, chain: Sequence[int]) -> SessionKey:
    """The derived session of a raw completion prompt without explicit key: a hash of the
    first blocks of its chain (no session for a prompt shorter than a block)."""
    if not chain:
        return NO_SESSION
    anchor = chain[min(len(chain), DERIVED_PREFIX_BLOCKS) - 1]
    return SessionKey(
        derived_session_id(model, anchor.to_bytes(8, "little")), SessionSource.DERIVED
    )


@dataclass(slots=True)
class SessionInfo:
    """What the router remembers of one session between its requests."""

    last_seen: float
    inflight: int = 0
    prompt_tokens: int = 0
    committed_at: float = -1e18
    """When the directory records of this session were last written in full."""
    attained_tokens: int = 0
    """Service the session has had: prompt and output tokens of its answered requests (what
    admission releases its queue by, least first)."""


class SessionTable:
    """The most recent sessions' `SessionInfo`, least recently seen dropped first."""

    __slots__ = ("_capacity", "_infos")

    def __init__(self, capacity: int = 65536) -> None:
        self._capacity = capacity
        self._infos: OrderedDict[str, SessionInfo] = OrderedDict()

    def get(self, session_id: str | None) -> SessionInfo | None:
        return self._infos.get(session_id) if session_id else None

    def attained(self, session_id: str | None) -> int:
        """The session's attained service in tokens (0 for none, or one forgotten)."""
        info = self._infos.get(session_id) if session_id else None
        return 0 if info is None else info.attained_tokens

    def in_flight(self) -> dict[str, int]:
        """The sessions with requests in flight now, and how many each has (`inflight`)."""
        return {sid: info.inflight for sid, info in self._infos.items() if info.inflight}

    def touch(self, session_id: str, prompt_tokens: int) -> SessionInfo:
        """The session was seen now with a prompt of `prompt_tokens`."""
        infos = self._infos
        info = infos.get(session_id)
        now = time.monotonic()
        if info is None:
            info = infos[session_id] = SessionInfo(last_seen=now)
            if len(infos) > self._capacity:
                infos.popitem(last=False)
        else:
            infos.move_to_end(session_id)
        info.last_seen = now
        info.prompt_tokens = prompt_tokens
        return info
