"""The request path's runner: `respond` serves one completion request by calling its stages in
order, each with what it reads (`router.stages`, `router.streaming`, `router.aftermath`; each
stage's services come from `Router.services`, `router.services`):

    parse -> identify -> tokenize (-> chunk) -> admit -> look_up -> view
          -> (plan -> execute, retried) -> stream (-> commit) -> observe

The runner alone times them (`ownerserve_stage_seconds{stage}`, `router.telemetry.StageTimes`),
opens their trace spans (`ownerserve.request` around all but parse; `ownerserve.tokenize`,
`ownerserve.directory.lookup`, `ownerserve.plan` and `ownerserve.upstream` around theirs),
retries a plan that failed before its first byte on the other workers, owns the request's
`RequestLease` (`router.lease`: everything the request holds, given back once on every path)
and turns every failure into an OpenAI error, or an SSE error event once the response
started.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from typing import TYPE_CHECKING

from ownerserve.errors import (
    ClientDisconnected,
    NoWorkerAvailableError,
    RateLimitError,
    ShuttingDownError,
    UpstreamError,
)
from ownerserve.http import error_status_and_body
from planner.types import Plan
from router.aftermath import after_first_bytes, observe, record_service, tpot
from router.executor import (
    OpenedResponse,
    RetryableUpstreamError,
    UpstreamTimeoutError,
    forward_headers,
)
from router.inflight import output_tokens
from router.lease import RequestLease
from router.plans import Fallback, GaveUp, PlanRecord
from router.requests import Endpoint, parse_request
from router.stages import (
    admit,
    execute,
    give_up,
    identify,
    look_up,
    model_label,
    plan,
    served_model,
    tokenize,
    view,
)
from router.streaming import Answer, stream
from router.telemetry import STAGES
from router.tokens import ModelTokenizer
from router.writer import ResponseWriter

if TYPE_CHECKING:
    from router.requests import CompletionRequest
    from router.state import Router

log = logging.getLogger(__name__)

# the stages' indices in `STAGES`, in the same order
(PARSE, IDENTIFY, TOKENIZE, ADMIT, LOOK_UP, VIEW, PLAN, EXECUTE, STREAM, COMMIT, OBSERVE) = range(
    len(STAGES)
)

_NONE_EXCLUDED: frozenset[str] = frozenset()


async def respond(
    router: Router,
    endpoint: Endpoint,
    raw_headers: list[tuple[bytes, bytes]],
    out: ResponseWriter,
    t0: float,
    *,
    body: bytes | None = None,
    read: Callable[[], Awaitable[bytes]] | None = None,
) -> None:
    """Serve one completion request whose bytes arrived at `t0` (`time.perf_counter()`):
    `body` already read, or `read()` reads it (after the API key check). Every failure
    becomes an OpenAI error response, or an SSE error event when the response already
    started; a client disconnect ends it quietly."""
    if not router.started:
        await router.start()
    metrics = router.metrics
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw_headers}
    label = "?"
    try:
        router.check_auth(headers)
        if body is None:
            assert read is not None
            body = await read()
        svc = router.services.parse
        req = parse_request(body, endpoint)
        label = model_label(svc, req.model)
        mt = served_model(svc, req.model)
        t = metrics.stages.lap(PARSE, t0)
        async with asyncio.timeout(router.settings.server.request_timeout_s):
            outcome = await _route(router, req, mt, headers, raw_headers, out, t0, t)
        metrics.of(metrics.requests, label, outcome).inc()
    except ClientDisconnected:
        return
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is None or not (out.disconnected or out.stopping):
            raise
        task.uncancel()
        if out.disconnected:
            metrics.of(metrics.requests, label, "client_disconnected").inc()
            return
        await _fail(router, out, label, ShuttingDownError("the router is shutting down"))
    except BaseException as exc:
        out.detach()  # what follows must not be cancelled by a late disconnect
        if isinstance(exc, TimeoutError):
            exc = UpstreamTimeoutError("request timed out")
        if not isinstance(exc, Exception):
            raise
        await _fail(router, out, label, exc)


async def _fail(router: Router, out: ResponseWriter, label: str, exc: Exception) -> None:
    """End the response with `exc`: an OpenAI error answer, or an SSE error event (and the
    stream's end) when the response already started."""
    metrics = router.metrics
    status, err = error_status_and_body(exc)
    metrics.of(metrics.requests, label, str(status)).inc()
    if out.started:
        await out.fail(exc)
        return
    headers_out = [(b"content-type", b"application/json")]
    if isinstance(exc, RateLimitError):
        headers_out.append((b"retry-after", str(exc.retry_after_s).encode()))
    await out.start(status, headers_out, err)


def outcome(status: int, whole: bool) -> str:
    """A served request's `status` label in `ownerserve_requests_total`: `ok`, the worker's
    error status (a 4xx it answered: the client sees it), or `stream_failed` (the worker
    failed after the first bytes: the client got an error event)."""
    if status >= 400:
        return str(status)
    return "ok" if whole else "stream_failed"


async def _route(
    router: Router,
    req: CompletionRequest,
    mt: ModelTokenizer,
    headers: dict[str, str],
    raw_headers: list[tuple[bytes, bytes]],
    out: ResponseWriter,
    t0: float,
    t: float,
) -> str:
    """Every stage after `parse` (`t`: when parse ended), within the request's span; the
    request's outcome as `ownerserve_requests_total` counts it (`outcome`)."""
    svc = router.services
    tel = router.telemetry
    metrics = router.metrics
    times = metrics.stages
    clock = time.perf_counter
    with tel.start_span("ownerserve.request", context=tel.extract(headers), model=req.model):
        with tel.start_span("ownerserve.tokenize"):
            session = identify(req, headers, svc.derived_sessions)
            t = times.lap(IDENTIFY, t)
            prompt = tokenize(req, mt, session, svc.sessions)
            t = times.lap(TOKENIZE, t)
        with RequestLease(svc.lease, prompt) as lease:
            queued_s = await admit(svc.admission, prompt, out)
            t = times.lap(ADMIT, t)
            with tel.start_span("ownerserve.directory.lookup", blocks=len(prompt.tok.chain)):
                match, holders = await look_up(svc.look_up, prompt)
            t = times.lap(LOOK_UP, t)
            policy, rview, info = view(svc.view, headers, prompt, match)
            t = times.lap(VIEW, t)
            lease.session_joined(info)

            # plan -> execute, up to `server.retries` times more without each worker that
            # failed before the first byte; a hand-over or fetch given up runs colocated
            trace: dict[str, str] = {}
            tel.inject(trace)
            out_headers = forward_headers(raw_headers, bool(router.api_keys), trace)
            limits = router.settings.server
            retries = limits.retries
            run = svc.execute
            sent = prompt.req
            excluded: Collection[str] = _NONE_EXCLUDED
            fallback: Fallback | None = None
            last_error: RetryableUpstreamError | None = None
            served: tuple[OpenedResponse, Plan, Plan] | None = None
            for attempt in range(retries + 1):
                with tel.start_span("ownerserve.plan", attempt=attempt):
                    planned = plan(policy, rview, svc.cluster, match, excluded, holders)
                t = times.lap(PLAN, t)
                if planned is None:
                    break
                chosen = planned.chosen
                lease.plan_started(planned, match)
                if attempt == 0:
                    metrics.overhead.observe(clock() - t0 - queued_s)
                try:
                    with tel.start_span(
                        "ownerserve.upstream",
                        action=planned.action.value,
                        prefill=chosen.prefill_worker,
                        decode=chosen.decode_worker,
                    ) as span:
                        opened, sent, ran = await execute(
                            run, planned, sent, prompt, match, holders, out_headers
                        )
                        if span is not None and opened.fallback is not None:
                            span.set_attribute("ran", "colocated")
                            span.set_attribute("gave_up", opened.fallback.reason)
                except RetryableUpstreamError as exc:
                    t = times.lap(EXECUTE, t)
                    lease.plan_failed()  # the next attempt takes it all again
                    last_error = exc
                    if exc.after is not None:
                        fallback = give_up(run, fallback, exc.after, "colocated")
                    excluded = {*excluded, exc.worker}
                    fallback = give_up(
                        run,
                        fallback,
                        GaveUp(exc.worker, exc.cause),
                        "other_worker" if attempt < retries else None,
                    )
                    metrics.retries.labels(exc.worker, "before_first_byte").inc()
                    log.warning("retrying without %s: %s", exc.worker, exc.reason)
                    continue
                t = times.lap(EXECUTE, t)
                lease.plan_opened(opened)
                if opened.fallback is not None:
                    fallback = give_up(run, fallback, opened.fallback, "colocated")
                served = (opened, planned, ran)
                break
            if served is None:
                if last_error is not None:
                    raise UpstreamError(f"no worker could serve the request: {last_error}")
                raise NoWorkerAvailableError(f"no healthy worker serves model '{req.model}'")
            opened, planned, ran = served

            # stream (-> commit) -> observe
            shown = PlanRecord.of(
                planned,
                prompt.session.session_id,
                opened.fetched,
                fallback,
                ran,
                opened.fetched_blocks,
                opened.chunks,
            )
            answer = Answer()
            commit_s = 0.0

            async def first_bytes() -> None:
                nonlocal commit_s
                began = clock()
                await after_first_bytes(svc.commit, ran, prompt, match)
                commit_s = clock() - began

            lease.answer_started(opened)
            try:
                ok = await stream(
                    svc.stream, opened, out, shown, prompt.req.stream, t0, first_bytes, answer
                )
            finally:
                lease.answer_ended(answer.output_events)
                await opened.aclose()
            now = clock()
            e2e_s = now - t0
            times.add(STREAM, now - t - commit_s)
            if commit_s:
                times.add(COMMIT, commit_s)
            events = answer.output_events
            observe(
                svc.observe,
                ran,
                match,
                fallback,
                ok,
                answer.ttft_s,
                tpot(answer.ttft_s, e2e_s, events),
                e2e_s,
                opened.transfer_s,
            )
            record_service(info, prompt.tokens, output_tokens(opened, prompt.req.stream, events))
            times.lap(OBSERVE, now)
            return outcome(opened.status, ok)
