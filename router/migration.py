"""Mid-stream migration: what it takes to continue a streamed answer on another worker after its
worker died or stalled mid-stream, so that the client sees one unbroken answer.

Off the hot path but for `Transcript.keep`: a migratable stream's bytes are kept as they are
relayed (whole events only reach the client: a continuation cannot finish half an event), and
parsed only when its worker fails (`Transcript.partial`), or when they grow past
`KEEP_BYTES` (then parsed into text so far, which bounds a long stream's memory).

The continuation is the original request with the answer so far as its prompt's end
(`continuation`): for chat, the partial assistant message with `continue_final_message: true`
and `add_generation_prompt: false`, which vLLM (`ChatCompletionRequest`, rendered by
transformers' `apply_chat_template`), SGLang (`continue_final_message`) and the emulated engine
take; for completions, the prompt (text, or token ids with the answer's text tokenized) followed
by the answer's text. Chosen over re-sending chat as `/v1/completions` on the router's own
token ids: the continuation's answer is then the engine's own chat stream — its logprobs,
`finish_reason`/`stop_reason`, reasoning and tool parsers, and whatever the chat serializer
adds — and `Splice` only gives its chunks the first half's `id`/`created`/`model`, drops its
repeated role chunk and adds the halves' usage up; a translation from completion chunks would
have to redo all of that and drift from each engine's chat route. Either way the prompt's prefix
is the original's, so the new worker's prefix cache (or the KV the planner moves) serves it.

What cannot continue: a constrained answer (guided decoding, structured outputs, a forced tool
call: the grammar's state at the cut does not carry over, and engines constrain only what they
generate) or one of several choices (`n > 1`, several prompts), from the request alone
(`unmigratable`); and an answer whose text so far cannot be resent as plain text (a tool call
or reasoning under way, an error event of the worker's own: `Partial.why_not`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from router.requests import CompletionRequest, Endpoint

OUTCOMES = ("migrated", "refused_guided", "refused_partial", "refused_limit", "failed")
"""`ownerserve_migrations_total{outcome}` for a stream whose worker failed mid-stream: continued
on another worker; not continued because of what the request asks (`unmigratable`), because of
what the client has so far (`Partial.why_not`), because its `server.max_migrations` were
spent; or no worker could take it over (then it ends with its error event)."""

KEEP_BYTES = 1 << 20
"""A migratable stream's relayed bytes kept unparsed up to this much (some 4,000 chat chunks);
beyond it they are parsed into its text so far, a batch at a time (about a microsecond a
chunk), which bounds a long stream's memory. A stream shorter than this is parsed only if its
worker fails."""

_GUIDED_FIELDS = frozenset(
    {
        # vLLM
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
        # SGLang
        "regex",
        "ebnf",
        "json_schema",
        "structural_tag",
    }
)
"""Body fields that constrain what the engine may generate."""

_HEAD_FIELDS = ("id", "created", "model", "system_fingerprint")
"""What every chunk of one answer repeats: the continuation's chunks get the first half's."""


def unmigratable(req: CompletionRequest) -> str | None:
    """Why a streamed answer to `req` cannot continue on another worker, from the request
    alone, in words for the client's error event; None when it can."""
    body = req.body
    best_of = body.get("best_of")
    if req.n > 1 or (isinstance(best_of, int) and best_of > 1):
        return "it asks for several choices"
    for key in body:  # a pass over the few keys a request has
        if key in _GUIDED_FIELDS and body[key]:
            return f"its output is constrained ({key})"
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return "its output is constrained (response_format)"
    choice = body.get("tool_choice")
    if body.get("tools") and (choice == "required" or isinstance(choice, dict)):
        return "it forces a tool call (tool_choice)"
    if req.endpoint is Endpoint.COMPLETIONS:
        if body.get("echo"):
            return "it echoes its prompt"
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
            return "it asks for several choices"
    return None


@dataclass(frozen=True, slots=True)
class Partial:
    """What the client has of a streamed answer (`Transcript.partial`)."""

    text: str
    """The answer's text so far (chat: its content deltas; completions: its text)."""
    head: Mapping[str, Any]
    """Its chunks' `id`, `created`, `model` and `system_fingerprint` (those it has)."""
    chat: bool
    finish_reason: str | None
    """Its finish reason, when its final chunk came: the answer is complete."""
    usage_sent: bool
    """A usage chunk came (the answer's last before `[DONE]`)."""
    done: bool
    """`[DONE]` came: the stream is complete."""
    why_not: str | None
    """Why it cannot be resent as plain text (a tool call or reasoning under way, several
    choices, the worker's own error event); None when it can."""


