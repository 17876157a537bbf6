"""The `stream` stage: send the opened upstream response to the client (whole, or streamed
unbuffered as it arrives) with its `x-ownerserve-plan` header, commit once its first bytes
are there, and time it for calibration. A worker that fails or stalls mid-stream (no bytes
for `server.stream_gap_timeout_s`, or `server.stall_timeout_s` for a stream that may move)
leaves the stream open for the runner (`Answer.cut`): it continues the answer on another
worker (`continue_stream`, `router.migration`) or ends it with an error event (`end_cut`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ownerserve.errors import UpstreamError
from ownerserve.http import public_error_body, sse_error_event
from router.executor import OpenedResponse, UpstreamTimeoutError, cause_of
from router.migration import Splice, Transcript
from router.plans import PlanRecord, plan_header
from router.requestlog import REQUEST_ID_HEADER
from router.services import StreamServices
from router.upstream import UpstreamTimeout
from router.writer import ResponseWriter

log = logging.getLogger(__name__)

PLAN_HEADER = b"x-ownerserve-plan"


@dataclass(slots=True)
class Answer:
    """What the client got of the answer so far (`stream` fills it in as it goes, so that a
    stream cut short still says how far it went)."""

    ttft_s: float | None = None
    """Seconds from the request's bytes to the first bytes of a streamed answer."""
    output_events: int = 0
    """Output events of a streamed answer (its `data:` lines but the last), once it ended."""
    events: int = 0
    """`data:` lines the client got so far, from every worker that streamed it."""
    cut: Cut | None = None
    """The worker streaming it failed mid-stream, the stream still open: the runner continues
    it on another worker or ends it (`end_cut`)."""
    tail: bytes = b""
    """A streamed answer's last two reads from its first worker, once it ended: where its
    usage chunk is, when the client asked for one (`router.answers.delivered_tokens`)."""


@dataclass(frozen=True, slots=True)
class Cut:
    """A stream whose worker failed mid-stream: the worker, the error the client is to get if
    the answer goes no further, and why in `GaveUp`'s words (`stream_gap_timeout`,
    `upstream_failed`)."""

    worker: str
    error: UpstreamError
    reason: str


WORKER_FAULTS = frozenset({404, 429})
"""A worker's answers that count against its circuit breaker though they are 4xx: what the
router checked before routing there (404: the model the router sent is not on the worker) or
the worker shedding load (429). Any other 4xx is the client's request refused: it neither
opens nor closes the breaker."""


async def stream(
    svc: StreamServices,
    opened: OpenedResponse,
    out: ResponseWriter,
    shown: PlanRecord,
    streamed: bool,
    t0: float,
    first_bytes: Callable[[], Awaitable[None]],
    answer: Answer,
    transcript: Transcript | None = None,
    stall_s: float | None = None,
) -> bool:
    """Send `opened` to the client (streamed when the client asked, `streamed`, and the
    worker said 200) with the plan header of `shown` (also kept for `GET /admin/plans`) and
    its request id (`out.request_id`), and
    call `first_bytes` once the answer's first bytes are there (a whole answer's before it
    is sent). True when the answer was served whole; the caller closes `opened`. A stream
    that may move to another worker (`transcript`: what the client got is kept there, in
    whole events) waits at most `stall_s` between two pieces. A worker failing mid-stream
    leaves the stream open, `answer.cut` set."""
    worker = opened.final_worker
    if opened.status < 400:
        worker.breaker.record_success()
    elif opened.status in WORKER_FAULTS:
        worker.breaker.record_failure()
    ok = opened.status == 200
    svc.recent_plans.append(shown)
    streaming = streamed and ok
    resp_headers = [
        (b"content-type", opened.content_type),
        (
            PLAN_HEADER,
            plan_header(
                shown.plan,
                shown.fetched,
                shown.fallback,
                shown.ran,
                shown.fetched_blocks,
                shown.chunks,
                shown.restore,
                svc.kv_prices,
            ),
        ),
        (REQUEST_ID_HEADER, out.request_id),
    ]
    out.sse = streaming and opened.content_type.startswith(b"text/event-stream")
    if not streaming:
        # a non-streamed answer arrives whole: no TTFT/TPOT to learn from
        first = opened.first
        if ok:
            await first_bytes()
        else:  # a worker's error: its words, never its internals (`public_error_body`)
            first, withheld = public_error_body(opened.status, first)
            resp_headers[0] = (b"content-type", b"application/json")
            if withheld is not None:
                wid, status = worker.worker_id, opened.status
                log.warning("worker %s answered %d: %s", wid, status, withheld)
        await out.start(opened.status, resp_headers, first)
        return ok
    await out.start(opened.status, resp_headers)
    answer.ttft_s = time.perf_counter() - t0
    first = opened.first
    events = first.count(b"data: ")
    last = [b"", first]  # the last two reads, unchanged by the transcript
    if transcript is not None:
        first = transcript.keep(first)
    if first:
        await out.write(first)
    await first_bytes()
    response = opened.response
    if stall_s is not None and response is not None and not opened.finished:
        response.watch_gaps(stall_s)
    try:
        if response is not None and not opened.finished and out.direct:
            write_nowait = out.write_nowait
            counted = [events]

            if transcript is None:

                def sink(chunk: bytes) -> bool:
                    counted[0] += chunk.count(b"data: ")
                    last[0] = last[1]
                    last[1] = chunk
                    return write_nowait(chunk)

            else:
                keep = transcript.keep

                def sink(chunk: bytes) -> bool:
                    counted[0] += chunk.count(b"data: ")
                    last[0] = last[1]
                    last[1] = chunk
                    chunk = keep(chunk)
                    return write_nowait(chunk) if chunk else False

            try:
                await response.pipe(sink, out.drain)
            finally:
                events = counted[0]
            opened.finished = True
        while response is not None and not opened.finished:
            chunk = await response.readany()
            if not chunk:
                opened.finished = True
                break
            events += chunk.count(b"data: ")
            last[0] = last[1]
            last[1] = chunk
            if transcript is not None:
                chunk = transcript.keep(chunk)
                if not chunk:
                    continue
            await out.write(chunk)
        if transcript is not None:
            tail = transcript.flush()
            if tail:
                await out.write(tail)
    except OSError as exc:
        answer.events += events
        answer.cut = _cut(svc, opened, exc)
        return False
    answer.events += events
    answer.output_events = max(0, answer.events - 1)
    answer.tail = last[0] + last[1]
    await out.end()
    return ok


