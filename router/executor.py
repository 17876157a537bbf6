"""Plan execution: turn the planner's `Plan` into calls on the workers' own protocols.

Every action ends in one *final* upstream response whose bytes stream to the client:
- colocated prefill, decode continuation, tail recompute: one call to the chosen worker;
- remote prefill: the prefill worker's backend builds both bodies, and its `PDHandoff` sets
  the order: P first, then D with what P's answer hands over (vLLM's `kv_transfer_params`), or
  both at once meeting at a room on P (SGLang's bootstrap room);
- artifact fetch and state migration: ask the destination's worker-side KV API (where its
  backend says) to pull the prefix from the source, then one call there (a failed fetch
  degrades to recomputing).

Every hop is bounded (`HopLimits`: the connect timeout is the connection pool's). A P/D
hand-over ends at D's first streamed bytes (D pulls P's KV before them) and has
`kv_transfer_timeout_s` in all from P's call; D's first bytes also have their own
`first_byte_timeout_s`, and the sooner bound decides. A hand-over or fetch given up (timed out
or failed) falls back to a colocated run on the decode worker (`OpenedResponse.fallback`);
a final call given up before its first bytes raises
`RetryableUpstreamError`, and the caller plans again without that worker. Giving up on a call
closes its connection, which aborts the request on the worker; a decode given up after P
answered also tells P to free the KV it holds for it, where the protocol can
(`Backend.handoff_release`).

`open_plan` does everything up to and including the final response's first bytes, so any
failure before that is retryable on other workers (`RetryableUpstreamError`); after it the
caller owns streaming and must `aclose()` the result, which cancels work on every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from ownerserve.config import ServerSettings
from ownerserve.errors import UpstreamError
from ownerserve.kvfetch import (
    CHUNK_FETCH_PATH,
    FETCH_PATH,
    KVChunkFetchRequest,
    KVFetchRequest,
    fetched_blocks,
    fetched_chunks,
)
from ownerserve.records import fast_init
from ownerserve.tasks import wait_ended
from planner.types import Action, Plan
from router.backends import PDHandoff
from router.plans import GaveUp
from router.pool import WorkerPool, WorkerState
from router.requests import CompletionRequest
from router.upstream import (
    JSON_HEADER,
    Hop,
    UpstreamConnectError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTimeout,
    header_block,
)

log = logging.getLogger(__name__)


class HopLimits(Protocol):
    """The bounds of each hop, in seconds (`ownerserve.config.ServerSettings` has them)."""

    @property
    def first_byte_timeout_s(self) -> float: ...
    @property
    def kv_transfer_timeout_s(self) -> float: ...
    @property
    def stream_gap_timeout_s(self) -> float: ...


class RetryableUpstreamError(UpstreamError):
    """A worker failed before any byte reached the client: try again without it. `cause` says
    how, in `GaveUp`'s words; `after` is a hop given up earlier in the same plan (its P/D
    hand-over or fetch, before the colocated run that failed here)."""

    def __init__(self, worker: str, reason: str, cause: str = "upstream_failed") -> None:
        super().__init__(f"worker {worker} failed ({cause})")  # `reason` is for the log only
        self.worker = worker
        self.reason = reason
        self.cause = cause
        self.after: GaveUp | None = None


def cause_of(exc: OSError, otherwise: str) -> str:
    """`GaveUp.reason` for a failed call: the hop that timed out, a connection that could not
    be opened, else `otherwise`."""
    if isinstance(exc, UpstreamTimeout):
        return f"{exc.hop}_timeout"
    if isinstance(exc, UpstreamConnectError):
        return "connect_failed"
    return otherwise


class UpstreamTimeoutError(UpstreamError):
    status_code = 504
    error_type = "timeout"
    code = "upstream_timeout"


@fast_init
@dataclass(frozen=True, slots=True)
class FetchSpec:
    """What an artifact fetch moves: the first `len(block_hashes)` blocks of the prompt."""

    block_hashes: tuple[int, ...]
    token_ids: Any
    block_size: int


@fast_init
@dataclass(frozen=True, slots=True)
class ChunkFetchSpec:
    """Chunk reuse: the chunks the plan's prefill worker pulls from their holders before it
    runs (`Candidate.chunk_fetches`): per holder, the chunk hashes it gives."""

    by_source: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def planned(self) -> int:
        return sum(len(h) for _, h in self.by_source)


@dataclass(slots=True)
class OpenedResponse:
    """The final upstream response, opened: status, first bytes, and (streaming) the response
    whose rest the caller streams."""

    status: int
    content_type: bytes
    first: bytes
    final_worker: WorkerState
    response: UpstreamResponse | None = None
    workers: list[WorkerState] = field(default_factory=list)
    background: list[asyncio.Task[Any]] = field(default_factory=list)
    transfer_s: float | None = None
    """Duration of the KV movement phase (remote prefill until KV ready, or the fetch)."""
    fetched: bool | None = None
    fetched_blocks: tuple[int, int] | None = None
    """(blocks the destination holds, blocks planned) after a fetch or migration whose KV
    API said how many it holds."""
    finished: bool = False
    fallback: GaveUp | None = None
    """The P/D hand-over or fetch given up: this is then a colocated run on the decode worker."""
    chunks_fetched: tuple[str, frozenset[int]] | None = None
    """Chunk reuse: the worker chunks were fetched into and the chunk hashes it says it holds
    after the chunk fetch (those planned that did not come are recomputed)."""
    chunks: tuple[int, int, int] | None = None
    """Chunk reuse: the prompt's chunks (reused, fetched, recomputed) as they ran (set by the
    pipeline; the plan header's `chunks=`)."""
    prefill_answer: bytes | None = None
    """A remote prefill's answer from P (after-prefill hand-over: read whole), whose usage
    says what P's cache held of the prompt (`router.answers.delivered_tokens`)."""

    async def aclose(self) -> None:
        """Release the connection (or abort it if the body was not fully read: that cancels
        the worker's generation) and cancel background upstream calls."""
        if self.response is not None:
            if self.finished:
                self.response.release()
            else:
                self.response.close()
        for task in self.background:
            task.cancel()
        try:
            await wait_ended(self.background, errors_at=logging.DEBUG)
        finally:
            self.background.clear()


