"""In-flight counting: the one place the router's counters of requests in flight go up and
down — per worker, with the prompt tokens waiting for prefill (the planner's views show them
before the workers' own gauges catch up), per worker's KV working set (what admission
decides by, `router.admission`), and per session (what makes a request a fork)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from router.pool import WorkerState

if TYPE_CHECKING:
    from router.pipeline import RequestContext


def hold(
    ctx: RequestContext, workers: Sequence[WorkerState], prefill: WorkerState | None = None
) -> None:
    """Count the request in flight on `workers`, and its prompt's tokens as queued prefill on
    `prefill`, until `release(ctx)`. Its prompt counts in a working set too: sent for the
    plan's decode worker (`ctx.plan`) while the plan runs, then on the worker streaming the
    answer (`ctx.opened`)."""
    for w in workers:
        w.inflight += 1
    tokens = ctx.tok.prompt_tokens
    if prefill is not None:
        prefill.inflight_prefill_tokens += tokens
    ctx.held = workers
    ctx.held_prefill = prefill
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
    ctx.held = ()
    ctx.held_prefill = None
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
