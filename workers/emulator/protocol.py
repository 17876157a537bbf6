"""The OpenAI wire format of the emulated engine: request validation and response shapes.

Requests are validated with pydantic at this boundary (unknown fields are accepted, as vLLM
does); a validation problem becomes an `InvalidRequestError` naming the field. Responses and
stream chunks are plain dicts serialised with orjson, shaped as vLLM shapes them (usage with
`prompt_tokens_details.cached_tokens`, `kv_transfer_params` on P/D prefill answers).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ownerserve.errors import InvalidRequestError


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Common(BaseModel):
    """Fields shared by chat and text completions (OpenAI plus vLLM/SGLang extensions)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=128)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    seed: int | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    user: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
    bootstrap_room: int | None = Field(default=None, ge=0)


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """vLLM's and SGLang's: the prompt ends inside the final (assistant) message, which the
    model continues, instead of opening a new one (`open_final_message`)."""
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None


def _describe(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    msg = str(err["msg"])
    return f"{loc}: {msg}" if loc else msg


def parse_chat(body: dict[str, Any]) -> ChatCompletionRequest:
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise InvalidRequestError(_describe(exc)) from None
    if req.continue_final_message and req.add_generation_prompt:
        # vLLM's own check (its ChatCompletionRequest), word for word
        raise InvalidRequestError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    return req


def open_final_message(rendered: str, final: dict[str, Any]) -> str:
    """The rendered chat cut right after the final message's content, so that the model
    continues that message (`continue_final_message`): as transformers'
    `apply_chat_template` does it for vLLM, up to the content's last occurrence, or to its
    stripped text's where the template trims messages (Llama 3's does)."""
    content = final.get("content")
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        content = texts[-1] if texts else None
    if not isinstance(content, str):
        raise InvalidRequestError("continue_final_message: the final message has no text")
    for piece in (content, content.strip()):
        at = rendered.rfind(piece)
        if at >= 0:
            return rendered[: at + len(piece)]
    raise InvalidRequestError(
        "continue_final_message is set but the final message does not appear in the chat "
        "after applying the chat template"
    )


def parse_completion(body: dict[str, Any]) -> CompletionRequest:
    try:
        return CompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise InvalidRequestError(_describe(exc)) from None


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    return tuple(s for s in stop if s)


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts: one string, a list of strings, token ids, or lists of ids."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise InvalidRequestError("prompt: must not be empty")
    if all(isinstance(x, int) for x in p):
        return [[x for x in p if isinstance(x, int)]]
    out: list[str | list[int]] = []
    for x in p:
        if isinstance(x, int):
            raise InvalidRequestError("prompt: mixes token ids and lists")
        out.append(x)
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def token_logprob(token_id: int, piece: str) -> float:
    """A deterministic, plausible log-probability for an emitted token."""
    return -((token_id * 2654435761) % 1000) / 1000.0


def chat_logprobs(ids: list[int], pieces: list[str], top: int) -> dict[str, Any]:
    content = []
    for tid, piece in zip(ids, pieces, strict=False):
        lp = token_logprob(tid, piece)
        entry: dict[str, Any] = {
            "token": piece,
            "logprob": lp,
            "bytes": list(piece.encode()),
            "top_logprobs": [],
        }
        if top:
            alts = [{"token": piece, "logprob": lp, "bytes": list(piece.encode())}]
            for k in range(1, top):
                alts.append({"token": f"<{tid + k}>", "logprob": lp - k, "bytes": None})
            entry["top_logprobs"] = alts
        content.append(entry)
    return {"content": content}


def completion_logprobs(
    ids: list[int], pieces: list[str], top: int, text_offset: int
) -> dict[str, Any]:
    tokens, lps, tops, offsets = [], [], [], []
    off = text_offset
    for tid, piece in zip(ids, pieces, strict=False):
        lp = token_logprob(tid, piece)
        tokens.append(piece)
        lps.append(lp)
        alts = {piece: lp}
        for k in range(1, top):
            alts[f"<{tid + k}>"] = lp - k
        tops.append(alts if top else None)
        offsets.append(off)
        off += len(piece)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