class _Reader:
    """Parses relayed SSE events into what `Partial` says, a batch of whole events at a time."""

    __slots__ = ("chat", "done", "finish", "head", "parts", "usage_sent", "why_not")

    def __init__(self) -> None:
        self.head: dict[str, Any] | None = None
        self.chat = True
        self.parts: list[str] = []
        self.finish: str | None = None
        self.usage_sent = False
        self.done = False
        self.why_not: str | None = None

    def feed(self, data: bytes) -> None:
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        payloads = [line[5:].strip() for line in data.split(b"\n") if line.startswith(b"data:")]
        if b"[DONE]" in payloads:
            self.done = True
            payloads = [p for p in payloads if p != b"[DONE]"]
        try:  # one parse for the batch; event by event only when one is malformed
            events = orjson.loads(b"[" + b",".join(payloads) + b"]")
        except orjson.JSONDecodeError:
            events = []
            for payload in payloads:
                try:
                    events.append(orjson.loads(payload))
                except orjson.JSONDecodeError:
                    continue
        for event in events:
            if isinstance(event, dict):
                self._event(event)

    def _event(self, event: dict[str, Any]) -> None:
        if "error" in event:
            self.why_not = "the worker's own error event reached the client"
            return
        if self.head is None:
            self.head = {k: event[k] for k in _HEAD_FIELDS if k in event}
            self.chat = event.get("object") != "text_completion"
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if choice.get("index", 0) != 0:
                self.why_not = "it has several choices"
            delta = choice.get("delta")
            if isinstance(delta, dict):
                content = delta.get("content")
                if isinstance(content, str):
                    self.parts.append(content)
                if delta.get("tool_calls"):
                    self.why_not = "a tool call was under way"
                if delta.get("reasoning_content") or delta.get("reasoning"):
                    self.why_not = "its reasoning was under way"
            text = choice.get("text")
            if isinstance(text, str):
                self.parts.append(text)
            finish = choice.get("finish_reason")
            if isinstance(finish, str):
                self.finish = finish
        if isinstance(event.get("usage"), dict) and not event.get("choices"):
            self.usage_sent = True

    def partial(self) -> Partial:
        text = "".join(self.parts)
        self.parts = [text]
        return Partial(
            text,
            self.head or {},
            self.chat,
            self.finish,
            self.usage_sent,
            self.done,
            self.why_not,
        )


def _events_end(data: bytes) -> int:
    """The offset just past the last whole SSE event in `data` (0: none ends there)."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


class Transcript:
    """What the client got of a migratable stream: every byte relayed, in whole events."""

    __slots__ = ("_kept", "_read", "_size", "_tail")

    def __init__(self) -> None:
        self._kept: list[bytes] = []
        self._size = 0
        self._tail = b""
        """The start of an event whose end has not arrived: held back from the client."""
        self._read = _Reader()

    def keep(self, data: bytes) -> bytes:
        """The next bytes of the stream as far as they end whole events: what the client may
        get now (kept here too); the rest is held back until the bytes that complete it
        come, so that a worker failing mid-event leaves the client nothing half-sent."""
        if self._tail or not data.endswith(b"\n\n"):
            data = self._tail + data
            end = _events_end(data)
            self._tail = data[end:]
            data = data[:end]
            if not data:
                return data
        self._kept.append(data)
        self._size += len(data)
        if self._size > KEEP_BYTES:
            self._parse()
        return data

    def flush(self) -> bytes:
        """At the stream's end: what was held back (the end of a stream that does not end in a
        blank line), for the client as it came."""
        tail, self._tail = self._tail, b""
        return tail

    def partial(self) -> Partial:
        """What the client has so far (the bytes held back are not the client's)."""
        self._parse()
        return self._read.partial()

    def _parse(self) -> None:
        if self._kept:
            self._read.feed(b"".join(self._kept))
            self._kept.clear()
            self._size = 0


def continuation(
    req: CompletionRequest,
    text: str,
    generated: int,
    encode: Callable[[str], Sequence[int]],
) -> CompletionRequest | None:
    """The request that continues an answer to `req` after `text` (`generated` tokens, as
    `encode` counts them): its body with `text` at its prompt's end (the module docstring),
    `max_tokens`/`max_completion_tokens` and `min_tokens` less what was generated, every
    sampling setting as the client sent it (temperature, top_p, seed, stop, logprobs...),
    and no `echo` or prompt logprobs (the client has them). None when nothing is left to
    generate (its token limit was reached)."""
    body = dict(req.body)
    for key in ("max_completion_tokens", "max_tokens"):
        limit = body.get(key)
        if isinstance(limit, int) and not isinstance(limit, bool):
            if limit - generated < 1:
                return None
            body[key] = limit - generated
    least = body.get("min_tokens")
    if isinstance(least, int) and not isinstance(least, bool) and least > 0:
        body["min_tokens"] = max(0, least - generated)
    body.pop("echo", None)
    body.pop("prompt_logprobs", None)
    if text and req.endpoint is Endpoint.CHAT:
        body["messages"] = _continued_messages(req, text)
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    elif text:
        body["prompt"] = _continued_prompt(body.get("prompt"), text, encode)
    # no text yet (the worker died before its first token): the same prompt again
    return CompletionRequest(
        endpoint=req.endpoint,
        raw=orjson.dumps(body),
        body=body,
        model=req.model,
        stream=True,
        max_tokens=max(1, req.max_tokens - generated),
        n=1,
        user=req.user,
    )


def _continued_messages(req: CompletionRequest, text: str) -> list[Any]:
    """The chat's messages with the partial assistant message last (a client's own
    `continue_final_message` already ends in one: `text` extends it)."""
    messages = list(req.messages)
    last = messages[-1] if messages else None
    if (
        req.body.get("continue_final_message")
        and isinstance(last, dict)
        and last.get("role") == "assistant"
    ):
        content = last.get("content")
        if isinstance(content, str):
            messages[-1] = {**last, "content": content + text}
        elif isinstance(content, list):
            messages[-1] = {**last, "content": [*content, {"type": "text", "text": text}]}
        else:
            messages[-1] = {**last, "content": text}
        return messages
    messages.append({"role": "assistant", "content": text})
    return messages


def _continued_prompt(prompt: Any, text: str, encode: Callable[[str], Sequence[int]]) -> Any:
    """A completion prompt (text, token ids, or one of either in a list) followed by `text`."""
    if isinstance(prompt, str):
        return prompt + text
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):
            return [*prompt, *encode(text)]
        if isinstance(first, str):
            return [first + text]
        if isinstance(first, list):
            return [[*first, *encode(text)]]
    return prompt


