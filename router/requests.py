"""The client's request as the router needs it: parsed once with orjson, validated only in what
routing needs (model, messages or prompt, stream, max_tokens, n); every other field passes
through to the worker untouched."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ownerserve.errors import InvalidRequestError
from ownerserve.http import json_object
from ownerserve.records import fast_init

DEFAULT_MAX_TOKENS = 256


class Endpoint(StrEnum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"


@fast_init
@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """One OpenAI completion request: the original bytes and their parsed dict."""

    endpoint: Endpoint
    raw: bytes
    body: dict[str, Any]
    model: str
    stream: bool
    max_tokens: int
    n: int
    user: str | None

    @property
    def messages(self) -> list[Mapping[str, Any]]:
        msgs = self.body.get("messages")
        return msgs if isinstance(msgs, list) else []


def _opt_int(body: Mapping[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"'{key}' must be an integer", param=key)
    if value < minimum:
        raise InvalidRequestError(f"'{key}' must be >= {minimum}, got {value}", param=key)
    return value


def parse_request(raw: bytes, endpoint: Endpoint) -> CompletionRequest:
    """Parse and validate what routing needs; raise `InvalidRequestError` (400) otherwise."""
    body = json_object(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequestError("'model' is required and must be a string", param="model")
    if endpoint is Endpoint.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("'messages' must be a non-empty array", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise InvalidRequestError(
                    f"messages[{i}] must be an object with a 'role'", param="messages"
                )
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str | list) or (isinstance(prompt, list) and not prompt):
            raise InvalidRequestError(
                "'prompt' must be a string or a non-empty array", param="prompt"
            )
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequestError("'stream' must be a boolean", param="stream")
    max_tokens = _opt_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", 1)
    n = _opt_int(body, "n", 1) or 1
    user = body.get("user")
    return CompletionRequest(
        endpoint=endpoint,
        raw=raw,
        body=body,
        model=model,
        stream=stream,
        max_tokens=max_tokens if max_tokens is not None else DEFAULT_MAX_TOKENS,
        n=n,
        user=user if isinstance(user, str) and user else None,
    )
