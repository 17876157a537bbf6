"""The request path's runner: `respond` serves one completion request by calling its stages in
order, each with what it reads (`router.stages`, `router.streaming`, `router.aftermath`; each
stage's services come from `Router.services`, `router.services`):

    parse -> identify -> tokenize (-> chunk) -> admit -> look_up -> view
          -> (plan -> execute, retried) -> stream (-> commit)
          (-> plan -> execute -> stream, a continuation on another worker) -> observe

The runner alone times them (`ownerserve_stage_seconds{stage}`, `router.telemetry.StageTimes`),
opens their trace spans (`ownerserve.request` around all but parse; `ownerserve.tokenize`,
`ownerserve.directory.lookup`, `ownerserve.plan` and `ownerserve.upstream` around theirs),
retries a plan that failed before its first byte on the other workers, continues an answer
whose worker failed mid-stream on another (`router.migration`: planned and executed by the
same stages, `server.max_migrations` times at most), owns the request's
`RequestLease` (`router.lease`: everything the request holds, given back once on every path)
and turns every failure into an OpenAI error, or an SSE error event once the response
started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterator
from typing import TYPE_CHECKING, Any

from ownerserve.config import ServerSettings
from ownerserve.directory.base import Match
from ownerserve.errors import (
    ClientDisconnected,
    NoWorkerAvailableError,
    RateLimitError,
    ShuttingDownError,
    UpstreamError,
)
from ownerserve.http import error_status_and_body
from planner.types import Plan, Policy, RequestView
from router.aftermath import after_first_bytes, observe, record_reuse, record_service, tpot
from router.answers import delivered_tokens, output_tokens
from router.executor import (
    OpenedResponse,
    RetryableUpstreamError,
    UpstreamTimeoutError,
    forward_headers,
)
from router.lease import RequestLease
from router.migration import (
    Partial,
    Splice,
    Transcript,
    asks_usage,
    continuation,
    ending,
    unmigratable,
)
from router.plans import Fallback, GaveUp, PlanRecord, restore_shown
from router.prompt import Prompt
from router.requestlog import REQUEST_ID_HEADER, RequestLog, request_id
from router.requests import Endpoint, parse_request
from router.stages import (
    ChunkHolders,
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
from router.streaming import Answer, Cut, continue_stream, end_cut, stream
from router.telemetry import STAGES, plan_attributes
from router.tokens import ModelTokenizer
from router.writer import ResponseWriter

if TYPE_CHECKING:
    from router.requests import CompletionRequest
    from router.reservations import InflightReservations
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
    started; a client disconnect ends it quietly. However it ends, its answer carries its
    request id (`x-request-id`) and its log line is written once, here
    (`router.requestlog`)."""
    if not router.started:
        await router.start()
    metrics = router.metrics
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw_headers}
    record = RequestLog(request_id(headers.get("x-request-id")))
    out.request_id = record.rid.encode()
    label = "?"
    try:
        router.check_auth(headers)
        if body is None:
            assert read is not None
            body = await read()
        svc = router.services.parse
        req = parse_request(body, endpoint)
        label = record.model = model_label(svc, req.model)
        mt = served_model(svc, req.model)
        t = metrics.stages.lap(PARSE, t0)
        async with asyncio.timeout(router.settings.server.request_timeout_s):
            outcome = await _route(router, req, mt, headers, raw_headers, out, t0, t, record)
        metrics.of(metrics.requests, label, outcome).inc()
    except ClientDisconnected:
        record.cancelled(out.started)
        return
    except asyncio.CancelledError:
        record.cancelled(out.started)
        task = asyncio.current_task()
        if task is None or not (out.disconnected or out.stopping):
            raise
        task.uncancel()
        if out.disconnected:
            metrics.of(metrics.requests, label, "client_disconnected").inc()
            return
        await _fail(router, out, label, ShuttingDownError("the router is shutting down"), record)
    except BaseException as exc:
        out.detach()  # what follows must not be cancelled by a late disconnect
        if isinstance(exc, TimeoutError):
            exc = UpstreamTimeoutError("request timed out")
        if not isinstance(exc, Exception):
            raise
        await _fail(router, out, label, exc, record)
    finally:
        record.emit(time.perf_counter() - t0)