def _cut(svc: StreamServices, opened: OpenedResponse, exc: OSError) -> Cut:
    """`opened`'s worker failed mid-stream (`exc`): counted, logged, its breaker told and its
    health checked at once; the error the client gets if the answer goes no further."""
    worker = opened.final_worker
    wid = worker.worker_id
    svc.metrics.stream_errors.labels(wid).inc()
    log.warning("worker %s failed mid-stream: %r", wid, exc)
    err: UpstreamError
    if isinstance(exc, UpstreamTimeout):
        svc.metrics.upstream_timeouts.labels(wid, exc.hop).inc()
        err = UpstreamTimeoutError(f"worker {wid} sent nothing for {exc.timeout_s:g} s mid-stream")
    else:
        err = UpstreamError(f"worker {wid} failed mid-stream")
    worker.breaker.record_failure()
    svc.spawn(svc.pool.check(worker))
    return Cut(wid, err, cause_of(exc, "upstream_failed"))


async def end_cut(out: ResponseWriter, answer: Answer, why: str | None = None) -> None:
    """End a stream cut short (`answer.cut`) with its error event and `[DONE]`; `why` says
    why it went no further (what kept it from another worker)."""
    cut = answer.cut
    assert cut is not None
    err = cut.error
    if why:
        err = type(err)(f"{err}; not continued on another worker: {why}")
    await out.write(sse_error_event(err))
    answer.output_events = max(0, answer.events - 1)
    await out.end()


async def continue_stream(
    svc: StreamServices,
    opened: OpenedResponse,
    out: ResponseWriter,
    answer: Answer,
    transcript: Transcript,
    splice: Splice,
    stall_s: float,
) -> bool:
    """Relay a continuation's stream (`opened`, the answer taken over from a worker that
    failed mid-stream) as the rest of the answer the client is getting (`splice`), kept in
    `transcript` too. True when it ended whole; a worker failing again leaves `answer.cut`
    set and the stream open, as `stream` does."""
    response = opened.response
    if response is not None and not opened.finished:
        response.watch_gaps(stall_s)
    try:
        await _write(out, transcript.keep(splice.feed(opened.first)))
        while response is not None and not opened.finished:
            chunk = await response.readany()
            if not chunk:
                opened.finished = True
                break
            await _write(out, transcript.keep(splice.feed(chunk)))
        await _write(out, transcript.keep(splice.flush()))
        await _write(out, transcript.flush())
    except OSError as exc:
        answer.events += splice.events
        answer.cut = _cut(svc, opened, exc)
        return False
    answer.events += splice.events
    answer.output_events = max(0, answer.events - 1)
    await out.end()
    return True


async def _write(out: ResponseWriter, data: bytes) -> None:
    if data:
        await out.write(data)
