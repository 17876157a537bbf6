"""Plan execution: turn the planner's `Plan` into calls on the workers' own protocols.

Every action ends in one *final* upstream response whose bytes stream to the client:
- colocated prefill, decode continuation, tail recompute: one call to the chosen worker;
- remote prefill: the prefill worker's backend builds both bodies, and its `PDHandoff` sets
  the order: P first, then D with what P's answer hands over (vLLM's `kv_transfer_params`), or
  both at once meeting at a room on P (SGLang's bootstrap room);
- artifact fetch and state migration: ask the destination's worker-side KV API (where its
  backend says) to pull the prefix from the source, then one call there (a failed fetch
  degrades to recomputing).

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
from typing import Any

import orjson

from ownerserve.errors import UpstreamError
from ownerserve.kvfetch import FETCH_PATH, KVFetchRequest
from ownerserve.records import fast_init
from planner.types import Action, Plan
from router.backends import PDHandoff
from router.pool import WorkerPool, WorkerState
from router.requests import CompletionRequest
from router.upstream import UpstreamPool, UpstreamResponse, header_block

log = logging.getLogger(__name__)


class RetryableUpstreamError(UpstreamError):
    """A worker failed before any byte reached the client: try again without it."""

    def __init__(self, worker: str, reason: str) -> None:
        super().__init__(f"worker {worker}: {reason}")
        self.worker = worker
        self.reason = reason


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
    finished: bool = False

    async def aclose(self) -> None:
        """Release the connection (or abort it if the body was not fully read: that cancels
        the worker's generation) and cancel background upstream calls."""
        if self.response is not None:
            if self.finished:
                self.response.release()
            else:
                self.response.close()
        for task in self.background:
            if not task.done():
                task.cancel()
        for task in self.background:
            with contextlib.suppress(BaseException):
                await task
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


def forward_headers(
    client_headers: list[tuple[bytes, bytes]], strip_auth: bool, extra: Mapping[str, str]
) -> bytes:
    """Header lines for the worker: the client's (all but hop-by-hop ones; the router's own
    API key is not forwarded when the router checks keys) plus `extra` (trace context)."""
    skip = _HOP_BYTES_AUTH if strip_auth else _HOP_BYTES
    lines = [b"%s: %s\r\n" % (k, v) for k, v in client_headers if k.lower() not in skip]
    lines.append(b"content-type: application/json\r\n")
    if extra:
        lines.append(header_block(extra))
    return b"".join(lines)


_JSON_HEADER = b"content-type: application/json\r\n"
_HOP_BYTES = frozenset(h.encode() for h in _HOP_HEADERS) | {b"content-type"}
_HOP_BYTES_AUTH = _HOP_BYTES | {b"authorization"}


class PlanExecutor:
    """Runs plans against the pool's workers over one shared HTTP connection pool."""

    def __init__(
        self,
        pool: WorkerPool,
        http: UpstreamPool,
        span: Callable[..., Any] | None = None,
    ) -> None:
        self.pool = pool
        self.http = http
        self.span = span or (lambda *_a, **_k: contextlib.nullcontext())

    def _worker(self, worker_id: str | None) -> WorkerState:
        state = self.pool.get(worker_id) if worker_id else None
        if state is None:
            raise RetryableUpstreamError(str(worker_id), "not in the pool")
        return state

    async def _post(
        self, worker: WorkerState, path: str, body: bytes, headers: bytes
    ) -> UpstreamResponse:
        worker.breaker.on_attempt()
        try:
            resp = await self.http.request(worker.address.url, b"POST", path, headers, body)
        except OSError as exc:
            raise RetryableUpstreamError(worker.worker_id, f"connect failed: {exc}") from None
        except TimeoutError:
            raise RetryableUpstreamError(worker.worker_id, "connect timed out") from None
        if resp.status >= 500:
            with contextlib.suppress(Exception):
                await resp.read()
            resp.release()
            raise RetryableUpstreamError(worker.worker_id, f"status {resp.status}")
        return resp

    async def _first_bytes(
        self, worker: WorkerState, resp: UpstreamResponse, stream: bool
    ) -> bytes:
        try:
            if stream and resp.status == 200:
                return await resp.readany()
            return await resp.read()
        except OSError as exc:
            resp.close()
            raise RetryableUpstreamError(
                worker.worker_id, f"failed before the first byte: {exc!r}"
            ) from None

    async def _final_call(
        self,
        worker: WorkerState,
        req: CompletionRequest,
        body: bytes,
        headers: bytes,
    ) -> OpenedResponse:
        with self.span("ownerserve.upstream.call", worker=worker.worker_id):
            resp = await self._post(worker, req.endpoint.value, body, headers)
            first = await self._first_bytes(worker, resp, req.stream)
        streaming = req.stream and resp.status == 200
        if not streaming:
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

    async def open_plan(
        self,
        plan: Plan,
        req: CompletionRequest,
        headers: bytes,
        fetch: FetchSpec | None = None,
    ) -> OpenedResponse:
        """Execute `plan` up to the final response's first bytes."""
        chosen = plan.chosen
        decode = self._worker(chosen.decode_worker)
        action = chosen.action
        if action is Action.REMOTE_PREFILL and chosen.prefill_worker != chosen.decode_worker:
            prefill = self._worker(chosen.prefill_worker)
            if prefill.backend.pd_handoff is PDHandoff.RENDEZVOUS:
                return await self._pd_rendezvous(prefill, decode, req, headers)
            return await self._pd_after_prefill(prefill, decode, req, headers)
        fetched: bool | None = None
        transfer_s: float | None = None
        if action in (Action.ARTIFACT_FETCH, Action.STATE_MIGRATION) and chosen.source_worker:
            t = time.perf_counter()
            with self.span("ownerserve.transfer", source=chosen.source_worker, to=decode.worker_id):
                fetched = await self.fetch(decode, chosen.source_worker, req, fetch)
            transfer_s = time.perf_counter() - t
        opened = await self._final_call(decode, req, req.raw, headers)
        opened.fetched = fetched
        opened.transfer_s = transfer_s
        return opened

    # --- remote prefill, D after P's answer (vLLM's protocol) -------------------------------

    async def _pd_after_prefill(
        self,
        prefill: WorkerState,
        decode: WorkerState,
        req: CompletionRequest,
        headers: bytes,
    ) -> OpenedResponse:
        backend = prefill.backend
        t = time.perf_counter()
        try:
            p_json = backend.prefill_body(req.body, prefill.address)
        except ValueError as exc:
            raise RetryableUpstreamError(prefill.worker_id, str(exc)) from None
        p_body = orjson.dumps(p_json)
        with self.span("ownerserve.transfer", protocol="vllm", prefill=prefill.worker_id):
            resp = await self._post(prefill, req.endpoint.value, p_body, headers)
            try:
                data = await resp.read()
            except OSError as exc:
                resp.close()
                raise RetryableUpstreamError(
                    prefill.worker_id, f"prefill failed: {exc!r}"
                ) from None
            finally:
                resp.release()
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
            d_json = backend.decode_body(req.body, p_json, orjson.loads(data))
        except (orjson.JSONDecodeError, UpstreamError) as exc:
            raise RetryableUpstreamError(prefill.worker_id, str(exc)) from None
        d_body = orjson.dumps(d_json)
        transfer_s = time.perf_counter() - t
        opened = await self._final_call(decode, req, d_body, headers)
        opened.transfer_s = transfer_s
        opened.workers = [prefill, decode]
        return opened

    # --- remote prefill, P and D at once (SGLang's protocol) --------------------------------

    async def _pd_rendezvous(
        self,
        prefill: WorkerState,
        decode: WorkerState,
        req: CompletionRequest,
        headers: bytes,
    ) -> OpenedResponse:
        backend = prefill.backend
        try:
            p_json = backend.prefill_body(req.body, prefill.address)
        except ValueError as exc:
            raise RetryableUpstreamError(prefill.worker_id, str(exc)) from None
        d_bytes = orjson.dumps(backend.decode_body(req.body, p_json, None))
        t = time.perf_counter()
        p_bytes = orjson.dumps(p_json)

        async def run_prefill() -> float:
            with self.span("ownerserve.transfer", protocol="sglang", prefill=prefill.worker_id):
                resp = await self._post(prefill, req.endpoint.value, p_bytes, headers)
                try:
                    await resp.read()
                except OSError as exc:
                    raise RetryableUpstreamError(prefill.worker_id, f"prefill: {exc!r}") from None
                finally:
                    resp.release()
            if resp.status != 200:
                raise RetryableUpstreamError(prefill.worker_id, f"prefill status {resp.status}")
            return time.perf_counter() - t

        p_task = asyncio.create_task(run_prefill())
        d_task = asyncio.create_task(self._final_call(decode, req, d_bytes, headers))
        try:
            done, _ = await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
            if p_task in done and p_task.exception() is not None and not d_task.done():
                d_task.cancel()
                with contextlib.suppress(BaseException):
                    await d_task
                raise p_task.exception()  # type: ignore[misc]
            opened = await d_task
        except BaseException:
            for task in (p_task, d_task):
                task.cancel()
            if d_task.done() and not d_task.cancelled() and d_task.exception() is None:
                await d_task.result().aclose()
            with contextlib.suppress(BaseException):
                await p_task
            raise
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
    ) -> bool:
        """Ask `destination` to pull the prefix from `source`; False (recompute) on failure or
        when either has no KV API."""
        source = self.pool.get(source_id)
        if source is None or fetch is None or not fetch.block_hashes:
            return False
        base = destination.backend.kv_api_url(destination.address)
        source_url = source.backend.kv_api_url(source.address)
        if base is None or source_url is None:
            return False
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
            resp = await self.http.request(
                base, b"POST", FETCH_PATH, _JSON_HEADER, orjson.dumps(body.to_json())
            )
            await resp.read()
            resp.release()
            ok = resp.status == 200
        except (OSError, TimeoutError) as exc:
            log.warning("fetch %s -> %s failed: %r", source_id, destination.worker_id, exc)
            return False
        if not ok:
            log.warning("fetch %s -> %s: status %s", source_id, destination.worker_id, resp.status)
        return ok