async def _fail(
    router: Router, out: ResponseWriter, label: str, exc: Exception, record: RequestLog
) -> None:
    """End the response with `exc`: an OpenAI error answer, or an SSE error event (and the
    stream's end) when the response already started."""
    metrics = router.metrics
    status, err = error_status_and_body(exc)
    metrics.of(metrics.requests, label, str(status)).inc()
    record.failed(status, exc, out.started)
    if out.started:
        await out.fail(exc)
        return
    headers_out = [(b"content-type", b"application/json"), (REQUEST_ID_HEADER, out.request_id)]
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
    record: RequestLog,
) -> str:
    """Every stage after `parse` (`t`: when parse ended), within the request's span, telling
    `record` what each learns; the request's outcome as `ownerserve_requests_total` counts it
    (`outcome`)."""
    svc = router.services
    tel = router.telemetry
    metrics = router.metrics
    times = metrics.stages
    clock = time.perf_counter
    context = tel.extract(headers)
    with tel.start_span("ownerserve.request", context=context, model=req.model) as span:
        with tel.start_span("ownerserve.tokenize"):
            session = identify(req, headers, svc.derived_sessions)
            t = times.lap(IDENTIFY, t)
            prompt = tokenize(req, mt, session, svc.sessions)
            t = times.lap(TOKENIZE, t)
        record.session = prompt.session.session_id
        record.prompt_tokens = prompt.tokens
        tries = _Tries(t)
        with RequestLease(svc.lease, prompt) as lease, tries.holding(router.reservations):
            queued_s = await admit(svc.admission, prompt, out)
            t = times.lap(ADMIT, t)
            record.queued_s = queued_s
            with tel.start_span("ownerserve.directory.lookup", blocks=len(prompt.tok.chain)):
                match, holders = await look_up(svc.look_up, prompt)
            t = times.lap(LOOK_UP, t)
            policy, rview, info = view(svc.view, headers, prompt, match)
            t = times.lap(VIEW, t)
            lease.session_joined(info)

            # plan -> execute (retried without each worker that failed before the first byte)
            trace: dict[str, str] = {}
            tel.inject(trace)
            out_headers = forward_headers(raw_headers, bool(router.api_keys), trace)
            tries.t = t
            served = await _open(
                router, lease, tries, policy, rview, prompt, match, holders, prompt.req,
                out_headers, t0 + queued_s,
            )  # fmt: skip
            t = tries.t
            record.fallback = tries.fallback
            if served is None:
                if tries.last_error is not None:
                    raise UpstreamError(f"no worker could serve the request: {tries.last_error}")
                raise NoWorkerAvailableError(f"no healthy worker serves model '{req.model}'")
            opened, planned, ran = served
            record.planned(ran, mt.block_size, prompt.tokens)
            record.status = opened.status

            # stream (-> commit; -> a continuation on another worker, when its worker fails
            # mid-stream) -> observe
            shown = PlanRecord.of(
                planned,
                prompt.session.session_id,
                opened.fetched,
                tries.fallback,
                ran,
                opened.fetched_blocks,
                opened.chunks,
                restore=restore_shown(match, ran, mt.settings.kv_spec, mt.block_size),
                restorable=match.restorable,
            )
            answer = Answer()
            commit_s = 0.0

            async def first_bytes() -> None:
                nonlocal commit_s
                began = clock()
                await after_first_bytes(svc.commit, ran, prompt, match)
                commit_s = clock() - began

            # a stream that may move to another worker keeps what the client got, and waits
            # for its worker's next bytes only `stall_timeout_s` (`router.migration`)
            limits = router.settings.server
            transcript: Transcript | None = None
            why_not: str | None = None
            stall_s: float | None = None
            if prompt.req.stream and limits.max_migrations:
                why_not = unmigratable(prompt.req)
                if why_not is None:
                    transcript = Transcript()
                    stall_s = _stall_bound(limits, 0)
            lease.answer_started(opened)
            try:
                ok = await stream(
                    svc.stream, opened, out, shown, prompt.req.stream, t0, first_bytes, answer,
                    transcript, stall_s,
                )  # fmt: skip
                if answer.cut is not None:
                    ok, opened = await _carry_on(
                        router, lease, tries, span, policy, rview, prompt, mt, match, holders,
                        out_headers, out, answer, opened, transcript, why_not,
                    )  # fmt: skip
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
                tries.fallback,
                ok,
                answer.ttft_s,
                tpot(answer.ttft_s, e2e_s, events),
                e2e_s,
                opened.transfer_s,
                queued_s,
            )
            if opened.status == 200:
                record_reuse(
                    svc.observe, mt.settings.name, ran, match, prompt.tokens, mt.block_size,
                    delivered_tokens(opened, prompt.req.stream, answer.tail),
                )  # fmt: skip
            output = output_tokens(opened, prompt.req.stream, events)
            record_service(info, prompt.tokens, output)
            times.lap(OBSERVE, now)
            record.output_tokens = output
            record.ttft_s = answer.ttft_s
            record.fallback = tries.fallback
            final = opened.final_worker.worker_id
            if final != record.decode:
                record.worker = final
            record.answered(opened.status, ok)
            return outcome(opened.status, ok)


