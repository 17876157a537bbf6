"""Streaming the answer: the `stream` stage, which sends the opened upstream response to the
client unbuffered and times it for calibration. A worker that fails or stalls mid-stream
(no bytes for `server.stream_gap_timeout_s`) ends the stream with an error event."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ownerserve.errors import UpstreamError
from ownerserve.http import public_error_body, sse_error_event
from router.aftermath import after_first_bytes, observe
from router.executor import UpstreamTimeoutError
from router.inflight import hold, release
from router.plans import PlanRecord, plan_header
from router.upstream import UpstreamTimeout

if TYPE_CHECKING:
    from router.pipeline import RequestContext

log = logging.getLogger(__name__)

PLAN_HEADER = b"x-ownerserve-plan"


async def stream(ctx: RequestContext) -> None:
    """Send the opened response to the client (whole, or streamed as it arrives), commit once
    its first bytes are there, then observe how it went."""
    router = ctx.router
    out = ctx.out
    opened = ctx.opened
    plan = ctx.plan
    assert opened is not None and plan is not None
    ctx.transfer_s = opened.transfer_s
    worker = opened.final_worker
    worker.breaker.record_success()
    hold(ctx, opened.workers, kv=worker)
    ok = opened.status == 200
    shown = ctx.planned or plan
    fallback = ctx.fallback
    router.recent_plans.append(
        PlanRecord.of(
            shown,
            ctx.session.session_id,
            opened.fetched,
            fallback,
            plan,
            opened.fetched_blocks,
            opened.chunks,
        )
    )
    streaming = ctx.req.stream and ok
    try:
        resp_headers = [
            (b"content-type", opened.content_type),
            (
                PLAN_HEADER,
                plan_header(
                    shown, opened.fetched, fallback, plan, opened.fetched_blocks, opened.chunks
                ),
            ),
        ]
        out.sse = streaming and opened.content_type.startswith(b"text/event-stream")
        if not streaming:
            # a non-streamed answer arrives whole: no TTFT/TPOT to learn from
            first = opened.first
            if ok:
                await after_first_bytes(ctx)
            else:  # a worker's error: its words, never its internals (`public_error_body`)
                first, withheld = public_error_body(opened.status, first)
                resp_headers[0] = (b"content-type", b"application/json")
                if withheld is not None:
                    log.warning("worker %s answered %d: %s", worker.worker_id, opened.status,
                                withheld)  # fmt: skip
            await out.start(opened.status, resp_headers, first)
        else:
            await out.start(opened.status, resp_headers)
            ctx.ttft_s = time.perf_counter() - ctx.t0
            events = opened.first.count(b"data: ")
            await out.write(opened.first)
            await after_first_bytes(ctx)
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
                router.metrics.stream_errors.labels(wid).inc()
                log.warning("worker %s failed mid-stream: %r", wid, exc)
                err: UpstreamError
                if isinstance(exc, UpstreamTimeout):
                    router.metrics.upstream_timeouts.labels(wid, exc.hop).inc()
                    err = UpstreamTimeoutError(
                        f"worker {wid} sent nothing for {exc.timeout_s:g} s mid-stream"
                    )
                else:
                    err = UpstreamError(f"worker {wid} failed mid-stream")
                await out.write(sse_error_event(err))
                worker.breaker.record_failure()
                router.spawn(router.pool.check(worker))
            ctx.output_events = max(0, events - 1)
            await out.end()
    finally:
        release(ctx)
        await opened.aclose()
    ctx.e2e_s = time.perf_counter() - ctx.t0
    observe(ctx, ok)
