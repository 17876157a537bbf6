"""The request path of the proxy: read and validate, identify the session, tokenize, look the
prefix up in the directory, plan, execute, stream, then commit ownership and calibrate.

`Router` holds everything one router process shares between requests (pool, directory, caches,
HTTP connection pool, telemetry); `handle_completion` is a raw ASGI handler so the hot path
pays for no framework layer.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from ownerserve.config import Settings
from ownerserve.directory.base import Directory, Match
from ownerserve.errors import (
    AuthenticationError,
    ConfigError,
    InvalidRequestError,
    ModelNotFoundError,
    NoWorkerAvailableError,
    OwnerServeError,
    PayloadTooLargeError,
    UpstreamError,
)
from ownerserve.profiles import load_profile
from ownerserve.tasks import cancel_and_wait
from ownerserve.types import BackendKind, Tier
from planner.calibration import Calibrator
from planner.types import Action, ClusterView, Plan, Policy, RequestView, WorkerView
from router.errors import error_status_and_body, sse_error_event
from router.executor import (
    FetchSpec,
    OpenedResponse,
    PlanExecutor,
    RetryableUpstreamError,
    UpstreamTimeoutError,
    forward_headers,
)
from router.links import NicLedger
from router.plans import PlanRecord, plan_header
from router.pool import WorkerPool
from router.requests import CompletionRequest, Endpoint, parse_request
from router.session import DerivedSessionCache, SessionKey, identify_session
from router.telemetry import Telemetry
from router.tokens import ModelTokenizer, TokenizationCache, Tokenized
from router.upstream import UpstreamPool

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

POLICY_HEADER = "x-ownerserve-policy"
PLAN_HEADER = b"x-ownerserve-plan"
REPLICA_TTL_S = 30.0
"""Lifetime of the record of the transient prefill-side copy after a remote prefill."""


class ObservedTimings:
    """What one request's timings were, for calibration (seconds)."""

    __slots__ = ("e2e_s", "output_events", "transfer_s", "ttft_s")

    def __init__(self) -> None:
        self.ttft_s: float | None = None
        self.e2e_s: float = 0.0
        self.transfer_s: float | None = None
        self.output_events = 0

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_events < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_events - 1)


@dataclass(slots=True)
class _SessionInfo:
    last_seen: float
    inflight: int = 0
    prompt_tokens: int = 0
    committed_at: float = -1e18
    """When the directory records of this session were last written in full."""


PolicyFactory = Callable[[str], Policy]


class _Disconnected(Exception):
    pass


class ResponseWriter:
    """Where one completion response goes. The router's own server (`router.httpserver`)
    writes to the socket; `_ASGIResponseWriter` turns the calls into ASGI messages. Tracks how
    far the response got, so a failure can end it properly."""

    __slots__ = ("disconnected", "ended", "sse", "started")

    def __init__(self) -> None:
        self.started = False
        self.ended = False
        self.sse = False
        self.disconnected = False
        """Set by the server when the client went away (the request task is cancelled)."""

    async def start(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes | None = None
    ) -> None:
        """Status and headers; with `body`, the whole response (its length is added)."""
        raise NotImplementedError

    async def write(self, chunk: bytes) -> None:
        """A piece of a streamed body."""
        raise NotImplementedError

    async def end(self) -> None:
        """End a streamed body."""
        raise NotImplementedError

    def detach(self) -> None:
        """Stop watching for the client's disconnect (what follows must not be cancelled)."""

    direct = False
    """True when `write_nowait`/`drain` work: chunks can be written from a callback."""

    def write_nowait(self, chunk: bytes) -> bool:
        """Write a piece of a streamed body now; True if the client is not keeping up (then
        `drain()` before writing more)."""
        raise NotImplementedError

    async def drain(self) -> None:
        """Wait until the client has taken enough of what was written."""

    async def fail(self, exc: BaseException) -> None:
        """End a response that already started: an SSE error event if it streams events."""
        if self.ended:
            return
        if self.sse:
            await self.write(sse_error_event(exc))
        await self.end()


