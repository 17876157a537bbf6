"""One completion request as a pipeline of named stages over its `RequestContext`:

    parse -> identify -> tokenize (-> chunk) -> admit (admission.py) -> look_up -> view
          -> (plan -> execute, retried) -> stream (streaming.py) -> commit, observe (aftermath.py)

`respond` runs them for one request and turns every failure into an OpenAI error (or an SSE
error event once the response started). Each stage is a function of the context, so a bench
or a test can run any of them alone (`bench/router_overhead/stages.py` times them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import orjson

from ownerserve.chunks import PARAMS_KEY as CHUNK_PARAMS_KEY
from ownerserve.chunks import ChunkedPrompt, layout_params
from ownerserve.directory.base import Match
from ownerserve.errors import (
    ClientDisconnected,
    ModelNotFoundError,
    NoWorkerAvailableError,
    RateLimitError,
    UpstreamError,
)
from ownerserve.http import error_status_and_body
from ownerserve.types import Tier
from planner.types import Action, Candidate, CostBreakdown, Plan, Policy, RequestView
from router.admission import WorkingSet, record_service
from router.chunk_prefill import ChunkPrefillOutcome, prefill_chunks
from router.executor import (
    ChunkFetchSpec,
    FetchSpec,
    OpenedResponse,
    RetryableUpstreamError,
    UpstreamTimeoutError,
    forward_headers,
)
from router.inflight import hold, hold_session, kv_ended, kv_started, release, release_session
from router.plans import Fallback, GaveUp, Ran
from router.pool import WorkerState
from router.requests import CompletionRequest, Endpoint, parse_request
from router.session import SessionInfo, SessionKey, chain_session, identify_session
from router.streaming import stream
from router.tokens import ModelTokenizer, Tokenized
from router.views import cluster_view, request_view
from router.writer import ResponseWriter

if TYPE_CHECKING:
    from router.state import Router

log = logging.getLogger(__name__)

POLICY_HEADER = "x-ownerserve-policy"
NOT_A_WORKER_FAILURE = frozenset({"kv_fetch_empty"})
"""`GaveUp` reasons that say nothing of the worker's health (its breaker is left alone)."""

_NONE_EXCLUDED: frozenset[str] = frozenset()
_NO_HOLDERS: dict[str, tuple[int, ...]] = {}


