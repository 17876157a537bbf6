"""In-flight counting: the one place the router's counters of requests in flight go up and
down — per worker, with the prompt tokens waiting for prefill (the planner's views show them
before the workers' own gauges catch up), per worker's KV working set (what admission
decides by, `router.admission`), and per session (what makes a request a fork)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from router.admission import output_tokens
from router.pool import WorkerState

if TYPE_CHECKING:
    from router.pipeline import RequestContext


def hold(
    ctx: RequestContext,
    workers: Sequence[WorkerState],
    prefill: WorkerState | None = None,
    kv: WorkerState | None = None,
) -> None:
    """Count the request in flight on `workers`, its prompt's tokens as queued prefill on
    `prefill` and as KV held on `kv` (the worker its sequence lives on), until
    `release(ctx)`. Its prompt counts in a working set too: sent for the plan's decode worker
    (`ctx.plan`) while the plan runs, then on the worker streaming the answer
    (`ctx.opened`)."""
    for w in workers:
        w.inflight += 1
    tokens = ctx.tok.prompt_tokens
    if prefill is not None:
        prefill.inflight_prefill_tokens += tokens
    if kv is not None:
        kv.inflight_kv_tokens += tokens
    ctx.held = workers
    ctx.held_prefill = prefill
    ctx.held_kv = kv
    admission = ctx.router.admission
    if admission.enabled:
        opened = ctx.opened
        if opened is None:
            ctx.charged = admission.sent(ctx.plan.chosen.decode_worker, tokens)
        else:
            ctx.charged = admission.streaming(opened.final_worker, tokens)


def release(ctx: RequestContext) -> None:
    """Undo the request's `hold` (nothing if it holds nothing)."""
    for w in ctx.held:
        w.inflight -= 1
    prefill = ctx.held_prefill
    if prefill is not None:
        prefill.inflight_prefill_tokens -= ctx.tok.prompt_tokens
    kv = ctx.held_kv
    if kv is not None:
        kv.inflight_kv_tokens -= ctx.tok.prompt_tokens
    ctx.held = ()
    ctx.held_prefill = None
    ctx.held_kv = None
    charged = ctx.charged
    if charged is not None:
        ctx.charged = None
        opened = ctx.opened
        if opened is None:
            ctx.router.admission.unsent(charged, ctx.tok.prompt_tokens)
        else:
            ctx.router.admission.ended(opened.final_worker, charged, ctx.tok.prompt_tokens)


def hold_session(ctx: RequestContext) -> None:
    """Count the request in flight in its session (another request of the session that
    starts meanwhile is a fork) until `release_session(ctx)`."""
    if ctx.info is not None:
        ctx.info.inflight += 1


def release_session(ctx: RequestContext) -> None:
    if ctx.info is not None:
        ctx.info.inflight -= 1


def kv_started(ctx: RequestContext) -> None:
    """The request's plan is about to run: its session's KV will live on the plan's decode
    worker, counted in that worker's working set (`router.state.Router.working_sets`) until
    `kv_ended`. Nothing is counted for a request without a session. A subagent's prompt
    prefix that its worker holds counts once, with its spawner, while that one is counted
    on the same worker (`WorkingSets.shares`: the engine keeps those blocks once)."""
    sid = ctx.session.session_id
    if sid is None:
        return
    decode = ctx.plan.chosen.decode_worker
    ws = ctx.router.working_sets
    now = time.monotonic()
    ws.started(sid, decode, ctx.tok.prompt_tokens, now, tool_answered(ctx.req.messages))
    parent = ctx.session.parent
    if parent is not None:
        ws.shares(sid, parent, ctx.match.longest(decode) * ctx.rview.block_size)
    ctx.kv_counted = True


def kv_ended(ctx: RequestContext) -> None:
    """Undo `kv_started` (nothing if it counted nothing): an answered request's session stays
    in the working set with prompt and output tokens while its predicted gap is short (a
    whole answer that calls a tool names it); a failed one only stops counting as in flight."""
    if not ctx.kv_counted:
        return
    ctx.kv_counted = False
    ws = ctx.router.working_sets
    sid = ctx.session.session_id
    assert sid is not None
    now = time.monotonic()
    output = output_tokens(ctx)
    if output is None:
        ws.failed(sid, now)
        return
    opened = ctx.opened
    tool = None if opened is None or ctx.req.stream else tool_called(opened.first)
    ws.ended(sid, ctx.tok.prompt_tokens + output, now, tool)


def tool_answered(messages: list[Any] | None) -> str | None:
    """The name of the tool whose result ends a chat's messages (the tool gap this request
    closes was that tool's), found through the assistant's call of that id; None otherwise."""
    if not messages:
        return None
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "tool":
        return None
    call_id = last.get("tool_call_id")
    for m in reversed(messages):
        if not isinstance(m, dict) or m.get("role") != "assistant":
            continue
        for call in m.get("tool_calls") or ():
            if isinstance(call, dict) and call.get("id") == call_id:
                fn = call.get("function")
                name = fn.get("name") if isinstance(fn, dict) else None
                return name if isinstance(name, str) else None
        return None
    return None


_TOOL_CALLS = (b'"finish_reason":"tool_calls"', b'"finish_reason": "tool_calls"')
_NAMES = (b'"name":"', b'"name": "')


def tool_called(body: bytes) -> str | None:
    """The function a whole chat answer calls (its first tool call's name) when it finished
    with `tool_calls`, found without parsing or copying the body (compact JSON or with a
    space after the colons); None otherwise."""
    if not any(key in body for key in _TOOL_CALLS):
        return None
    for key in _NAMES:
        i = body.find(key)
        if i >= 0:
            i += len(key)
            j = body.find(b'"', i)
            return body[i:j].decode("utf-8", "replace") if j > i else None
    return None