_HOP_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "upgrade",
        "proxy-authorization",
        "accept-encoding",
        "expect",
    }
)
_CONTROL_HEADERS = frozenset({"x-request-id", "x-data-parallel-rank"})
"""Client headers that steer an engine, never forwarded: vLLM takes its request id from
`X-Request-Id` (the id a P/D hand-over names the prefill's request by) and the serving data
parallel rank from `X-data-parallel-rank`; only the router may choose either."""


def forward_headers(
    client_headers: list[tuple[bytes, bytes]], strip_auth: bool, extra: Mapping[str, str]
) -> bytes:
    """Header lines for the worker: the client's (all but hop-by-hop ones and the engine's
    control headers, `_CONTROL_HEADERS`; the router's own API key is not forwarded when the
    router checks keys) plus `extra` (trace context)."""
    skip = _HOP_BYTES_AUTH if strip_auth else _HOP_BYTES
    lines = [b"%s: %s\r\n" % (k, v) for k, v in client_headers if k.lower() not in skip]
    lines.append(b"content-type: application/json\r\n")
    if extra:
        lines.append(header_block(extra))
    return b"".join(lines)


_HOP_BYTES = frozenset(h.encode() for h in _HOP_HEADERS | _CONTROL_HEADERS) | {b"content-type"}
_HOP_BYTES_AUTH = _HOP_BYTES | {b"authorization"}


async def _close_answer(task: asyncio.Task[OpenedResponse]) -> None:
    """Close the response `task` opened, if it opened one (a hop given up after it answered)."""
    if task.done() and not task.cancelled() and task.exception() is None:
        await task.result().aclose()