class RequestContext:
    """One request's state, filled in stage by stage (a field is set by the stage that
    computes it and read only by later ones)."""

    __slots__ = (
        "charged",
        "chunk_holders",
        "chunks",
        "e2e_s",
        "endpoint",
        "excluded",
        "fallback",
        "headers",
        "held",
        "held_kv",
        "held_prefill",
        "info",
        "is_fork",
        "kv_counted",
        "match",
        "model_label",
        "mt",
        "opened",
        "out",
        "output_events",
        "plan",
        "planned",
        "policy",
        "queued_s",
        "raw_headers",
        "refresh",
        "req",
        "router",
        "rview",
        "session",
        "t0",
        "tok",
        "transfer_s",
        "ttft_s",
    )

    # set by parse
    req: CompletionRequest
    mt: ModelTokenizer
    # by identify and tokenize
    session: SessionKey
    tok: Tokenized
    info: SessionInfo | None
    is_fork: bool
    chunks: ChunkedPrompt | None
    # by look_up
    chunk_holders: dict[str, tuple[int, ...]]
    # by look_up and view
    match: Match
    policy: Policy
    rview: RequestView
    # by plan, execute and commit
    plan: Plan
    refresh: bool

    def __init__(
        self,
        router: Router,
        endpoint: Endpoint,
        raw_headers: list[tuple[bytes, bytes]],
        out: ResponseWriter,
        t0: float,
    ) -> None:
        self.router = router
        self.endpoint = endpoint
        self.raw_headers = raw_headers
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw_headers}
        self.out = out
        self.t0 = t0
        """`time.perf_counter()` when the request's bytes arrived."""
        self.model_label = "?"
        """The model as a metric label: only configured models (client input must not grow
        labels)."""
        self.excluded: Collection[str] = _NONE_EXCLUDED
        """Workers that failed this request before its first byte."""
        self.fallback: Fallback | None = None
        """What ran instead of the plan, when hops were given up before the first byte."""
        self.planned: Plan | None = None
        """The plan as the policy made it, when what ran (`plan`) differs: a P/D hand-over
        or fetch given up, run colocated on its decode worker."""
        self.opened: OpenedResponse | None = None
        self.held: Sequence[WorkerState] = ()
        self.held_prefill: WorkerState | None = None
        self.held_kv: WorkerState | None = None
        self.charged: WorkingSet | None = None
        """The working set the request's prompt counts in (`router.inflight`)."""
        self.kv_counted = False
        """Its session's KV is counted in its decode worker's working set (`kv_started`)."""
        self.queued_s = 0.0
        """Seconds it waited in the admission queue."""
        self.ttft_s: float | None = None
        self.e2e_s = 0.0
        self.transfer_s: float | None = None
        self.output_events = 0
        self.chunks = None
        """The prompt's chunks when its model has chunk reuse on and it has some (`chunk`)."""
        self.chunk_holders = _NO_HOLDERS
        """Per worker, the chunks (indices into `chunks.chunks`) the directory says it holds."""

    # what the directory commit reads (`router.commit.Served`)

    @property
    def chain(self) -> tuple[int, ...]:
        return self.tok.chain

    @property
    def session_id(self) -> str | None:
        return self.session.session_id

    @property
    def fork_from_blocks(self) -> int:
        return self.tok.common_blocks if self.rview.is_fork else 0

    @property
    def kv_bytes_per_block(self) -> int:
        return self.router.kv_bytes_per_token * self.rview.block_size

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output event after the first (None without two of them)."""
        if self.ttft_s is None or self.output_events < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_events - 1)


# --- the stages, in order ---------------------------------------------------------------------


def parse(ctx: RequestContext, body: bytes) -> None:
    """Parse and validate the body (400); an unknown model, or one no worker serves, is 404."""
    router = ctx.router
    ctx.req = req = parse_request(body, ctx.endpoint)
    ctx.model_label = req.model if req.model in router.tokenizers else "unknown"
    mt = router.tokenizers.get(req.model)
    if mt is None or not router.pool.for_model(req.model):
        raise ModelNotFoundError(f"The model '{req.model}' does not exist")
    ctx.mt = mt


def identify(ctx: RequestContext) -> None:
    """The request's session: an explicit key, or derived from a chat's stable prefix. A raw
    completion prompt without a key gets its session from its chain (`tokenize`)."""
    req = ctx.req
    if req.endpoint is Endpoint.CHAT:
        ctx.session = identify_session(
            ctx.headers, req.body, req.model, req.messages, derived=ctx.router.derived_sessions
        )
    else:
        ctx.session = identify_session(ctx.headers, req.body, req.model, None)


def tokenize(ctx: RequestContext) -> None:
    """Token ids and block hashes of the prompt (only what changed since the session's
    previous turn), and whether the request forks its session: `n > 1`, another request of
    the session in flight, or a prompt that does not extend the previous one."""
    req, mt, session = ctx.req, ctx.mt, ctx.session
    if req.endpoint is Endpoint.CHAT:
        tok = mt.tokenize_chat(session.session_id, req.messages, req.body.get("tools"))
    elif session.session_id is None:
        # its session derives from its chain, so there is no previous turn to start from:
        # hashed whole, once
        tok = mt.tokenize_prompt(None, req.body.get("prompt"))
        ctx.session = session = chain_session(req.model, tok.chain)
    else:
        tok = mt.tokenize_prompt(session.session_id, req.body.get("prompt"))
    ctx.tok = tok
    if mt.chunking is not None:
        chunk(ctx)
    ctx.info = info = ctx.router.sessions.get(session.session_id)
    ctx.is_fork = req.n > 1 or (
        info is not None
        and (info.inflight > 0 or (tok.previous_chain_len > 0 and not tok.extends_previous))
    )


def chunk(ctx: RequestContext) -> None:
    """Chunk reuse (the model's `chunks:` settings): the prompt's chunks (a malformed chunked
    prompt is a 400), and the body the workers get tells them the layout in
    `kv_transfer_params.ownerserve` (`ownerserve/chunks.py`)."""
    req = ctx.req
    cp = ctx.mt.chunk_prompt(ctx.tok, req.messages if req.endpoint is Endpoint.CHAT else None)
    if cp is None:
        return
    ctx.chunks = cp
    body = dict(req.body)
    ktp = body.get("kv_transfer_params")
    params = dict(ktp) if isinstance(ktp, dict) else {}
    params[CHUNK_PARAMS_KEY] = layout_params(cp)
    body["kv_transfer_params"] = params
    ctx.req = replace(req, body=body, raw=orjson.dumps(body))


async def look_up(ctx: RequestContext) -> None:
    """The directory's answer for the chain (and, for a chunked prompt, one lookup per chunk
    hash, concurrently: its holders); without one (backend down and no local view) the
    request is still routed, as if nothing were cached anywhere."""
    router = ctx.router
    directory = router.directory
    assert directory is not None
    chain = ctx.tok.chain
    try:
        if ctx.chunks is None:
            ctx.match = await directory.lookup(chain, ctx.session.session_id)
        else:
            chunks = ctx.chunks.chunks
            found = await asyncio.gather(
                directory.lookup(chain, ctx.session.session_id),
                *(directory.lookup((c.hash,)) for c in chunks),
            )
            ctx.match = found[0]
            holders: dict[str, list[int]] = {}
            for i, m in enumerate(found[1:]):
                for h in m.holdings:
                    if h.tier is Tier.GPU and h.blocks > 0:
                        held = holders.setdefault(h.worker, [])
                        if not held or held[-1] != i:
                            held.append(i)
            ctx.chunk_holders = {w: tuple(ix) for w, ix in holders.items()}
    except Exception as exc:
        router.metrics.directory_errors.inc()
        log.warning("directory lookup failed, routing without it: %r", exc)
        ctx.match = Match(chain_len=len(chain))


def view(ctx: RequestContext) -> None:
    """The policy (`x-ownerserve-policy` when allowed) and the request as it sees it; then
    the session is marked seen with this prompt."""
    router = ctx.router
    override = None
    if router.settings.planner.allow_policy_header:
        override = ctx.headers.get(POLICY_HEADER)
    ctx.policy = router.planner.for_request(override)
    ctx.rview = request_view(ctx)
    sid = ctx.session.session_id
    if sid:
        ctx.info = router.sessions.touch(sid, ctx.tok.prompt_tokens)


def plan(ctx: RequestContext, attempt: int = 0) -> bool:
    """Ask the policy for a plan over the routable workers not yet excluded; False when
    there is none left."""
    router = ctx.router
    cluster = cluster_view(router, ctx.req.model, ctx.match, ctx.excluded, ctx.chunk_holders)
    if not cluster.workers:
        return False
    with router.telemetry.start_span("ownerserve.plan", attempt=attempt):
        ctx.plan = ctx.policy.plan(ctx.rview, cluster)
    return True


async def execute(ctx: RequestContext) -> None:
    """Plan and open the plan's final response (`ctx.opened`); up to `server.retries` times
    more without each worker that failed before the first byte. Each hop is bounded by the
    `server.*_timeout_s` settings; a P/D hand-over or fetch given up runs colocated on the
    plan's decode worker instead (`ctx.fallback` says what ran and why)."""
    router = ctx.router
    tel = router.telemetry
    metrics = router.metrics
    executor = router.executor
    assert executor is not None
    trace: dict[str, str] = {}
    tel.inject(trace)
    out_headers = forward_headers(ctx.raw_headers, bool(router.api_keys), trace)
    last_error: RetryableUpstreamError | None = None
    limits = router.settings.server
    retries = limits.retries
    for attempt in range(retries + 1):
        if not plan(ctx, attempt):
            break
        chosen = ctx.plan.chosen
        nic = _queue_transfer(router, ctx.plan)
        hold(
            ctx,
            _involved(router, ctx.plan),
            router.pool.get(chosen.prefill_worker),
            router.pool.get(chosen.decode_worker),
        )
        # counted from now, not from the first byte: a new session admitted meanwhile must
        # see this one's KV in the working set its prefill is filling
        kv_started(ctx)
        if attempt == 0:
            metrics.overhead.observe(time.perf_counter() - ctx.t0 - ctx.queued_s)
        prefilled: ChunkPrefillOutcome | None = None
        try:
            if ctx.chunks is not None:  # a vLLM worker computes missing chunks first
                prefilled = await prefill_chunks(ctx, chosen.prefill_worker)
            with tel.start_span(
                "ownerserve.upstream",
                action=ctx.plan.action.value,
                prefill=chosen.prefill_worker,
                decode=chosen.decode_worker,
            ) as span:
                opened = await executor.open_plan(
                    ctx.plan,
                    ctx.req,
                    out_headers,
                    _fetch_spec(ctx),
                    limits,
                    chunks=_chunk_fetch_spec(ctx),
                )
                if span is not None and opened.fallback is not None:
                    span.set_attribute("ran", "colocated")
                    span.set_attribute("gave_up", opened.fallback.reason)
            if opened.fallback is None:
                nic = None  # opened: its KV moves (or has moved); a hand-over given up moved none
        except RetryableUpstreamError as exc:
            last_error = exc
            kv_ended(ctx)  # a failure: in flight no more; the next attempt counts it again
            if exc.after is not None:
                _give_up(ctx, exc.after, "colocated")
            if not isinstance(ctx.excluded, set):
                ctx.excluded = set()
            ctx.excluded.add(exc.worker)
            _give_up(
                ctx, GaveUp(exc.worker, exc.cause), "other_worker" if attempt < retries else None
            )
            metrics.retries.labels(exc.worker, "before_first_byte").inc()
            log.warning("retrying without %s: %s", exc.worker, exc.reason)
            continue
        finally:
            if nic is not None:  # the plan failed before it opened: its KV never moved
                router.nics.release(nic[0], nic[1], time.monotonic())
            release(ctx)
        if opened.fetched is not None:
            metrics.kv_fetches.labels(_fetch_result(opened)).inc()
        if opened.fallback is not None:
            _give_up(ctx, opened.fallback, "colocated")
            ctx.planned = ctx.plan
            ctx.plan = _ran_colocated(ctx.plan)
        if prefilled is not None:  # what its sidecar held intact, what was prefilled
            opened.chunks = (prefilled.reused, 0, prefilled.prefilled + prefilled.failed)
        elif ctx.chunks is not None:
            opened.chunks = _chunk_counts(ctx, opened)
        ctx.opened = opened
        return
    if last_error is not None:
        raise UpstreamError(f"no worker could serve the request: {last_error}")
    raise NoWorkerAvailableError(f"no healthy worker serves model '{ctx.req.model}'")