class _Tries:
    """The plan -> execute loop's state over one request's attempts, its continuations'
    included: the workers that failed it, what ran instead so far, the last failure before a
    first byte, when the runner's last stage timing ended, and the worker whose shared
    in-flight slot it holds (`router.reservations`)."""

    __slots__ = ("excluded", "fallback", "last_error", "reserved", "t")

    def __init__(self, t: float) -> None:
        self.excluded: Collection[str] = _NONE_EXCLUDED
        self.fallback: Fallback | None = None
        self.last_error: RetryableUpstreamError | None = None
        self.reserved: str | None = None
        self.t = t

    @contextlib.contextmanager
    def holding(self, shared: InflightReservations | None) -> Iterator[None]:
        """While inside, the request may hold a shared in-flight slot; on the way out it goes."""
        try:
            yield
        finally:
            self.release(shared)

    def release(self, shared: InflightReservations | None) -> None:
        """Give back the shared in-flight slot it holds, if any."""
        worker = self.reserved
        if worker is not None and shared is not None:
            self.reserved = None
            shared.release(worker)


RESERVE_RETRY_S = 0.01
"""While every worker is at `admission.max_inflight_per_worker` over the router processes,
how often a request tries again for a slot."""


async def _reserved(
    router: Router,
    shared: InflightReservations,
    tries: _Tries,
    planned: Plan | None,
    policy: Policy,
    rview: RequestView,
    prompt: Prompt,
    match: Match,
    holders: ChunkHolders,
) -> Plan | None:
    """`planned` once its decode worker's shared in-flight slot is taken (the slot the
    request held before, if any, given back first); a worker at its bound over every router
    process is planned around, and while every worker is, the request waits for a slot (a
    429 after `admission.max_queue_wait_s`). None when no worker serves it."""
    tries.release(shared)
    cluster = router.services.cluster
    chain = prompt.tok.chain
    full: set[str] = set()
    deadline: float | None = None
    while planned is not None:
        worker = planned.chosen.decode_worker
        got = await shared.reserve(worker)
        state = router.pool.get(worker)
        if state is not None:
            state.shared_inflight = got.total
        if got.taken:
            tries.reserved = worker
            return planned
        full.add(worker)
        planned = plan(policy, rview, cluster, match, {*tries.excluded, *full}, holders, chain)
        if planned is None:  # every worker is full: wait for a slot
            now = time.monotonic()
            if deadline is None:
                deadline = now + router.settings.admission.max_queue_wait_s
            elif now > deadline:
                raise RateLimitError(
                    f"every worker had {shared.bound} requests in flight for "
                    f"{router.settings.admission.max_queue_wait_s:g} s",
                    code="queue_timeout",
                    retry_after_s=router.settings.admission.retry_after_s,
                )
            await asyncio.sleep(RESERVE_RETRY_S)
            full.clear()
            planned = plan(policy, rview, cluster, match, tries.excluded, holders, chain)
    return None