class _ASGIResponseWriter(ResponseWriter):
    """A `ResponseWriter` over ASGI `send` (the app run by any ASGI server)."""

    __slots__ = ("_send", "watcher")

    def __init__(self, send: Send) -> None:
        super().__init__()
        self._send = send
        self.watcher: asyncio.Task[None] | None = None

    async def start(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes | None = None
    ) -> None:
        self.started = True
        if body is not None:
            headers = [*headers, (b"content-length", str(len(body)).encode())]
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        if body is not None:
            self.ended = True
            await self._send({"type": "http.response.body", "body": body})

    async def write(self, chunk: bytes) -> None:
        await self._send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def end(self) -> None:
        if not self.ended:
            self.ended = True
            await self._send({"type": "http.response.body", "body": b""})

    def detach(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()


async def read_body(receive: Receive, limit: int, content_length: str | None) -> bytes:
    """The request body, refusing more than `limit` bytes while reading (413)."""
    if content_length is not None:
        try:
            declared = int(content_length)
        except ValueError:
            declared = -1
        if declared > limit:
            raise PayloadTooLargeError(f"request body of {declared} bytes exceeds {limit}")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected()
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise PayloadTooLargeError(f"request body exceeds {limit} bytes")
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class Router:
    """Shared state of one router process."""

    def __init__(
        self,
        settings: Settings,
        *,
        directory: Directory | None = None,
        policy_factory: PolicyFactory | None = None,
        calibrator: Calibrator | None = None,
    ) -> None:
        self.settings = settings
        self.pool = WorkerPool(
            settings.workers,
            health_interval_s=settings.server.health_interval_s,
            health_timeout_s=settings.server.connect_timeout_s,
        )
        self.pool.on_worker_dead = self._on_worker_dead
        self.tokenizers = TokenizationCache(settings.models)
        self.telemetry = Telemetry(settings.telemetry)
        self.metrics = self.telemetry.metrics
        self.directory: Directory | None = directory
        self._owns_directory = directory is None
        self._policy_factory = policy_factory or _default_policy_factory(settings)
        self._policies: dict[str, Policy] = {}
        self.policy = self._policy(settings.planner.policy)
        self.calibrator = calibrator if calibrator is not None else Calibrator()
        # the KV transfers this router's plans queued on each node's NIC (T_network's backlog)
        self.nics = NicLedger()
        self.http: UpstreamPool | None = None
        self.executor: PlanExecutor | None = None
        self.recent_plans: deque[PlanRecord] = deque(maxlen=256)
        self._sessions: OrderedDict[str, _SessionInfo] = OrderedDict()
        self._derived_sessions = DerivedSessionCache()
        self._max_sessions = 65536
        self._background: set[asyncio.Task[Any]] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._subscribers: list[Any] = []
        self._started = False
        self._inline_commit = False
        self._start_lock = asyncio.Lock()
        self._api_keys = tuple(k.encode() for k in settings.server.api_keys)
        profile = load_profile(settings.planner.profile)
        self._kv_bytes_per_token = profile.kv_bytes_per_token
        self._intra_gbps = profile.link.intra_node_bps * 8 / 1e9
        self._inter_gbps = profile.link.inter_node_bps * 8 / 1e9

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return
        async with self._start_lock:
            if self._started:
                return
            if self.directory is None:
                from ownerserve.directory import open_directory

                self.directory = open_directory(self.settings.directory)
            from ownerserve.directory.memory import InMemoryDirectory

            self._inline_commit = type(self.directory) is InMemoryDirectory
            self.http = UpstreamPool(self.settings.server.connect_timeout_s)
            self.executor = PlanExecutor(self.pool, self.http, self.telemetry.start_span)
            for w in self.pool.all():
                await self._register(w.worker_id)
            await self.pool.start(self.http)
            if self.settings.directory.sweep_interval_s > 0:
                self._sweeper = asyncio.create_task(self._sweep_loop(), name="directory-sweep")
            self._started = True

    async def _sweep_loop(self) -> None:
        """Purge what expired from the directory every `directory.sweep_interval_s`: leases,
        replicas and sessions are never read once expired, but without this they would stay in
        memory (in-process) or in Redis for good. Router replicas sharing a Redis directory
        take turns: about one sweep per interval among them all."""
        interval = self.settings.directory.sweep_interval_s
        while True:
            await asyncio.sleep(interval)
            directory = self.directory
            if directory is None:
                continue
            try:
                self.metrics.swept.inc(await directory.sweep(min_interval_s=0.9 * interval))
            except Exception as exc:
                self.metrics.sweep_errors.inc()
                log.warning("directory sweep failed: %r", exc)

    async def close(self) -> None:
        await cancel_and_wait(self._sweeper)
        self._sweeper = None
        await self.pool.close()
        for sub in self._subscribers:
            with contextlib.suppress(Exception):
                await sub.close()
        self._subscribers.clear()
        for task in list(self._background):
            with contextlib.suppress(BaseException):
                async with asyncio.timeout(2.0):
                    await task
        if self.http is not None:
            await self.http.close()
            self.http = None
        if self.directory is not None and self._owns_directory:
            await self.directory.close()
        # exporters flush synchronously over HTTP: not on the event loop
        await asyncio.to_thread(self.telemetry.shutdown)
        self._started = False

    async def _register(self, worker_id: str) -> None:
        """Tell the directory the worker's chain root and block size; subscribe to its KV
        events when it publishes them."""
        state = self.pool.get(worker_id)
        if state is None or self.directory is None:
            return
        models = state.settings.models or tuple(m.name for m in self.settings.models)
        model = self.tokenizers.get(models[0]) if models else None
        if model is not None:
            try:
                await self.directory.register_worker(worker_id, model.root, model.block_size)
            except Exception as exc:
                # serve anyway; KV events of this worker cannot be mapped until it registers
                log.warning("worker %s: directory registration failed: %r", worker_id, exc)
        endpoint = state.settings.kv_events_endpoint
        if endpoint:
            from workers.adapters.vllm_events import KVEventSubscriber

            # vLLM binds wildcard and ipc:// endpoints and connects to host:port ones (then the
            # subscriber binds); the emulated engine binds its own (the subscriber connects)
            bind = (
                state.settings.kind is BackendKind.VLLM
                and endpoint.startswith("tcp://")
                and "*" not in endpoint
            )
            replay = state.settings.kv_events_replay_endpoint
            sub = KVEventSubscriber(
                worker_id, endpoint, self.directory, bind=bind, replay_endpoint=replay
            )
            try:
                await sub.start()
                self._subscribers.append(sub)
            except Exception:
                log.warning("worker %s: cannot subscribe to KV events at %s", worker_id, endpoint)

    async def add_worker(self, worker: Any) -> None:
        self.pool.add(worker)
        if self._started:
            await self._register(worker.id)
            state = self.pool.get(worker.id)
            if state is not None:
                await self.pool.check(state)

    async def remove_worker(self, worker_id: str) -> bool:
        state = self.pool.remove(worker_id)
        if state is None:
            return False
        for sub in [s for s in self._subscribers if s.worker == worker_id]:
            self._subscribers.remove(sub)
            with contextlib.suppress(Exception):
                await sub.close()
        if self.directory is not None:
            with contextlib.suppress(Exception):
                await self.directory.drop_worker(worker_id)
        return True

    async def _on_worker_dead(self, worker_id: str) -> None:
        self.calibrator.forget(worker_id)
        if self.directory is not None:
            await self.directory.drop_worker(worker_id)

    def _policy(self, name: str) -> Policy:
        policy = self._policies.get(name)
        if policy is None:
            try:
                policy = self._policy_factory(name)
            except ConfigError as exc:
                if not self._policies:
                    raise  # the configured default policy: a config error
                raise InvalidRequestError(f"unknown routing policy {name!r}") from exc
            self._policies[name] = policy
        return policy

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # --- views for the planner ------------------------------------------------------------

    def cluster_view(self, model: str, match: Match, excluded: set[str]) -> ClusterView:
        cached: dict[str, dict[Tier, int]] = {}
        for h in match.holdings:
            tiers = cached.setdefault(h.worker, {})
            if h.blocks > tiers.get(h.tier, 0):
                tiers[h.tier] = h.blocks
        now = time.monotonic()
        default_profile = self.settings.planner.profile
        views = []
        scales = self.calibrator.scales
        owner, session_owner = match.owner, match.session_owner
        nics = self.nics if self.nics else None  # most of the time no transfer is queued
        for w in self.pool.for_model(model):
            if w.worker_id in excluded or not w.routable(now):
                continue
            wid = w.worker_id
            sc = scales(wid)
            held = cached.get(wid)
            load = w.load
            # the view is rebuilt only when something it shows changed (a frozen dataclass of
            # 18 fields costs ~2 µs to build)
            key = (
                max(load.running, w.inflight),
                load.waiting,
                w.inflight_prefill_tokens,
                load.kv_usage,
                tuple(held.items()) if held else (),
                owner == wid,
                session_owner == wid,
                sc.prefill,
                sc.decode,
                sc.link,
                w.settings,
                0.0 if nics is None else nics.backlog(w.settings.node, now),
            )
            last = w.view_cache
            if last is not None and last[0] == key:
                views.append(last[1])
                continue
            view = WorkerView(
                worker_id=wid,
                role=w.settings.role,
                kind=w.settings.kind,
                profile=w.settings.profile or default_profile,
                running=key[0],
                waiting=load.waiting,
                inflight_prefill_tokens=w.inflight_prefill_tokens,
                kv_usage=load.kv_usage,
                cached_blocks=held or {},
                is_owner=key[5],
                is_session_owner=key[6],
                node=w.settings.node,
                prefill_scale=sc.prefill,
                decode_scale=sc.decode,
                link_scale=sc.link,
                nic_backlog_s=key[11],
            )
            w.view_cache = (key, view)
            views.append(view)
        return ClusterView(
            tuple(views), intra_node_gbps=self._intra_gbps, inter_node_gbps=self._inter_gbps
        )

    def request_view(
        self,
        req: CompletionRequest,
        tok: Tokenized,
        block_size: int,
        session: SessionKey,
        match: Match,
        info: _SessionInfo | None,
        is_fork: bool,
        policy_override: str | None,
    ) -> RequestView:
        now = time.monotonic()
        return RequestView(
            model=req.model,
            prompt_tokens=tok.prompt_tokens,
            block_size=block_size,
            chain_blocks=len(tok.chain),
            max_tokens=req.max_tokens,
            session_id=session.session_id,
            session_owner=match.session_owner,
            owner=match.owner,
            owner_blocks=match.owner_blocks,
            previous_prompt_tokens=info.prompt_tokens if info else 0,
            idle_s=(now - info.last_seen) if info else 0.0,
            n=req.n,
            is_fork=is_fork,
            kv_bytes_per_token=self._kv_bytes_per_token,
            policy_override=policy_override,
        )

    # --- the request path -----------------------------------------------------------------

    def _check_auth(self, headers: Mapping[str, str]) -> None:
        if not self._api_keys:
            return
        auth = headers.get("authorization", "")
        key = auth[7:].strip().encode() if auth[:7].lower() == "bearer " else b""
        ok = False
        for k in self._api_keys:
            ok |= hmac.compare_digest(key, k)
        if not ok:
            raise AuthenticationError("missing or invalid API key")

    async def handle_completion(
        self, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint
    ) -> None:
        """ASGI handler of `/v1/chat/completions` and `/v1/completions` (the app under any
        ASGI server; the router's own server calls `respond` directly)."""
        t0 = time.perf_counter()
        out = _ASGIResponseWriter(send)
        task = asyncio.current_task()
        raw_headers: list[tuple[bytes, bytes]] = scope["headers"]

        async def read() -> bytes:
            length = None
            for k, v in raw_headers:
                if k == b"content-length":
                    length = v.decode("latin-1")
            body = await read_body(receive, self.settings.server.max_body_bytes, length)
            out.watcher = asyncio.create_task(self._watch_disconnect(receive, task, out))
            return body

        try:
            await self.respond(endpoint, raw_headers, out, t0, read=read)
        finally:
            out.detach()

    async def respond(
        self,
        endpoint: Endpoint,
        raw_headers: list[tuple[bytes, bytes]],
        out: ResponseWriter,
        t0: float,
        *,
        body: bytes | None = None,
        read: Callable[[], Awaitable[bytes]] | None = None,
    ) -> None:
        """Serve one completion request: `body` already read, or `read()` reads it (after the
        API key check). Every failure becomes an OpenAI error response, or an SSE error event
        when the response already started; a client disconnect ends it quietly."""
        if not self._started:
            await self.start()
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw_headers}
        model = "?"
        try:
            self._check_auth(headers)
            if body is None:
                assert read is not None
                body = await read()
            req = parse_request(body, endpoint)
            # a metric label only for configured models (client input must not grow labels)
            model = req.model if req.model in self.tokenizers else "unknown"
            async with asyncio.timeout(self.settings.server.request_timeout_s):
                await self._serve(req, headers, raw_headers, out, t0)
            self.metrics.of(self.metrics.requests, model, "ok").inc()
        except _Disconnected:
            return
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if out.disconnected and task is not None:
                task.uncancel()
                self.metrics.of(self.metrics.requests, model, "client_disconnected").inc()
                return
            raise
        except BaseException as exc:
            out.detach()  # what follows must not be cancelled by a late disconnect
            if isinstance(exc, TimeoutError):
                exc = UpstreamTimeoutError("request timed out")
            if not isinstance(exc, Exception):
                raise
            status, err = error_status_and_body(exc)
            self.metrics.of(self.metrics.requests, model, str(status)).inc()
            if out.started:
                await out.fail(exc)
                return
            await out.start(status, [(b"content-type", b"application/json")], err)

    @staticmethod
    async def _watch_disconnect(
        receive: Receive, task: asyncio.Task[Any] | None, out: ResponseWriter
    ) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                out.disconnected = True
                if task is not None:
                    task.cancel()
                return

    async def _serve(
        self,
        req: CompletionRequest,
        headers: Mapping[str, str],
        raw_headers: list[tuple[bytes, bytes]],
        out: ResponseWriter,
        t0: float,
    ) -> None:
        """Route and stream one request."""
        tel = self.telemetry
        mt = self.tokenizers.get(req.model)
        if mt is None or not self.pool.for_model(req.model):
            raise ModelNotFoundError(f"The model '{req.model}' does not exist")
        assert self.directory is not None and self.executor is not None
        ctx = tel.extract(headers)
        with tel.start_span("ownerserve.request", context=ctx, model=req.model):
            with tel.start_span("ownerserve.tokenize"):
                session, tok = self._tokenize(mt, req, headers)
            sid = session.session_id
            info = self._sessions.get(sid) if sid else None
            is_fork = req.n > 1 or (
                info is not None
                and (info.inflight > 0 or (tok.previous_chain_len > 0 and not tok.extends_previous))
            )
            with tel.start_span("ownerserve.directory.lookup", blocks=len(tok.chain)):
                match = await self._lookup(tok.chain, sid)
            override = None
            if self.settings.planner.allow_policy_header:
                override = headers.get(POLICY_HEADER)
            policy = self._policy(override) if override else self.policy
            rview = self.request_view(
                req, tok, mt.block_size, session, match, info, is_fork, override
            )
            if sid:
                info = self._touch_session(sid, tok.prompt_tokens)
                info.inflight += 1
            try:
                await self._plan_and_stream(
                    req, raw_headers, out, t0, mt, tok, session, match, rview, policy
                )
            finally:
                if sid and info is not None:
                    info.inflight -= 1

    async def _lookup(self, chain: tuple[int, ...], session_id: str | None) -> Match:
        """The directory's answer; without one (backend down and no local view) the request
        is still routed, as if nothing were cached anywhere."""
        assert self.directory is not None
        try:
            return await self.directory.lookup(chain, session_id)
        except Exception as exc:
            self.metrics.directory_errors.inc()
            log.warning("directory lookup failed, routing without it: %r", exc)
            return Match(chain_len=len(chain))

    def _tokenize(
        self, mt: ModelTokenizer, req: CompletionRequest, headers: Mapping[str, str]
    ) -> tuple[SessionKey, Tokenized]:
        if req.endpoint is Endpoint.CHAT:
            session = identify_session(
                headers, req.body, req.model, req.messages, derived=self._derived_sessions
            )
            tok = mt.tokenize_chat(session.session_id, req.messages, req.body.get("tools"))
            return session, tok
        session = identify_session(headers, req.body, req.model, None)
        if session.session_id is None:
            tok = mt.tokenize_prompt(None, req.body.get("prompt"))
            session = identify_session(headers, req.body, req.model, None, tok.chain)
            if session.session_id is not None:
                # seed the session's cache for its next turn
                mt.tokenize_prompt(session.session_id, req.body.get("prompt"))
            return session, tok
        return session, mt.tokenize_prompt(session.session_id, req.body.get("prompt"))

    def _touch_session(self, sid: str, prompt_tokens: int) -> _SessionInfo:
        info = self._sessions.get(sid)
        now = time.monotonic()
        if info is None:
            info = _SessionInfo(last_seen=now)
            self._sessions[sid] = info
            if len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        else:
            self._sessions.move_to_end(sid)
        info.last_seen = now
        info.prompt_tokens = prompt_tokens
        return info

    async def _plan_and_stream(
        self,
        req: CompletionRequest,
        raw_headers: list[tuple[bytes, bytes]],
        out: ResponseWriter,
        t0: float,
        mt: ModelTokenizer,
        tok: Tokenized,
        session: SessionKey,
        match: Match,
        rview: RequestView,
        policy: Policy,
    ) -> None:
        tel = self.telemetry
        metrics = self.metrics
        assert self.executor is not None
        excluded: set[str] = set()
        trace: dict[str, str] = {}
        tel.inject(trace)
        out_headers = forward_headers(raw_headers, bool(self._api_keys), trace)
        retries = self.settings.server.retries
        opened: OpenedResponse | None = None
        plan: Plan | None = None
        last_error: RetryableUpstreamError | None = None
        for attempt in range(retries + 1):
            cluster = self.cluster_view(req.model, match, excluded)
            if not cluster.workers:
                break
            with tel.start_span("ownerserve.plan", attempt=attempt):
                plan = policy.plan(rview, cluster)
            nic = self._queue_transfer(plan)
            fetch = self._fetch_spec(plan, match, tok, mt.block_size)
            involved = self._involved(plan)
            for w in involved:
                w.inflight += 1
            prefill_worker = self.pool.get(plan.chosen.prefill_worker)
            if prefill_worker is not None:
                prefill_worker.inflight_prefill_tokens += tok.prompt_tokens
            if attempt == 0:
                metrics.overhead.observe(time.perf_counter() - t0)
            try:
                with tel.start_span(
                    "ownerserve.upstream",
                    action=plan.action.value,
                    prefill=plan.chosen.prefill_worker,
                    decode=plan.chosen.decode_worker,
                ):
                    opened = await self.executor.open_plan(plan, req, out_headers, fetch)
                if opened.fetched is not False:
                    nic = None  # opened: its KV moves (or has moved); a failed fetch moved none
            except RetryableUpstreamError as exc:
                last_error = exc
                excluded.add(exc.worker)
                failed = self.pool.get(exc.worker)
                if failed is not None:
                    failed.breaker.record_failure()
                    metrics.breaker.labels(exc.worker).set(int(failed.breaker.state))
                metrics.retries.labels(exc.worker, "before_first_byte").inc()
                log.warning("retrying without %s: %s", exc.worker, exc.reason)
                continue
            finally:
                if nic is not None:  # the plan failed before it opened: its KV never moved
                    self.nics.release(nic[0], nic[1], time.monotonic())
                for w in involved:
                    w.inflight -= 1
                if prefill_worker is not None:
                    prefill_worker.inflight_prefill_tokens -= tok.prompt_tokens
            break
        if opened is None or plan is None:
            if last_error is not None:
                raise UpstreamError(f"no worker could serve the request: {last_error}")
            raise NoWorkerAvailableError(f"no healthy worker serves model '{req.model}'")
        await self._stream(req, out, t0, tok, session, match, rview, plan, opened)

    def _queue_transfer(self, plan: Plan) -> tuple[str, float] | None:
        """Queue the plan's inter-node KV transfer on its source node's NIC (`t_nic` seconds:
        P for a remote prefill, the source for a fetch or migration); (node, seconds) or None."""
        c = plan.chosen
        seconds = c.cost.t_nic
        if seconds <= 0:
            return None
        src = c.prefill_worker if c.action is Action.REMOTE_PREFILL else c.source_worker
        state = self.pool.get(src) if src else None
        if state is None:
            return None
        node = state.settings.node
        self.nics.reserve(node, seconds, time.monotonic())
        return node, seconds

    def _involved(self, plan: Plan) -> list[Any]:
        ids = {plan.chosen.prefill_worker, plan.chosen.decode_worker}
        return [w for w in (self.pool.get(i) for i in ids if i) if w is not None]

    @staticmethod
    def _fetch_spec(plan: Plan, match: Match, tok: Tokenized, block_size: int) -> FetchSpec | None:
        src = plan.chosen.source_worker
        if plan.action not in (Action.ARTIFACT_FETCH, Action.STATE_MIGRATION) or not src:
            return None
        blocks = plan.chosen.reused_blocks or match.longest(src)
        blocks = min(blocks or len(tok.chain), len(tok.chain))
        return FetchSpec(tuple(tok.chain[:blocks]), tok.token_ids, block_size)

    async def _stream(
        self,
        req: CompletionRequest,
        out: ResponseWriter,
        t0: float,
        tok: Tokenized,
        session: SessionKey,
        match: Match,
        rview: RequestView,
        plan: Plan,
        opened: OpenedResponse,
    ) -> None:
        metrics = self.metrics
        timings = ObservedTimings()
        timings.transfer_s = opened.transfer_s
        worker = opened.final_worker
        worker.breaker.record_success()
        for w in opened.workers:
            w.inflight += 1
        ok = opened.status == 200
        self.recent_plans.append(PlanRecord.of(plan, session.session_id, opened.fetched))
        streaming = req.stream and ok
        try:
            resp_headers = [
                (b"content-type", opened.content_type),
                (PLAN_HEADER, plan_header(plan, opened.fetched)),
            ]
            out.sse = streaming and opened.content_type.startswith(b"text/event-stream")
            if not streaming:
                # a non-streamed answer arrives whole: no TTFT/TPOT to learn from
                if ok:
                    await self._after_first_bytes(plan, tok, session, match, req, rview)
                await out.start(opened.status, resp_headers, opened.first)
            else:
                await out.start(opened.status, resp_headers)
                timings.ttft_s = time.perf_counter() - t0
                events = opened.first.count(b"data: ")
                await out.write(opened.first)
                await self._after_first_bytes(plan, tok, session, match, req, rview)
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
                    metrics.stream_errors.labels(worker.worker_id).inc()
                    log.warning("worker %s failed mid-stream: %r", worker.worker_id, exc)
                    err = UpstreamError(f"worker {worker.worker_id} failed mid-stream")
                    await out.write(sse_error_event(err))
                    worker.breaker.record_failure()
                    self._spawn(self.pool.check(worker))
                timings.output_events = max(0, events - 1)
                await out.end()
        finally:
            for w in opened.workers:
                w.inflight -= 1
            await opened.aclose()
        timings.e2e_s = time.perf_counter() - t0
        self._observe(plan, rview, match, timings, ok)

    async def _after_first_bytes(
        self,
        plan: Plan,
        tok: Tokenized,
        session: SessionKey,
        match: Match,
        req: CompletionRequest,
        rview: RequestView,
    ) -> None:
        """The answer is there: commit ownership (inline with the in-process directory, whose
        calls never wait, so a client's next turn always sees it; concurrently with the
        response otherwise) and start a replica copy if the plan asked for one."""
        if self._inline_commit:
            await self._commit(plan, tok, session, match, rview)
        else:
            self._spawn(self._commit(plan, tok, session, match, rview))
        if plan.add_replica_on and match.owner and match.owner_blocks:
            self._spawn(self._replicate(plan.add_replica_on, match, req, tok, rview))

    def _observe(
        self, plan: Plan, rview: RequestView, match: Match, t: ObservedTimings, ok: bool
    ) -> None:
        m = self.metrics
        action = plan.action.value
        m.of(m.actions, plan.policy, action).inc()
        if match.owner is not None:
            used = match.owner in (plan.chosen.decode_worker, plan.chosen.source_worker)
            m.of(m.owner_lookups, "hit" if used else "miss").inc()
        else:
            m.of(m.owner_lookups, "none").inc()
        if not ok:
            return
        if t.ttft_s is not None:
            m.of(m.ttft, action).observe(t.ttft_s)
        tpot = t.tpot_s
        if tpot is not None:
            m.of(m.tpot, action).observe(tpot)
        m.of(m.e2e, action).observe(t.e2e_s)
        if t.transfer_s is not None:
            m.of(m.transfer, action).observe(t.transfer_s)
        self.calibrator.observe_plan(plan, ttft_s=t.ttft_s, tpot_s=tpot, transfer_s=t.transfer_s)

    # --- after the response: commit to the directory --------------------------------------

    async def _replicate(
        self,
        target: str,
        match: Match,
        req: CompletionRequest,
        tok: Tokenized,
        rview: RequestView,
    ) -> None:
        """The hot-spot rule (mission 3.11): the plan asked for a read-only replica of the
        owner's prefix on `target`; copy it there and record it."""
        worker = self.pool.get(target)
        owner = match.owner
        if worker is None or owner is None or self.executor is None or self.directory is None:
            return
        blocks = min(match.owner_blocks, len(tok.chain))
        spec = FetchSpec(tuple(tok.chain[:blocks]), tok.token_ids, rview.block_size)
        with self.telemetry.start_span("ownerserve.transfer", source=owner, to=target):
            ok = await self.executor.fetch(worker, owner, req, spec)
        if ok:
            await self.directory.add_replica(
                tok.chain[blocks - 1], target, Tier.GPU, self.settings.directory.lease_s,
                True, tok.chain[:blocks],
            )  # fmt: skip

    async def _commit(
        self, plan: Plan, tok: Tokenized, session: SessionKey, match: Match, rview: RequestView
    ) -> None:
        """The decode worker now holds the prompt's KV: it owns the newly sealed blocks, it is
        the session's decode owner, and a remote prefill left a transient copy on P."""
        directory = self.directory
        if directory is None:
            return
        from router.commit import commit_plan

        # rewrite unchanged records (session owner, leases, replicas) only every quarter of
        # their lifetime; what changed is always written
        refresh = True
        info = self._sessions.get(session.session_id) if session.session_id else None
        if info is not None:
            now = time.monotonic()
            period = min(self.settings.directory.lease_s, self.settings.directory.session_ttl_s)
            refresh = now - info.committed_at >= period / 4
            if refresh:
                info.committed_at = now
        try:
            with self.telemetry.start_span("ownerserve.directory.commit"):
                await commit_plan(
                    directory,
                    plan,
                    tok.chain,
                    session.session_id,
                    match,
                    lease_s=self.settings.directory.lease_s,
                    session_ttl_s=self.settings.directory.session_ttl_s,
                    replica_ttl_s=REPLICA_TTL_S,
                    kv_bytes_per_block=self._kv_bytes_per_token * rview.block_size,
                    fork_from_blocks=tok.common_blocks if rview.is_fork else 0,
                    refresh=refresh,
                    concurrent=not self._inline_commit,
                )
        except OwnerServeError as exc:
            self.metrics.commit_errors.inc()
            log.warning("directory commit failed: %s", exc)
        except Exception:
            self.metrics.commit_errors.inc()
            log.exception("directory commit failed")


def _default_policy_factory(settings: Settings) -> PolicyFactory:
    """Policies from `planner.policies`, sharing one cost model (profiles loaded once)."""
    from dataclasses import replace

    from planner.cost import CostConfig, CostModel
    from planner.policies import get_policy

    # the served model's KV spec turns on HeteroCache restore planning for cold (CPU/SSD) hits;
    # one planner serves the deployment, so it takes the spec of a single-model deployment
    kv_spec = settings.models[0].kv_spec if len(settings.models) == 1 else None
    config = CostConfig.from_settings(settings.planner, kv_spec=kv_spec)
    profiles = tuple(sorted({w.profile for w in settings.workers if w.profile}))
    if profiles:
        config = replace(config, profiles=profiles)
    model = CostModel(config)

    def factory(name: str) -> Policy:
        return get_policy(name, config, model)

    return factory