def _fetch_result(opened: OpenedResponse) -> str:
    """`ownerserve_kv_fetches_total`'s result of a plan's fetch or migration."""
    if not opened.fetched:
        fb = opened.fallback
        return "empty" if fb is not None and fb.reason == "kv_fetch_empty" else "failed"
    blocks = opened.fetched_blocks
    return "partial" if blocks is not None and blocks[0] < blocks[1] else "full"


def _give_up(ctx: RequestContext, gave_up: GaveUp, ran: Ran | None) -> None:
    """Record a hop given up before the first byte: its worker's breaker, the timeout and
    fallback counters and, when something ran instead (`ran`), `ctx.fallback`."""
    router = ctx.router
    metrics = router.metrics
    worker = router.pool.get(gave_up.worker)
    if worker is not None and gave_up.reason not in NOT_A_WORKER_FAILURE:
        worker.breaker.record_failure()
        metrics.breaker.labels(gave_up.worker).set(int(worker.breaker.state))
    reason = gave_up.reason
    if reason.endswith("_timeout"):
        metrics.upstream_timeouts.labels(gave_up.worker, reason.removesuffix("_timeout")).inc()
    if ran is None:
        return
    metrics.fallbacks.labels(ran, reason).inc()
    fb = ctx.fallback
    ctx.fallback = Fallback(ran, (gave_up,)) if fb is None else fb.then(ran, gave_up)


