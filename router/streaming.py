"""The `stream` stage: send the opened upstream response to the client (whole, or streamed
unbuffered as it arrives) with its `x-ownerserve-plan` header, commit once its first bytes
are there, and time it for calibration. A worker that fails or stalls mid-stream (no bytes
for `server.stream_gap_timeout_s`) ends the stream with an error event."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ownerserve.errors import UpstreamError
from ownerserve.http import public_error_body, sse_error_event
from router.executor import OpenedResponse, UpstreamTimeoutError
from router.plans import PlanRecord, plan_header
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
) -> bool:
    """Send `opened` to the client (streamed when the client asked, `streamed`, and the
    worker said 200) with the plan header of `shown` (also kept for `GET /admin/plans`), and
    call `first_bytes` once the answer's first bytes are there (a whole answer's before it
    is sent). True when the answer was served whole; the caller closes `opened`."""
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
            ),
        ),
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
    events = opened.first.count(b"data: ")
    await out.write(opened.first)
    await first_bytes()
    response = opened.response
    try:
        if response is not None and not opened.finished and out.direct:
            write_nowait = out.write_nowait
            counted = [events]

            def sink(chunk: bytes) -> bool:
                counted[0] += chunk.count(b"data: ")
                return write_nowait(chunk)

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
            await out.write(chunk)
    except OSError as exc:
        ok = False
        wid = worker.worker_id
        svc.metrics.stream_errors.labels(wid).inc()
        log.warning("worker %s failed mid-stream: %r", wid, exc)
        err: UpstreamError
        if isinstance(exc, UpstreamTimeout):
            svc.metrics.upstream_timeouts.labels(wid, exc.hop).inc()
            err = UpstreamTimeoutError(
                f"worker {wid} sent nothing for {exc.timeout_s:g} s mid-stream"
            )
        else:
            err = UpstreamError(f"worker {wid} failed mid-stream")
        await out.write(sse_error_event(err))
        worker.breaker.record_failure()
        svc.spawn(svc.pool.check(worker))
    answer.output_events = max(0, events - 1)
    await out.end()
    return ok