async def _open(
    router: Router,
    lease: RequestLease,
    tries: _Tries,
    policy: Policy,
    rview: RequestView,
    prompt: Prompt,
    match: Match,
    holders: ChunkHolders,
    sent: CompletionRequest,
    headers: bytes,
    overhead_from: float | None,
) -> tuple[OpenedResponse, Plan, Plan] | None:
    """plan -> execute `sent` up to `server.retries` times more, each time without the workers
    that failed it before the first byte (`tries.excluded`); a hand-over or fetch given up runs
    colocated. (The opened response, its plan, the plan as it ran), or None when no worker
    was left or every attempt failed (`tries.last_error`). `overhead_from`: when the router's
    own work on the request began (`ownerserve_router_overhead_seconds` ends at the first
    attempt's upstream request)."""
    svc = router.services
    tel = router.telemetry
    metrics = router.metrics
    times = metrics.stages
    retries = router.settings.server.retries
    run = svc.execute
    t = tries.t
    shared = router.reservations
    for attempt in range(retries + 1):
        with tel.start_span("ownerserve.plan", attempt=attempt) as plan_span:
            planned = plan(
                policy, rview, svc.cluster, match, tries.excluded, holders, prompt.tok.chain
            )
            if shared is not None:
                planned = await _reserved(
                    router, shared, tries, planned, policy, rview, prompt, match, holders
                )
            if plan_span is not None and planned is not None:
                plan_span.set_attributes(plan_attributes(planned))
        t = times.lap(PLAN, t)
        if planned is None:
            break
        chosen = planned.chosen
        lease.plan_started(planned, match)
        if attempt == 0 and overhead_from is not None:
            metrics.overhead.observe(time.perf_counter() - overhead_from)
        try:
            with tel.start_span(
                "ownerserve.upstream",
                action=planned.action.value,
                prefill=chosen.prefill_worker,
                decode=chosen.decode_worker,
            ) as span:
                opened, sent, ran = await execute(
                    run, planned, sent, prompt, match, holders, headers
                )
                if span is not None and opened.fallback is not None:
                    span.set_attribute("ran", "colocated")
                    span.set_attribute("gave_up", opened.fallback.reason)
        except RetryableUpstreamError as exc:
            t = times.lap(EXECUTE, t)
            lease.plan_failed()  # the next attempt takes it all again
            tries.last_error = exc
            if exc.after is not None:
                tries.fallback = give_up(run, tries.fallback, exc.after, "colocated")
            tries.excluded = {*tries.excluded, exc.worker}
            tries.fallback = give_up(
                run,
                tries.fallback,
                GaveUp(exc.worker, exc.cause),
                "other_worker" if attempt < retries else None,
            )
            metrics.retries.labels(exc.worker, "before_first_byte").inc()
            log.warning("retrying without %s: %s", exc.worker, exc.reason)
            continue
        tries.t = times.lap(EXECUTE, t)
        lease.plan_opened(opened)
        if opened.fallback is not None:
            tries.fallback = give_up(run, tries.fallback, opened.fallback, "colocated")
        return opened, planned, ran
    tries.t = t
    return None


def _stall_bound(limits: ServerSettings, moved: int) -> float:
    """The longest gap a stream that has moved `moved` times may leave between two pieces:
    `stall_timeout_s` while it may move again, `stream_gap_timeout_s` once it may not."""
    if moved < limits.max_migrations:
        return min(limits.stall_timeout_s, limits.stream_gap_timeout_s)
    return limits.stream_gap_timeout_s