def _ran_colocated(plan: Plan) -> Plan:
    """A plan as it ran after its P/D hand-over or fetch was given up: colocated on its
    decode worker (what the commit records). Unpriced (zero costs), so the calibrator learns
    nothing from it: its TTFT includes the hop given up."""
    d = plan.chosen.decode_worker
    return replace(
        plan, chosen=Candidate(Action.COLOCATED_PREFILL, d, d, CostBreakdown()), runner_up=None
    )


def _queue_transfer(router: Router, plan: Plan) -> tuple[str, float] | None:
    """Queue the plan's inter-node KV transfer on its source node's NIC (`t_nic` seconds:
    P for a remote prefill, the source for a fetch or migration); (node, seconds) or None."""
    c = plan.chosen
    seconds = c.cost.t_nic
    if seconds <= 0:
        return None
    src = c.prefill_worker if c.action is Action.REMOTE_PREFILL else c.source_worker
    state = router.pool.get(src) if src else None
    if state is None:
        return None
    node = state.settings.node
    router.nics.reserve(node, seconds, time.monotonic())
    return node, seconds


def _involved(router: Router, plan: Plan) -> list[WorkerState]:
    ids = {plan.chosen.prefill_worker, plan.chosen.decode_worker}
    return [w for w in (router.pool.get(i) for i in ids if i) if w is not None]