class PlanExecutor:
    """Runs plans against the pool's workers over one shared HTTP connection pool, each hop
    within `limits` (per call, `open_plan`'s `limits`)."""

    def __init__(
        self,
        pool: WorkerPool,
        http: UpstreamPool,
        span: Callable[..., Any] | None = None,
        limits: HopLimits | None = None,
    ) -> None:
        self.pool = pool
        self.http = http
        self.span = span or (lambda *_a, **_k: contextlib.nullcontext())
        self.limits: HopLimits = limits if limits is not None else ServerSettings()
        self._releases: set[asyncio.Task[None]] = set()
        """`handoff_release` calls in flight (a task holds no reference to itself)."""

    def _worker(self, worker_id: str | None) -> WorkerState:
        state = self.pool.get(worker_id) if worker_id else None
        if state is None:
            raise RetryableUpstreamError(str(worker_id), "not in the pool")
        return state

    async def _post(
        self,
        worker: WorkerState,
        path: str,
        body: bytes,
        headers: bytes,
        bound: tuple[Hop, float] | None,
        failed: str,
    ) -> UpstreamResponse:
        """POST within `bound`; a failure raises `RetryableUpstreamError` with its cause
        (`failed` when it is neither a timeout nor a connect failure)."""
        worker.breaker.on_attempt()
        try:
            resp = await self.http.request(worker.address.url, b"POST", path, headers, body, bound)
        except OSError as exc:
            raise RetryableUpstreamError(
                worker.worker_id, f"request failed: {exc}", cause_of(exc, failed)
            ) from None
        if resp.status >= 500:
            try:
                with contextlib.suppress(Exception):
                    await resp.read()
            finally:
                resp.release()  # closed unless read whole, also when the request is cancelled
            raise RetryableUpstreamError(worker.worker_id, f"status {resp.status}", failed)
        return resp

    async def _first_bytes(
        self, worker: WorkerState, resp: UpstreamResponse, stream: bool
    ) -> bytes:
        """`resp`'s first body bytes (a stream's), else its whole body. Leaving without them
        closes the connection, whatever the exit: a failure, a hop's bound, or the request
        cancelled (its client left, or its own timeout ran out): nothing else holds the
        response yet, and a connection left open keeps the worker generating for nobody."""
        try:
            if stream and resp.status == 200:
                return await resp.readany()
            return await resp.read()
        except OSError as exc:
            resp.close()
            raise RetryableUpstreamError(
                worker.worker_id,
                f"failed before the first byte: {exc!r}",
                cause_of(exc, "upstream_failed"),
            ) from None
        except BaseException:
            resp.close()
            raise

    async def _final_call(
        self,
        worker: WorkerState,
        req: CompletionRequest,
        body: bytes,
        headers: bytes,
        limits: HopLimits,
        handover_ends: float | None = None,
    ) -> OpenedResponse:
        """The call whose answer goes to the client. Streamed, its first body bytes must come
        within `first_byte_timeout_s`, then no gap may pass `stream_gap_timeout_s`; a whole
        (non-streamed) answer's first byte is its last: the request's own timeout bounds it.
        A P/D decode's streamed first bytes end its KV hand-over, so they must also come by
        `handover_ends` (`time.monotonic()`); when that is the sooner bound, running out of
        it is a `kv_transfer_timeout`."""
        bound: tuple[Hop, float] | None = None
        handover = False
        if req.stream:
            bound = ("first_byte", limits.first_byte_timeout_s)
            if handover_ends is not None:
                left = handover_ends - time.monotonic()
                if left < limits.first_byte_timeout_s:
                    bound, handover = ("first_byte", max(left, 0.0)), True
        with self.span("ownerserve.upstream.call", worker=worker.worker_id):
            try:
                resp = await self._post(
                    worker, req.endpoint.value, body, headers, bound, "upstream_failed"
                )
                first = await self._first_bytes(worker, resp, req.stream)
            except RetryableUpstreamError as exc:
                if handover and exc.cause == "first_byte_timeout":
                    # the wait ends at the first bytes, as a first-byte bound's does, but what
                    # it bounds is the hand-over (D's pull of P's KV)
                    exc.cause = "kv_transfer_timeout"
                raise
        streaming = req.stream and resp.status == 200
        if streaming:
            resp.watch_gaps(limits.stream_gap_timeout_s)
        else:
            resp.release()
        return OpenedResponse(
            status=resp.status,
            content_type=resp.header(b"content-type", b"application/json"),
            first=first,
            final_worker=worker,
            response=resp if streaming else None,
            finished=not streaming,
            workers=[worker],
        )

    async def _colocated(
        self,
        decode: WorkerState,
        req: CompletionRequest,
        headers: bytes,
        limits: HopLimits,
        gave_up: GaveUp,
    ) -> OpenedResponse:
        """The plan's KV hand-over was given up (`gave_up`): the decode worker computes the
        prompt itself, from the client's own body."""
        log.warning(
            "gave up on %s (%s): the prompt runs colocated on %s instead",
            gave_up.worker, gave_up.reason, decode.worker_id,
        )  # fmt: skip
        try:
            opened = await self._final_call(decode, req, req.raw, headers, limits)
        except RetryableUpstreamError as exc:
            exc.after = gave_up
            raise
        opened.fallback = gave_up
        return opened

    async def open_plan(
        self,
        plan: Plan,
        req: CompletionRequest,
        headers: bytes,
        fetch: FetchSpec | None = None,
        limits: HopLimits | None = None,
        chunks: ChunkFetchSpec | None = None,
    ) -> OpenedResponse:
        """Execute `plan` up to the final response's first bytes, each hop within `limits`
        (default: the executor's); first, when `chunks` names some, the plan's prefill worker
        pulls those chunks from their holders (`fetch_chunks`: a failure only means they are
        recomputed)."""
        if limits is None:
            limits = self.limits
        if chunks is None or not chunks.by_source:
            return await self._open_plan(plan, req, headers, fetch, limits)
        destination = self._worker(plan.chosen.prefill_worker)
        with self.span("ownerserve.chunk_fetch", to=destination.worker_id) as span:
            held = await self.fetch_chunks(destination, chunks, req, limits.kv_transfer_timeout_s)
            if span is not None:
                span.set_attribute("chunks_planned", chunks.planned)
                span.set_attribute("chunks_fetched", len(held))
        opened = await self._open_plan(plan, req, headers, fetch, limits)
        opened.chunks_fetched = (destination.worker_id, held)
        return opened

    async def _open_plan(
        self,
        plan: Plan,
        req: CompletionRequest,
        headers: bytes,
        fetch: FetchSpec | None,
        limits: HopLimits,
    ) -> OpenedResponse:
        chosen = plan.chosen
        decode = self._worker(chosen.decode_worker)
        action = chosen.action
        if action is Action.REMOTE_PREFILL and chosen.prefill_worker != chosen.decode_worker:
            prefill = self._worker(chosen.prefill_worker)
            if prefill.backend.pd_handoff is PDHandoff.RENDEZVOUS:
                return await self._pd_rendezvous(prefill, decode, req, headers, limits)
            return await self._pd_after_prefill(prefill, decode, req, headers, limits)
        if action in (Action.ARTIFACT_FETCH, Action.STATE_MIGRATION) and chosen.source_worker:
            source = chosen.source_worker
            planned = 0 if fetch is None else len(fetch.block_hashes)
            t = time.perf_counter()
            with self.span("ownerserve.transfer", source=source, to=decode.worker_id) as span:
                failed, got = await self._fetch(
                    decode, source, req, fetch, limits.kv_transfer_timeout_s
                )
                if failed is None and got == 0 and planned:
                    # the source had none of it (the directory's record of it was stale)
                    failed = GaveUp(source, "kv_fetch_empty")
                if span is not None:
                    span.set_attribute("blocks_planned", planned)
                    span.set_attribute("blocks_fetched", -1 if got is None else got)
                    if failed is not None:
                        span.set_attribute("gave_up", failed.reason)
            transfer_s = time.perf_counter() - t
            if failed is not None:
                opened = await self._colocated(decode, req, headers, limits, failed)
                opened.fetched = False
            else:
                opened = await self._final_call(decode, req, req.raw, headers, limits)
                opened.fetched = True
                opened.transfer_s = transfer_s
            if got is not None:
                opened.fetched_blocks = (got, planned)
            return opened
        return await self._final_call(decode, req, req.raw, headers, limits)

    # --- remote prefill, D after P's answer (vLLM's protocol) -------------------------------

    def _prefill_json(self, prefill: WorkerState, req: CompletionRequest) -> dict[str, Any]:
        """The body P receives; `RetryableUpstreamError` when `prefill`'s settings cannot serve
        the protocol (the router tries other workers)."""
        try:
            return prefill.backend.prefill_body(req.body, prefill.address)
        except ValueError as exc:
            raise RetryableUpstreamError(prefill.worker_id, str(exc)) from None

    async def _run_prefill(
        self,
        prefill: WorkerState,
        req: CompletionRequest,
        body: bytes,
        headers: bytes,
        limits: HopLimits,
        protocol: str,
    ) -> tuple[UpstreamResponse, bytes]:
        """P's part of a remote prefill, within the KV transfer timeout: its answer, read
        whole. The connection is released: unless read whole, that closes it (aborting P)."""
        bound: tuple[Hop, float] = ("kv_transfer", limits.kv_transfer_timeout_s)
        with self.span("ownerserve.transfer", protocol=protocol, prefill=prefill.worker_id):
            resp = await self._post(
                prefill, req.endpoint.value, body, headers, bound, "kv_transfer_failed"
            )
            try:
                data = await resp.read()
            except OSError as exc:
                raise RetryableUpstreamError(
                    prefill.worker_id,
                    f"prefill failed: {exc!r}",
                    cause_of(exc, "kv_transfer_failed"),
                ) from None
            finally:
                resp.release()
        return resp, data

    async def _pd_after_prefill(
        self,
        prefill: WorkerState,
        decode: WorkerState,
        req: CompletionRequest,
        headers: bytes,
        limits: HopLimits,
    ) -> OpenedResponse:
        t = time.perf_counter()
        handover_ends = time.monotonic() + limits.kv_transfer_timeout_s
        p_json = self._prefill_json(prefill, req)
        p_body = orjson.dumps(p_json)
        try:
            resp, data = await self._run_prefill(prefill, req, p_body, headers, limits, "vllm")
        except RetryableUpstreamError as exc:
            gave_up = GaveUp(prefill.worker_id, exc.cause)
            return await self._colocated(decode, req, headers, limits, gave_up)
        if resp.status != 200:
            # the client's request is at fault (4xx): pass the worker's answer through
            return OpenedResponse(
                status=resp.status,
                content_type=resp.header(b"content-type", b"application/json"),
                first=data,
                final_worker=prefill,
                finished=True,
                workers=[prefill],
            )
        try:
            p_answer = orjson.loads(data)
            d_json = prefill.backend.decode_body(req.body, p_json, p_answer)
        except (orjson.JSONDecodeError, UpstreamError) as exc:
            log.warning("prefill %s handed nothing over: %s", prefill.worker_id, exc)
            gave_up = GaveUp(prefill.worker_id, "kv_transfer_failed")
            return await self._colocated(decode, req, headers, limits, gave_up)
        d_body = orjson.dumps(d_json)
        transfer_s = time.perf_counter() - t
        try:
            opened = await self._final_call(decode, req, d_body, headers, limits, handover_ends)
        except RetryableUpstreamError as exc:
            # given up before the decode's first byte: its connection is closed, which aborts
            # D's request (and its pull); P frees what it still holds for it
            self._release_handoff(prefill, p_answer)
            if exc.cause != "kv_transfer_timeout":
                raise
            gave_up = GaveUp(prefill.worker_id, exc.cause)
            return await self._colocated(decode, req, headers, limits, gave_up)
        except BaseException:
            # the request ended before the decode took P's KV
            self._release_handoff(prefill, p_answer)
            raise
        if opened.status != 200:
            # P took the body and D refused it with P's KV: the pull failed (P's KV gone: its
            # lease ran out, P restarted or died), or D refuses the request itself, which the
            # colocated run then answers as D's own
            self._release_handoff(prefill, p_answer)
            log.warning(
                "decode %s refused the hand-over from %s (status %s): %s",
                decode.worker_id, prefill.worker_id, opened.status,
                opened.first[:200].decode(errors="replace"),
            )  # fmt: skip
            await opened.aclose()
            gave_up = GaveUp(prefill.worker_id, "kv_transfer_failed")
            return await self._colocated(decode, req, headers, limits, gave_up)
        opened.transfer_s = transfer_s
        opened.workers = [prefill, decode]
        opened.prefill_answer = data
        return opened

    def _release_handoff(self, prefill: WorkerState, p_answer: Any) -> None:
        """Tell P to free the KV it holds for a decode the router gave up on, in the
        background, within the connect timeout (a call P answers at once; if it cannot, its
        own timeout frees the KV)."""
        call = prefill.backend.handoff_release(p_answer)
        if call is None:
            return
        path, body = call
        task = asyncio.get_running_loop().create_task(self._release(prefill, path, body))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, prefill: WorkerState, path: str, body: bytes) -> None:
        bound: tuple[Hop, float] = ("kv_transfer", self.http.connect_timeout_s)
        try:
            await self.http.call(prefill.address.url, b"POST", path, JSON_HEADER, body, bound)
        except OSError as exc:
            log.warning("could not tell %s to free a KV hand-over: %r", prefill.worker_id, exc)

    # --- remote prefill, P and D at once (SGLang's protocol) --------------------------------

    async def _pd_rendezvous(
        self,
        prefill: WorkerState,
        decode: WorkerState,
        req: CompletionRequest,
        headers: bytes,
        limits: HopLimits,
    ) -> OpenedResponse:
        p_json = self._prefill_json(prefill, req)
        d_bytes = orjson.dumps(prefill.backend.decode_body(req.body, p_json, None))
        t = time.perf_counter()
        handover_ends = time.monotonic() + limits.kv_transfer_timeout_s
        p_bytes = orjson.dumps(p_json)

        async def run_prefill() -> float:
            resp, _ = await self._run_prefill(prefill, req, p_bytes, headers, limits, "sglang")
            if resp.status != 200:
                raise RetryableUpstreamError(
                    prefill.worker_id, f"prefill status {resp.status}", "kv_transfer_failed"
                )
            return time.perf_counter() - t

        p_task = asyncio.create_task(run_prefill())
        d_task = asyncio.create_task(
            self._final_call(decode, req, d_bytes, headers, limits, handover_ends)
        )
        gave_up: GaveUp | None = None
        try:
            done, _ = await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
            if p_task in done and p_task.exception() is not None and not d_task.done():
                # the hand-over failed before D answered: D's side of the room is aborted
                d_task.cancel()
                await wait_ended([d_task], errors_at=logging.DEBUG)
                await _close_answer(d_task)  # had it answered before its cancel landed
                failure = p_task.exception()
                if not isinstance(failure, RetryableUpstreamError):
                    assert failure is not None
                    raise failure
                gave_up = GaveUp(prefill.worker_id, failure.cause)
            else:
                try:
                    opened = await d_task
                except RetryableUpstreamError as exc:
                    if exc.cause != "kv_transfer_timeout":
                        raise
                    # D's pull outlasted the hand-over's bound (its request is aborted): P's
                    # side of the room ends too
                    p_task.cancel()
                    await wait_ended([p_task], errors_at=logging.DEBUG)
                    gave_up = GaveUp(prefill.worker_id, exc.cause)
        except BaseException:
            # failed, or the request was cancelled (its client left, its timeout ran out):
            # both hops end before this does, and D's answer, had it come, is closed
            for task in (p_task, d_task):
                task.cancel()
            try:
                await wait_ended((p_task, d_task), errors_at=logging.DEBUG)
            finally:
                await _close_answer(d_task)
            raise
        if gave_up is not None:
            return await self._colocated(decode, req, headers, limits, gave_up)
        opened.workers = [prefill, decode]
        if p_task.done() and p_task.exception() is None:
            opened.transfer_s = p_task.result()
        else:
            opened.background.append(p_task)
        return opened

    # --- artifact fetch / state migration ---------------------------------------------------

    async def fetch(
        self,
        destination: WorkerState,
        source_id: str,
        req: CompletionRequest,
        fetch: FetchSpec | None,
    ) -> int:
        """Ask `destination` to pull the prefix from `source`, within the executor's
        `kv_transfer_timeout_s`: the blocks of it `destination` then holds, from the first (0
        on failure or when either has no KV API)."""
        failed, got = await self._fetch(
            destination, source_id, req, fetch, self.limits.kv_transfer_timeout_s
        )
        if failed is not None or fetch is None:
            return 0
        return len(fetch.block_hashes) if got is None else got

    async def _fetch(
        self,
        destination: WorkerState,
        source_id: str,
        req: CompletionRequest,
        fetch: FetchSpec | None,
        timeout_s: float,
    ) -> tuple[GaveUp | None, int | None]:
        """`fetch` within `timeout_s`: (None when it succeeded, else what was given up; the
        blocks `destination` says it holds then, when it says). A destination whose KV API
        cannot be reached is marked down (`WorkerState.kv_api_ok`) until its next probe."""
        failed = GaveUp(destination.worker_id, "kv_transfer_failed")
        source = self.pool.get(source_id)
        if source is None or fetch is None or not fetch.block_hashes:
            return failed, None
        base = destination.backend.kv_api_url(destination.address)
        source_url = source.backend.kv_api_url(source.address)
        if base is None or source_url is None:
            return failed, None
        n = len(fetch.block_hashes) * fetch.block_size
        body = KVFetchRequest(
            source_url=source_url,
            block_hashes=fetch.block_hashes,
            model=req.model,
            source_worker=source.worker_id,
            token_ids=tuple(fetch.token_ids[:n]),
            block_size=fetch.block_size,
        )
        try:
            status, answer, data = await self._kv_api_post(
                destination, base, FETCH_PATH, body.to_json(), timeout_s
            )
        except OSError as exc:
            log.warning("fetch %s -> %s failed: %r", source_id, destination.worker_id, exc)
            return GaveUp(destination.worker_id, cause_of(exc, "kv_transfer_failed")), None
        # a failed fetch may still say how many whole blocks it kept (the sidecar's 502)
        got = fetched_blocks(answer)
        if status != 200:
            log.warning(
                "fetch %s -> %s: status %s: %s",
                source_id, destination.worker_id, status, data[:200].decode(errors="replace"),
            )  # fmt: skip
            return failed, got
        if got is not None and got < len(fetch.block_hashes):
            log.info(
                "fetch %s -> %s: %d of %d blocks (the rest is recomputed)",
                source_id, destination.worker_id, got, len(fetch.block_hashes),
            )  # fmt: skip
        return None, got

    # --- chunk fetch (chunk reuse) -----------------------------------------------------------

    async def fetch_chunks(
        self,
        destination: WorkerState,
        chunks: ChunkFetchSpec,
        req: CompletionRequest,
        timeout_s: float,
    ) -> frozenset[int]:
        """Ask `destination`'s KV API to pull each holder's chunks from it (one request per
        holder, concurrently, each within `timeout_s`): the planned chunk hashes it says it
        holds afterwards. A holder that failed, or a KV API that cannot fetch chunks (a 4xx),
        gives none: those chunks are recomputed."""
        base = destination.backend.kv_api_url(destination.address)
        if base is None:
            return frozenset()
        results = await asyncio.gather(
            *(
                self._fetch_chunks(destination, base, source_id, hashes, req, timeout_s)
                for source_id, hashes in chunks.by_source
            )
        )
        return frozenset().union(*results)

    async def _fetch_chunks(
        self,
        destination: WorkerState,
        base: str,
        source_id: str,
        hashes: tuple[int, ...],
        req: CompletionRequest,
        timeout_s: float,
    ) -> frozenset[int]:
        source = self.pool.get(source_id)
        source_url = None if source is None else source.backend.kv_api_url(source.address)
        if source_url is None:
            return frozenset()
        body = KVChunkFetchRequest(source_url, hashes, req.model, source_id)
        try:
            status, answer, data = await self._kv_api_post(
                destination, base, CHUNK_FETCH_PATH, body.to_json(), timeout_s
            )
        except OSError as exc:
            log.warning("chunk fetch %s -> %s failed: %r", source_id, destination.worker_id, exc)
            return frozenset()
        if status != 200:
            log.info(
                "chunk fetch %s -> %s: status %s (the chunks are recomputed): %s",
                source_id, destination.worker_id, status, data[:200].decode(errors="replace"),
            )  # fmt: skip
            return frozenset()
        got = fetched_chunks(answer)
        return frozenset() if got is None else got.intersection(hashes)

    async def _kv_api_post(
        self,
        destination: WorkerState,
        base: str,
        path: str,
        body: Mapping[str, Any],
        timeout_s: float,
    ) -> tuple[int, object, bytes]:
        """POST `body` to `destination`'s KV API within `timeout_s` (a `kv_transfer` hop):
        (status, the decoded JSON answer or None, the raw answer). An `OSError` passes through;
        one that could not connect first marks the KV API down (`WorkerState.kv_api_ok`)
        until the pool's next probe."""
        try:
            # a connection not read whole is closed: that aborts the pull
            status, data = await self.http.call(
                base, b"POST", path, JSON_HEADER, orjson.dumps(body), ("kv_transfer", timeout_s)
            )
        except OSError as exc:
            if isinstance(exc, UpstreamConnectError):
                destination.kv_api_ok = False
            raise
        try:
            answer: object = orjson.loads(data)
        except orjson.JSONDecodeError:
            answer = None
        return status, answer, data