async def _carry_on(
    router: Router,
    lease: RequestLease,
    tries: _Tries,
    span: Any,
    policy: Policy,
    rview: RequestView,
    prompt: Prompt,
    mt: ModelTokenizer,
    match: Match,
    holders: ChunkHolders,
    headers: bytes,
    out: ResponseWriter,
    answer: Answer,
    opened: OpenedResponse,
    transcript: Transcript | None,
    why_not: str | None,
) -> tuple[bool, OpenedResponse]:
    """The answer's worker failed mid-stream (`answer.cut`): continue the answer on another
    worker, planned as any request is, without the workers that failed it (`router.migration`;
    as often as `server.max_migrations` allows), or end the stream with its error event, saying
    why it went no further (`why_not`: the request's own reason, when it could never move).
    (Whether the answer was served whole, the response it ended on: the caller closes it; a
    response given up here is closed here.)"""
    svc = router.services
    metrics = router.metrics
    limits = router.settings.server
    moved = 0
    ok = False
    if transcript is not None and not out.sse:
        transcript, why_not = None, "its answer is not an event stream"
    while (cut := answer.cut) is not None:
        result = "failed"
        why: str | None = "no other worker could take it over"
        generated = 0
        took_over: OpenedResponse | None = None
        partial: Partial | None = None
        if transcript is None:
            result, why = ("refused_guided", why_not) if why_not else ("refused_limit", None)
        elif moved >= limits.max_migrations:
            result, why = "refused_limit", "it moved as often as server.max_migrations allows"
        else:
            partial = transcript.partial()
            text = partial.text
            generated = len(mt.tokenizer.encode(text)) if text else 0
            following = continuation(prompt.req, text, generated, mt.tokenizer.encode)
            if partial.done or partial.finish_reason is not None or following is None:
                # its last token came (or its token limit was reached): it ends here
                log.warning("worker %s failed after the answer's last token", cut.worker)
                tail = ending(partial, prompt.tokens, generated, asks_usage(prompt.req))
                await out.write(tail)
                answer.events += tail.count(b"data: ")
                answer.output_events = max(0, answer.events - 1)
                answer.cut = None
                await out.end()
                return True, opened
            if partial.why_not is not None:
                result, why = "refused_partial", partial.why_not
            else:
                lease.answer_cut(prompt.tokens + generated)
                await opened.aclose()  # the failed worker's side of it ends (aborted there)
                took_over = await _take_over(
                    router, lease, tries, policy, rview, prompt, match, holders, following,
                    headers, cut,
                )  # fmt: skip
                if took_over is not None:
                    result = "migrated"
                    opened = took_over
        metrics.of(metrics.migrations, result).inc()
        to = "" if took_over is None else took_over.final_worker.worker_id
        if span is not None:
            span.add_event(
                "ownerserve.migration",
                {"from": cut.worker, "to": to, "outcome": result, "generated_tokens": generated},
            )
        if took_over is None or partial is None:
            if transcript is not None:
                log.warning("the answer of %s goes no further: %s", cut.worker, why)
            await end_cut(out, answer, why)
            answer.cut = None
            break
        assert transcript is not None
        moved += 1
        log.warning(
            "worker %s failed mid-stream: the answer continues on %s after %d tokens",
            cut.worker, to, generated,
        )  # fmt: skip
        answer.cut = None
        splice = Splice(partial.head, prompt.tokens, generated)
        try:
            ok = await continue_stream(
                svc.stream, opened, out, answer, transcript, splice, _stall_bound(limits, moved)
            )
        except BaseException:
            await opened.aclose()
            raise
    if span is not None:
        span.set_attribute("migrations", moved)
    return ok, opened


async def _take_over(
    router: Router,
    lease: RequestLease,
    tries: _Tries,
    policy: Policy,
    rview: RequestView,
    prompt: Prompt,
    match: Match,
    holders: ChunkHolders,
    following: CompletionRequest,
    headers: bytes,
    cut: Cut,
) -> OpenedResponse | None:
    """Open the continuation `following` on another worker (`_open`, without the workers that
    failed the request) and start its answer: its lease holds, its plan listed for
    `GET /admin/plans`, its commit. None when no worker could (or would: a 4xx) take it."""
    svc = router.services
    tries.excluded = {*tries.excluded, cut.worker}
    tries.last_error = None
    tries.t = time.perf_counter()  # its plan and execute are timed from now
    served = await _open(
        router, lease, tries, policy, rview, prompt, match, holders, following, headers, None
    )
    if served is None:
        return None
    opened, planned, ran = served
    if opened.status != 200:
        log.warning(
            "worker %s refused to continue the answer of %s: status %d",
            opened.final_worker.worker_id, cut.worker, opened.status,
        )  # fmt: skip
        await opened.aclose()
        return None
    opened.final_worker.breaker.record_success()
    try:
        lease.answer_started(opened)
        # not a plan to learn from (its time to first token is another worker's)
        gave_up = GaveUp(cut.worker, cut.reason)
        fallback = tries.fallback
        tries.fallback = (
            Fallback("other_worker", (gave_up,))
            if fallback is None
            else fallback.then("other_worker", gave_up)
        )
        svc.stream.recent_plans.append(
            PlanRecord.of(
                planned, prompt.session.session_id, opened.fetched, None, ran,
                opened.fetched_blocks, opened.chunks, migrated_from=cut.worker,
            )
        )  # fmt: skip
        await after_first_bytes(svc.commit, ran, prompt, match)
    except BaseException:
        await opened.aclose()
        raise
    return opened