def _fetch_spec(ctx: RequestContext) -> FetchSpec | None:
    plan, tok = ctx.plan, ctx.tok
    src = plan.chosen.source_worker
    if plan.action not in (Action.ARTIFACT_FETCH, Action.STATE_MIGRATION) or not src:
        return None
    blocks = plan.chosen.reused_blocks or ctx.match.longest(src)
    blocks = min(blocks or len(tok.chain), len(tok.chain))
    return FetchSpec(tuple(tok.chain[:blocks]), tok.token_ids, ctx.mt.block_size)


def _chunk_fetch_spec(ctx: RequestContext) -> ChunkFetchSpec | None:
    """Chunk reuse: the chunks the plan's prefill worker fetches (`Candidate.chunk_fetches`),
    grouped by holder."""
    fetches = ctx.plan.chosen.chunk_fetches
    if not fetches or ctx.chunks is None:
        return None
    chunks = ctx.chunks.chunks
    by_source: dict[str, list[int]] = {}
    for i, src in fetches:
        if 0 <= i < len(chunks):
            by_source.setdefault(src, []).append(chunks[i].hash)
    return ChunkFetchSpec(tuple((s, tuple(h)) for s, h in by_source.items()))


def _chunk_counts(ctx: RequestContext, opened: OpenedResponse) -> tuple[int, int, int]:
    """(reused, fetched, recomputed) chunks of the prompt as it ran: reused, those the
    directory says the prefill worker that ran holds; fetched, those its KV API says it
    pulled in; recomputed, the rest."""
    assert ctx.chunks is not None
    chunks = ctx.chunks.chunks
    worker = ctx.plan.chosen.prefill_worker
    held = set(ctx.chunk_holders.get(worker, ()))
    fetched = 0
    got = opened.chunks_fetched
    if got is not None and got[0] == worker:
        fetched = sum(1 for i, c in enumerate(chunks) if i not in held and c.hash in got[1])
    reused = sum(1 for i in held if 0 <= i < len(chunks))
    return reused, fetched, len(chunks) - reused - fetched


# --- one request, end to end ------------------------------------------------------------------


async def route(ctx: RequestContext) -> None:
    """Every stage after `parse`, with their trace spans."""
    router = ctx.router
    tel = router.telemetry
    with tel.start_span(
        "ownerserve.request", context=tel.extract(ctx.headers), model=ctx.req.model
    ):
        with tel.start_span("ownerserve.tokenize"):
            identify(ctx)
            tokenize(ctx)
        # admission before the lookup: a request released after a wait is planned on what the
        # directory and the loads say then, not on what they said when it arrived
        admission = router.admission
        session = ctx.session
        if not admission.admit_now(ctx.req.model, session.session_id, session.parent):
            ctx.queued_s = await admission.wait(
                ctx.req.model, session.session_id, ctx.tok.prompt_tokens, ctx.out, session.parent
            )
        with tel.start_span("ownerserve.directory.lookup", blocks=len(ctx.tok.chain)):
            await look_up(ctx)
        view(ctx)
        hold_session(ctx)
        try:
            await execute(ctx)
            await stream(ctx)
            record_service(ctx)
        finally:
            kv_ended(ctx)
            release_session(ctx)


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
    """Serve one completion request: `body` already read, or `read()` reads it (after the
    API key check). Every failure becomes an OpenAI error response, or an SSE error event
    when the response already started; a client disconnect ends it quietly."""
    if not router.started:
        await router.start()
    ctx = RequestContext(router, endpoint, raw_headers, out, t0)
    metrics = router.metrics
    try:
        router.check_auth(ctx.headers)
        if body is None:
            assert read is not None
            body = await read()
        parse(ctx, body)
        async with asyncio.timeout(router.settings.server.request_timeout_s):
            await route(ctx)
        metrics.of(metrics.requests, ctx.model_label, "ok").inc()
    except ClientDisconnected:
        return
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if out.disconnected and task is not None:
            task.uncancel()
            metrics.of(metrics.requests, ctx.model_label, "client_disconnected").inc()
            return
        raise
    except BaseException as exc:
        out.detach()  # what follows must not be cancelled by a late disconnect
        if isinstance(exc, TimeoutError):
            exc = UpstreamTimeoutError("request timed out")
        if not isinstance(exc, Exception):
            raise
        status, err = error_status_and_body(exc)
        metrics.of(metrics.requests, ctx.model_label, str(status)).inc()
        if out.started:
            await out.fail(exc)
            return
        headers = [(b"content-type", b"application/json")]
        if isinstance(exc, RateLimitError):
            headers.append((b"retry-after", str(exc.retry_after_s).encode()))
        await out.start(status, headers, err)
