"""The client's request as the router needs it: parsed once with orjson, validated only in what
routing needs (model, messages or prompt, stream, max_tokens, n); every other field passes
through to the worker untouched, except the control-plane fields (`CONTROL_FIELDS`,
`CONTROL_PREFIXES`): those steer KV between engines, and only the router sets them
(`router/backends`, `router/executor.py`, the chunk layout of `router/pipeline.py`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson

from ownerserve.chunks import PARAMS_KEY as CHUNK_PARAMS_KEY
from ownerserve.errors import InvalidRequestError
from ownerserve.http import json_object
from ownerserve.records import fast_init

DEFAULT_MAX_TOKENS = 256

CONTROL_FIELDS = frozenset(
    {"kv_transfer_params", "data_parallel_rank", "decode_tp_size", "request_id", "rid"}
)
"""Body fields that say where an engine sends or takes KV, which engine rank serves, or under
which id the engine runs the request: vLLM's P/D `kv_transfer_params` (a decode side pulls from
its `remote_host`/`remote_port`; its `ownerserve` key carries the router's chunk layout and
chunk-save orders), SGLang's `data_parallel_rank` and `decode_tp_size`, and the engine request
ids (vLLM's `request_id`, SGLang's `rid`: a P/D hand-over names the prefill's request by its id,
so a client's id chosen to match another request's could reach that request's KV). A client's
are removed (`parse_request`)."""
CONTROL_PREFIXES = ("bootstrap_", "disagg_")
"""Prefixes of the same: SGLang's P/D rendezvous (`bootstrap_host`, `bootstrap_port`,
`bootstrap_room`, `bootstrap_pair_key`: a decode side pulls from the host and port named)
and its `disagg_*` routing fields (`disagg_prefill_dp_rank`)."""
_INITIALS = "".join(sorted({name[0] for name in (*CONTROL_FIELDS, *CONTROL_PREFIXES)}))
_OPT_OUTS = ("load", "save")
"""`kv_transfer_params.ownerserve.load`/`save`: false keeps the vLLM connector from loading or
saving this request's KV in the worker's own sidecar (`workers/vllm_connector`). A client's
`false` is kept: it only takes KV movement away, and names no peer, key or layout."""


class Endpoint(StrEnum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"


@fast_init
@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """One OpenAI completion request: the bytes the workers get and their parsed dict (the
    client's own bytes, unless `parse_request` removed a control-plane field from them)."""

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


def is_control_field(key: str) -> bool:
    """Whether a body field is the router's to set (`CONTROL_FIELDS`, `CONTROL_PREFIXES`)."""
    return key in CONTROL_FIELDS or key.startswith(CONTROL_PREFIXES)


def _kept_opt_outs(value: Any) -> dict[str, Any] | None:
    """What stays of a client's `kv_transfer_params`: its connector opt-outs (`_OPT_OUTS` set to
    false) under the `ownerserve` key, or None when it has none."""
    ours = value.get(CHUNK_PARAMS_KEY) if isinstance(value, dict) else None
    if not isinstance(ours, dict):
        return None
    kept = {k: False for k in _OPT_OUTS if ours.get(k) is False}
    return {CHUNK_PARAMS_KEY: kept} if kept else None


def without_control_fields(body: dict[str, Any]) -> dict[str, Any] | None:
    """`body` without its control-plane fields (a client's `kv_transfer_params` keeps only its
    opt-outs), or None when it has none: the common case costs one pass over the keys."""
    for key in body:  # inline, first letter first: the hot path's keys pass in ~0.1 us each
        if key[:1] in _INITIALS and (key in CONTROL_FIELDS or key.startswith(CONTROL_PREFIXES)):
            break
    else:
        return None
    out = {k: v for k, v in body.items() if not is_control_field(k)}
    kept = _kept_opt_outs(body.get("kv_transfer_params"))
    if kept is not None:
        out["kv_transfer_params"] = kept
    return out


def parse_request(raw: bytes, endpoint: Endpoint) -> CompletionRequest:
    """Parse and validate what routing needs; raise `InvalidRequestError` (400) otherwise.
    A client's control-plane fields are removed first (`without_control_fields`): its `raw`
    bytes are kept only when it had none."""
    body = json_object(raw)
    stripped = without_control_fields(body)
    if stripped is not None:
        body = stripped
        raw = orjson.dumps(body)
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