class Splice:
    """Turns a continuation's stream into the rest of the answer the client is getting: each
    chunk with the first half's `id`, `created`, `model` (and `system_fingerprint`), the
    continuation's role chunk dropped (the client has the role), its usage counted from the
    original prompt (`prompt_tokens`) and over both halves (`generated` tokens before it).
    Errors and `[DONE]` pass as they are."""

    __slots__ = ("_buf", "_generated", "_head", "_prompt_tokens", "events")

    def __init__(self, head: Mapping[str, Any], prompt_tokens: int, generated: int) -> None:
        self._head = head
        self._prompt_tokens = prompt_tokens
        self._generated = generated
        self._buf = b""
        self.events = 0
        """`data:` events passed to the client."""

    def feed(self, data: bytes) -> bytes:
        """The whole events `data` completes, rewritten (the rest waits for its end)."""
        buf = (self._buf + data).replace(b"\r\n", b"\n")
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return b""
        self._buf = buf[end + 2 :]
        return b"".join(self._event(e) for e in buf[:end].split(b"\n\n"))

    def flush(self) -> bytes:
        """At the continuation's end: an event it left without its blank line."""
        rest, self._buf = self._buf, b""
        return self._event(rest) if rest.strip() else b""

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data:") or b"\ndata:" in event:
            return event + b"\n\n" if event else b""  # comments, other fields: as they are
        payload = event[5:].strip()
        if payload == b"[DONE]":
            self.events += 1
            return b"data: [DONE]\n\n"
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            chunk = None
        if not isinstance(chunk, dict) or "error" in chunk:
            self.events += 1
            return event + b"\n\n"
        chunk.update(self._head)
        choices = chunk.get("choices")
        if isinstance(choices, list) and choices:
            kept = [c for c in choices if not _role_only(c)]
            if not kept:
                return b""
            chunk["choices"] = kept
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            chunk["usage"] = self.usage(usage)
        self.events += 1
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def usage(self, usage: Mapping[str, Any]) -> dict[str, Any]:
        """The continuation's usage as the whole answer's: the original prompt, and the
        completion tokens of both halves."""
        prompt = self._prompt_tokens
        done = usage.get("completion_tokens")
        completion = self._generated + (done if isinstance(done, int) else 0)
        out = {**usage, "prompt_tokens": prompt, "completion_tokens": completion}
        out["total_tokens"] = prompt + completion
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            out["prompt_tokens_details"] = {
                **details,
                "cached_tokens": min(details["cached_tokens"], prompt),
            }
        return out


def _role_only(choice: Any) -> bool:
    """A chat chunk's choice that only opens the assistant message (its role, empty content):
    a continuation's first, which the client had from the first half. Its role is dropped
    from any other."""
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    if not isinstance(delta, dict) or "role" not in delta:
        return False
    del delta["role"]
    return (
        not any(delta.values()) and not choice.get("finish_reason") and not choice.get("logprobs")
    )


def ending(partial: Partial, prompt_tokens: int, generated: int, include_usage: bool) -> bytes:
    """The end of an answer whose worker failed after its last token: its final chunk (a
    `length` stop when it never came), its usage chunk when the client asked for one
    (`stream_options.include_usage`) and it never came, and `[DONE]`."""
    head = dict(partial.head)
    head["object"] = "chat.completion.chunk" if partial.chat else "text_completion"
    chunks: list[dict[str, Any]] = []
    if partial.finish_reason is None:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length"}
        if partial.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        chunks.append({**head, "choices": [choice]})
    if include_usage and not partial.usage_sent:
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": generated,
            "total_tokens": prompt_tokens + generated,
        }
        chunks.append({**head, "choices": [], "usage": usage})
    out = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks)
    return out if partial.done else out + b"data: [DONE]\n\n"


def asks_usage(req: CompletionRequest) -> bool:
    """The client asked for the usage chunk (`stream_options.include_usage`)."""
    options = req.body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))
